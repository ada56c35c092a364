"""An ``lmdb://`` tier's options: its URL, and the size of its memory map.

:meth:`~kvtier.tiers.lmdb.LMDBTier.from_url` takes the tier's keyword arguments from
:func:`tier_arguments` (the query options, merged with keyword options); ``kvtier gc`` and
the read-only tier of ``kvtier explain`` take the directory from :func:`path_of_url`.
:func:`map_size` is what ``data.mdb`` may grow to: the budget plus
:func:`default_overhead` (or the ``overhead=`` given), in whole pages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import unquote

from kvtier.codec import parse_compress
from kvtier.errors import ConfigError
from kvtier.policy import Clock
from kvtier.tiers.budget import parse_policy
from kvtier.urls import merge_options, parse_bool, parse_number, parse_size, parse_tier_url

__all__ = ["DEFAULT_OVERHEAD_FIXED", "TierArguments", "default_overhead", "map_size",
           "path_of_url", "tier_arguments"]

DEFAULT_OVERHEAD_FIXED = 8 << 20
_UNBOUNDED_MAP_SIZE = 1 << 40
_SYNC_VALUES = {"0": "0", "false": "0", "off": "0", "no": "0", "meta": "meta",
                "1": "1", "true": "1", "on": "1", "yes": "1"}


class TierArguments(TypedDict, total=False):
    """Keyword arguments of :class:`~kvtier.tiers.lmdb.LMDBTier` (its docstring says what
    each means)."""

    capacity: int | None
    compress_level: int | None
    shuffle: bool
    sync: str
    writemap: bool
    inline_reads: bool
    overhead: int | None
    policy: str
    name: str | None
    clock: Clock
    touch_flush: int
    watch: float


def default_overhead(capacity: int) -> int:
    """Room ``data.mdb`` gets on top of the budget: 1/8 of it plus 8 MiB.

    It pays for page rounding (a value takes whole 4 KiB pages plus a 16-byte page header:
    a 64 KiB block uses 17 pages), B-tree and free-list pages, and pages freed by the last two
    commits, which LMDB cannot reuse yet.
    """
    return capacity // 8 + DEFAULT_OVERHEAD_FIXED


def map_size(capacity: int | None, overhead: int | None) -> int:
    """``map_size`` of an environment: ``capacity`` plus ``overhead`` (default
    :func:`default_overhead`) rounded up to whole pages; 1 TiB for an unbounded tier."""
    page = os.sysconf("SC_PAGE_SIZE")
    if capacity is None:
        size = _UNBOUNDED_MAP_SIZE
    else:
        size = capacity + (default_overhead(capacity) if overhead is None else overhead)
    return -(-size // page) * page


def path_of_url(url: str) -> Path:
    """The directory an ``lmdb://`` URL names.

    Raises
    ------
    ConfigError
        When it names none (a host, no path, the root).
    """
    parsed = parse_tier_url(url)
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"url: lmdb:// takes an absolute path (lmdb:///dir), got {url!r}")
    path = unquote(parsed.path)
    if path in ("", "/"):
        raise ConfigError(f"url: lmdb:// needs a directory, e.g. lmdb:///nvme/kvtier, got "
                          f"{url!r}")
    return Path(path)


def tier_arguments(url: str, options: dict[str, Any]) -> tuple[Path, TierArguments]:
    """The directory and keyword arguments of the tier an ``lmdb://`` URL describes
    (``options``: keyword options, which win over the URL's).

    Raises
    ------
    ConfigError
        For an unknown option or a malformed value (the message names it).
    """
    parsed = parse_tier_url(url)
    path = path_of_url(url)
    opts = merge_options(parsed, options, {"capacity", "compress", "shuffle", "sync",
                                           "writemap", "overhead", "name", "clock",
                                           "touch_flush", "policy", "inline_reads",
                                           "watch"})
    capacity = opts.get("capacity")
    overhead = opts.get("overhead")
    sync_text = str(opts.get("sync", "0")).strip().lower()
    if sync_text not in _SYNC_VALUES:
        raise ConfigError(f"sync: expected 0, meta or 1, got {opts['sync']!r}")
    arguments = TierArguments(
        capacity=None if capacity in (None, "") else parse_size(capacity),  # type: ignore[arg-type]
        compress_level=parse_compress(opts.get("compress")),
        shuffle=parse_bool(opts.get("shuffle", False), "shuffle"),  # type: ignore[arg-type]
        sync=_SYNC_VALUES[sync_text],
        writemap=parse_bool(opts.get("writemap", False), "writemap"),  # type: ignore[arg-type]
        inline_reads=parse_bool(opts.get("inline_reads", True), "inline_reads"),  # type: ignore[arg-type]
        overhead=None if overhead in (None, "") else parse_size(overhead, "overhead"),  # type: ignore[arg-type]
        policy=parse_policy(opts.get("policy")),
        name=str(opts["name"]) if "name" in opts else None,
    )
    if "clock" in opts:
        arguments["clock"] = opts["clock"]  # type: ignore[typeddict-item]
    if "touch_flush" in opts:
        arguments["touch_flush"] = int(str(opts["touch_flush"]))
    if "watch" in opts:
        arguments["watch"] = parse_number(opts["watch"], "watch", float, 0.0)
    return path, arguments
