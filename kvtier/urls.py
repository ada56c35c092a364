"""Parsing of tier URLs and the option values they carry (sizes, booleans, secrets)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit

from kvtier.errors import ConfigError

__all__ = ["TierURL", "merge_options", "parse_bool", "parse_number", "parse_secret", "parse_size",
           "parse_tier_url"]

N = TypeVar("N", int, float)

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
    "p": 1 << 50,
    "pb": 1000**5,
    "pib": 1 << 50,
}
# Digit counts are bounded so float()/int() can neither overflow nor hit int's digit limit.
_SIZE_RE = re.compile(r"^\s*(\d{1,30}(?:\.\d{1,30})?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, name: str = "capacity") -> int:
    """Parse a byte size such as ``"8GiB"``, ``"500MB"``, ``"1.5G"`` or ``4096``.

    Parameters
    ----------
    value
        An ``int`` number of bytes or a string: a non-negative number and an optional unit
        (``B``, ``KiB``/``MiB``/``GiB``/``TiB``/``PiB``, decimal ``KB``/``MB``/``GB``/``TB``/``PB``,
        or the binary shorthands ``K``/``M``/``G``/``T``/``P``), case-insensitive.
    name
        The argument name quoted in error messages.

    Returns
    -------
    int
        The size in bytes.

    Raises
    ------
    ConfigError
        If the value is negative, has an unknown unit or is not a number.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a size string or int, got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ConfigError(f"{name}: cannot parse size {value!r} (expected e.g. '8GiB', '500MB')")
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        known = "B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB, PB, K, M, G, T, P"
        raise ConfigError(f"{name}: unknown unit {unit!r} in {value!r} (known: {known})")
    return int(float(number) * multiplier) if "." in number else int(number) * multiplier


def parse_number(value: object, name: str, cast: type[N], low: float) -> N:
    """A URL option as ``cast`` (``int`` or ``float``) of at least ``low``; ``ConfigError``
    for text that is not one, and for NaN (which no bound check would catch)."""
    try:
        number = cast(str(value).strip())
    except ValueError:
        kind = "an integer" if cast is int else "a number"
        raise ConfigError(f"{name}: expected {kind}, got {value!r}") from None
    if not number >= low:  # also false for NaN
        raise ConfigError(f"{name}: expected >= {low}, got {value!r}")
    return number


def parse_bool(value: str | bool | int, name: str) -> bool:
    """Parse ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (case-insensitive)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}: expected a boolean (1/0, true/false), got {value!r}")


def parse_secret(value: str, name: str) -> str:
    """Resolve ``env:VAR`` and ``file:PATH`` references; other values are literal secrets."""
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a str secret, got {type(value).__name__}")
    if value.startswith("env:"):
        var = value[4:]
        secret = os.environ.get(var)
        if secret is None:
            raise ConfigError(f"{name}: environment variable {var!r} is not set")
        return secret
    if value.startswith("file:"):
        path = value[5:]
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read secret file {path!r}: {exc}") from exc
    return value


@dataclass(frozen=True)
class TierURL:
    """A split tier URL: ``scheme://netloc/path?query``."""

    url: str
    scheme: str
    netloc: str
    path: str
    params: dict[str, str] = field(default_factory=dict)


def parse_tier_url(url: str) -> TierURL:
    """Split a tier URL into scheme, location and query options.

    Raises
    ------
    ConfigError
        If ``url`` is not a string, has no scheme or repeats a query option.
    """
    if not isinstance(url, str):
        raise ConfigError(f"url: expected str, got {type(url).__name__}")
    if "://" not in url:
        raise ConfigError(f"url: {url!r} has no scheme (expected e.g. 'dram://?capacity=8GiB')")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unterminated IPv6 literal
        raise ConfigError(f"url: cannot parse {url!r}: {exc}") from None
    if not parts.scheme:
        raise ConfigError(f"url: {url!r} has no scheme (expected e.g. 'dram://?capacity=8GiB')")
    params: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if key in params:
            raise ConfigError(f"url: option {key!r} given twice in {url!r}")
        params[key] = value
    return TierURL(
        url=url,
        scheme=parts.scheme.lower(),
        netloc=parts.netloc,
        path=parts.path,
        params=params,
    )


def merge_options(
    parsed: TierURL, options: dict[str, object], allowed: set[str]
) -> dict[str, object]:
    """Merge URL query options with keyword options (keywords win), refusing unknown names.

    Raises
    ------
    ConfigError
        Naming the unknown option and listing the allowed ones.
    """
    merged: dict[str, object] = {**parsed.params, **options}
    unknown = sorted(set(merged) - allowed)
    if unknown:
        raise ConfigError(f"url: unknown option(s) {', '.join(unknown)} for {parsed.scheme}:// "
                          f"(allowed: {', '.join(sorted(allowed)) or 'none'})")
    return merged
