"""URL options shared by the persistent tiers (``lmdb://`` and fsspec URLs)."""

from __future__ import annotations

from kvtier.errors import ConfigError

__all__ = ["parse_compress"]

_DEFAULT_ZSTD_LEVEL = 1


def parse_compress(value: object, name: str = "compress") -> int | None:
    """Parse ``compress=``: ``zstd:LEVEL`` (1..22), ``zstd`` (level 1), or
    ``none``/``0``/empty for no compression. Returns the zstd level or ``None``.

    Raises
    ------
    ConfigError
        Naming the option, for anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(f"{name}: expected 'zstd:LEVEL' or 'none', got {value!r}")
    text = str(value).strip().lower()
    if text in ("", "0", "none", "false", "off"):
        return None
    codec, _, level_text = text.partition(":")
    if codec != "zstd":
        raise ConfigError(f"{name}: unknown codec {codec!r} (supported: zstd:LEVEL, none)")
    if not level_text:
        return _DEFAULT_ZSTD_LEVEL
    if not level_text.isdigit() or not 1 <= int(level_text) <= 22:
        raise ConfigError(f"{name}: zstd level must be 1..22, got {level_text!r}")
    return int(level_text)
