"""A ``file://`` tier as one member of a fleet sharing its directory (WEKA, VAST, NFS).

:class:`FleetMember` is what :class:`~kvtier.tiers.fsspec.FsspecTier` holds for a local or
mounted directory: the use log of its reads (:mod:`kvtier.tiers.fleet_uses`, ``use_log=``)
and, with ``fleet_capacity=``, the background gc of the whole directory
(:mod:`kvtier.tiers.fleet_gc`, one node at a time under the lease of
:mod:`kvtier.tiers.fleet_lease`), and the watch on the directory (``watch=SECONDS``,
:class:`~kvtier.events_watch.DirectoryWatch`): when a gc of another process (``kvtier gc``,
another node's fleet gc: both write the epoch marker) or a wipe changed the directory, the
tier rechecks the blocks it holds and reports the ones gone (KV events). The tier calls it
at four points: a hit (:meth:`FleetMember.note_read`), its ``open``
(:meth:`FleetMember.start`), ``stats`` and ``aclose``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.events_watch import DEFAULT_WATCH_INTERVAL, EPOCH_NAME, DirectoryWatch
from kvtier.tiers.fleet_gc import FleetCollector
from kvtier.tiers.fleet_lease import LEASE_DIR
from kvtier.tiers.fleet_uses import UseRecorder, writer_name
from kvtier.urls import parse_bool, parse_number, parse_size

__all__ = ["FLEET_OPTIONS", "LEASE_TTL", "FleetMember", "check_fleet_options",
           "fleet_options"]

#: URL options of a ``file://`` tier handled here.
FLEET_OPTIONS = frozenset({"use_log", "fleet_capacity", "gc_interval", "watch"})
#: Seconds after which the background gc's lease, not refreshed, is taken over (a pass
#: refreshes it every ttl / 20 seconds; well above any NFS attribute cache time).
LEASE_TTL = 300.0


def fleet_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """``use_log``, ``fleet_capacity``, ``gc_interval`` and ``watch`` (seconds between looks
    at the directory, 0: off) parsed from URL options (those present only), as keyword
    arguments of the tier."""
    out: dict[str, Any] = {}
    if "use_log" in params:
        out["use_log"] = parse_bool(params["use_log"], "use_log")
    if params.get("fleet_capacity") not in (None, ""):
        out["fleet_capacity"] = parse_size(params["fleet_capacity"], "fleet_capacity")
    if "gc_interval" in params:
        out["gc_interval"] = parse_number(params["gc_interval"], "gc_interval", float, 0.001)
    if "watch" in params:
        out["watch"] = parse_number(params["watch"], "watch", float, 0.0)
    return out


def check_fleet_options(protocol: str, fleet_capacity: int | None, gc_interval: float) -> None:
    """Refuse what cannot work.

    Raises
    ------
    ConfigError
        ``fleet_capacity`` not positive or on another protocol than ``file://``, or
        ``gc_interval`` not positive.
    """
    if fleet_capacity is not None:
        if protocol not in ("file", "local"):
            raise ConfigError(f"fleet_capacity: for file:// tiers only, not {protocol}:// "
                              "(trim an object store with kvtier gc)")
        if fleet_capacity <= 0:
            raise ConfigError(f"fleet_capacity: expected a positive size, got {fleet_capacity}")
    if not gc_interval > 0:
        raise ConfigError(f"gc_interval: expected > 0 seconds, got {gc_interval!r}")


class FleetMember:
    """The fleet side of one ``file://`` tier object.

    Parameters
    ----------
    root
        The shared directory.
    use_log
        Log this tier's reads (see :class:`~kvtier.tiers.fleet_uses.UseRecorder`).
    fleet_capacity
        Byte budget of the whole directory, kept by a background gc; ``None``: no gc here.
    gc_interval
        Seconds between the background gc's passes.
    forget
        Called with the keys a gc pass of this node deleted (the tier fixes its accounting).
    watch
        Seconds between looks at the directory's epoch marker and entries (0: no watch).
    recheck
        Awaited after the directory changed (the tier forgets what is gone).
    """

    def __init__(self, root: str, *, use_log: bool, fleet_capacity: int | None,
                 gc_interval: float, forget: Callable[[list[bytes]], None],
                 watch: float = DEFAULT_WATCH_INTERVAL,
                 recheck: Callable[[], Awaitable[None]] | None = None) -> None:
        self.watch: DirectoryWatch | None = None
        if watch > 0 and recheck is not None:
            self.watch = DirectoryWatch([root, os.path.join(root, LEASE_DIR, EPOCH_NAME)],
                                        watch, recheck, name=f"file tier {root}")
        self.uses = UseRecorder(root) if use_log else None
        self.collector: FleetCollector | None = None
        if fleet_capacity is not None:
            self.collector = FleetCollector(
                root, fleet_capacity, gc_interval,
                holder=self.uses.writer if self.uses is not None else writer_name(),
                forget=lambda paths: forget(_keys_of(paths)),
                before=self.uses.flush if self.uses is not None else None,
                lease_ttl=LEASE_TTL)

    def note_read(self, path: str) -> None:
        """A hit on the block file at ``path`` (on the loop; a set insertion)."""
        if self.uses is not None:
            self.uses.note(path.rpartition("/")[2].removesuffix(".kvb"))

    def start(self) -> None:
        """Start the background gc and the watch, if any (on the loop; idempotent)."""
        if self.collector is not None:
            self.collector.start()
        if self.watch is not None:
            self.watch.start()

    async def aclose(self) -> None:
        """Stop the watch and the gc (waiting for a pass in progress) and write the pending
        use log."""
        if self.watch is not None:
            await self.watch.aclose()
        if self.collector is not None:
            await self.collector.aclose()
        if self.uses is not None:
            await self.uses.aclose()

    def stats(self) -> dict[str, Any]:
        """The use log's and the background gc's figures."""
        watch = {"watch_changes": self.watch.changes, "watch_errors": self.watch.errors} \
            if self.watch is not None else {}
        return {**(self.uses.stats() if self.uses is not None else {"use_log": False}),
                **(self.collector.stats() if self.collector is not None else {}), **watch}


def _keys_of(paths: list[str]) -> list[bytes]:
    """Keys named by their hex in these block paths (digest-named keys cannot be mapped
    back: the tier notices them at its next read)."""
    keys = []
    for path in paths:
        with contextlib.suppress(ValueError):
            keys.append(bytes.fromhex(path.rpartition("/")[2].removesuffix(".kvb")))
    return keys
