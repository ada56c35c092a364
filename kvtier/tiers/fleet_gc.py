"""Trimming a shared ``file://`` directory as a whole: scan, plan, delete under the gc lease.

Used by ``kvtier gc`` and by a ``file://...?fleet_capacity=SIZE`` tier, which runs it in the
background every ``gc_interval`` seconds (:class:`FleetCollector`). A block's last use is
the latest of its modification time and the reads any node logged
(:mod:`kvtier.tiers.fleet_uses`); access time only with ``use_atime`` (reads do not write
it and most mounts use ``relatime``/``noatime``). The least recently used blocks go first
until the total fits, and writers' temp files older than ``tmp_age``.

A pass that deleted blocks writes the directory's epoch marker (``ROOT/.kvtier-gc/epoch``,
:func:`~kvtier.events_watch.bump_epoch`): the tiers serving the directory in other processes
recheck what they hold and report what went (KV events).

One gc per directory at a time: a pass holds :class:`~kvtier.tiers.fleet_lease.GcLease`,
refreshes it as it scans and deletes (every ``ttl / 20`` seconds), and stops when it finds
it lost. A block rewritten since the scan
(its mtime changed) is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.events_watch import bump_epoch
from kvtier.tiers.base import run_to_end
from kvtier.tiers.fleet_lease import LEASE_DIR, GcLease
from kvtier.tiers.fleet_uses import USE_DIR, fold_segments, read_uses

__all__ = ["BLOCK_RE", "TMP_RE", "Entry", "FleetCollector", "GcResult", "collect_local",
           "plan", "scan_local"]

log = logging.getLogger("kvtier.tiers.fsspec")

_SUFFIX = ".kvb"  # kvtier.tiers.fsspec.BLOCK_SUFFIX (that module imports this one)
BLOCK_RE = re.compile(r"^(?:[0-9a-f]{2,200}|h[0-9a-f]{64})" + re.escape(_SUFFIX) + "$")
TMP_RE = re.compile(r"^\..+" + re.escape(_SUFFIX) + r"\.[0-9a-f]{32}\.tmp$")
# A pass asks whether to go on (stopped? lease lost?) before each directory, every this
# many files scanned and every this many deletes; it refreshes its lease at most every
# ttl / _REFRESHES_PER_TTL seconds (a scan of millions of files on NFS takes minutes).
_CHECK_SCANNED = 8192
_CHECK_DELETED = 256
_REFRESHES_PER_TTL = 20


@dataclass(frozen=True)
class Entry:
    """One block or temp file under the tier root."""

    path: str
    size: int
    last_use: float
    temp: bool
    mtime_ns: int = 0


@dataclass
class GcResult:
    """What one gc pass found and did."""

    files: int = 0
    total: int = 0
    remaining: int = 0
    freed: int = 0
    deleted: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    lease_lost: bool = False


def scan_local(root: str, uses: dict[str, float], *, use_atime: bool = False,
               going: Callable[[], bool] = lambda: True) -> Iterator[Entry]:
    """Every block and temp file under ``root``, with its last use: the later of its mtime
    (and atime with ``use_atime``) and its last logged read in ``uses``. ``going`` is asked
    before each directory and every few thousand files; the scan ends when it says no."""
    stack = [root]
    seen = 0
    while stack and going():
        try:
            with os.scandir(stack.pop()) as it:
                for item in it:
                    if item.is_dir(follow_symlinks=False):
                        if item.name not in (USE_DIR, LEASE_DIR):
                            stack.append(item.path)
                        continue
                    temp = bool(TMP_RE.match(item.name))
                    if not (temp or BLOCK_RE.match(item.name)):
                        continue
                    seen += 1
                    if seen % _CHECK_SCANNED == 0 and not going():
                        return
                    with contextlib.suppress(FileNotFoundError):
                        st = item.stat(follow_symlinks=False)
                        last = max(st.st_mtime, st.st_atime if use_atime else 0.0,
                                   uses.get(item.name[:-len(_SUFFIX)], 0.0))
                        yield Entry(item.path, st.st_size, last, temp, st.st_mtime_ns)
        except FileNotFoundError:
            continue  # removed concurrently


def plan(entries: list[Entry], capacity: int, *, now: float,
         tmp_age: float) -> tuple[list[Entry], int]:
    """Entries to delete (stale temp files, then least recently used blocks) and the bytes
    that remain."""
    doomed = [e for e in entries if e.temp and now - e.last_use > tmp_age]
    blocks = sorted((e for e in entries if not e.temp), key=lambda e: e.last_use)
    total = sum(e.size for e in entries) - sum(e.size for e in doomed)
    for entry in blocks:
        if total <= capacity:
            break
        doomed.append(entry)
        total -= entry.size
    return doomed, total


def _unchanged(entry: Entry) -> bool:
    """Whether ``entry`` is still the file the scan saw (not rewritten by a put since)."""
    try:
        return entry.temp or os.lstat(entry.path).st_mtime_ns == entry.mtime_ns
    except FileNotFoundError:
        return False


def collect_local(root: str, capacity: int, lease: GcLease | None, *,
                  tmp_age: float = 3600.0, use_atime: bool = False,
                  use_horizon: float = 7 * 86400.0, dry_run: bool = False,
                  stop: threading.Event | None = None) -> GcResult:
    """Trim ``root`` to ``capacity`` bytes. Blocking: run it in a worker thread. ``lease``
    (held) is refreshed as the deletes go, and the pass stops if it was lost; ``stop`` ends
    it early (a closing tier). Logged reads older than ``use_horizon`` seconds are
    forgotten. Folds the use logs into their summary at the end."""
    result = GcResult()
    refreshed = -math.inf

    def going() -> bool:
        nonlocal refreshed
        if stop is not None and stop.is_set():
            return False
        if lease is not None and not result.lease_lost and \
                time.monotonic() - refreshed >= lease.ttl / _REFRESHES_PER_TTL:
            refreshed = time.monotonic()
            result.lease_lost = not lease.refresh()
        return not result.lease_lost

    uses, segments = read_uses(root)
    horizon = time.time() - use_horizon
    uses = {name: when for name, when in uses.items() if when >= horizon}
    entries = list(scan_local(root, uses, use_atime=use_atime, going=going))
    if not going():
        return result  # stopped or lost the lease mid-scan: a partial scan decides nothing
    now = time.time()
    doomed, _ = plan(entries, capacity, now=now, tmp_age=tmp_age)
    result.files, result.total = len(entries), sum(e.size for e in entries)
    gone: set[str] = set()
    for n, entry in enumerate(doomed):
        if n % _CHECK_DELETED == 0 and not going():
            break
        if not dry_run:
            if not _unchanged(entry):
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass  # another node deleted it first
            except OSError as exc:
                result.failed.append((entry.path, str(exc)))
                continue
        result.freed += entry.size
        result.deleted.append(entry.path)
        gone.add(os.path.basename(entry.path)[:-len(_SUFFIX)])
    result.remaining = result.total - result.freed
    if result.deleted and not dry_run:
        # The tiers serving this directory (other processes, other nodes) recheck what they
        # hold and report the blocks gone (kvtier.events_watch).
        try:
            bump_epoch(os.path.join(root, LEASE_DIR), f"gc {lease.holder if lease else ''}")
        except OSError as exc:
            log.warning("gc of %s: cannot write the epoch marker (%s); serving tiers notice "
                        "the deletions only when they read those blocks", root, exc)
    if not dry_run and going():
        kept = {os.path.basename(e.path)[:-len(_SUFFIX)] for e in entries if not e.temp}
        kept -= gone
        fold_segments(root, {k: v for k, v in uses.items() if k in kept}, segments, now=now)
    return result


class FleetCollector:
    """A tier's background gc of its shared directory (``fleet_capacity=``): a pass every
    ``interval`` seconds, when this node gets the lease.

    Concurrency: the passes run in a worker thread, one at a time; :meth:`aclose` stops a
    pass at its next file and waits for it, so nothing is deleted after it returns.

    Parameters
    ----------
    root
        The shared directory.
    capacity
        Byte budget of the whole directory.
    interval
        Seconds between passes (the first runs when :meth:`start` is called).
    holder
        This node's name on the lease.
    forget
        Called on the loop with the paths a pass deleted (the tier drops its own keys).
    before
        Awaited before each pass (the tier writes its pending use log, so its own recent
        reads count).
    lease_ttl
        Seconds after which another node takes over a lease not refreshed.
    """

    def __init__(self, root: str, capacity: int, interval: float, holder: str,
                 forget: Callable[[list[str]], None],
                 before: Callable[[], Awaitable[None]] | None = None, *,
                 lease_ttl: float = 300.0) -> None:
        self.root = root
        self.capacity = capacity
        self.interval = interval
        self.lease = GcLease(root, holder, ttl=lease_ttl)
        self._forget = forget
        self._before = before
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self.runs = self.skipped = self.deleted = self.freed = self.errors = 0
        self.last_remaining: int | None = None

    def start(self) -> None:
        """Start the passes on the running loop (once)."""
        if self._task is None and not self._stop.is_set():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.collect()
            except OSError as exc:  # the mount went away for a while: try again later
                self.errors += 1
                log.warning("fleet gc of %s failed: %s", self.root, exc)
            await asyncio.sleep(self.interval)

    async def collect(self) -> GcResult | None:
        """One pass now; ``None`` when another node holds the lease."""
        if self._before is not None:
            await self._before()
        result = await run_to_end(asyncio.ensure_future(asyncio.to_thread(self._once)))
        if result is None:
            self.skipped += 1
            return None
        self.runs += 1
        self.deleted += len(result.deleted)
        self.freed += result.freed
        self.errors += len(result.failed)
        self.last_remaining = result.remaining
        self._forget(result.deleted)
        return result

    def _once(self) -> GcResult | None:
        if self._stop.is_set() or not self.lease.acquire():
            return None
        try:
            return collect_local(self.root, self.capacity, self.lease, stop=self._stop)
        finally:
            self.lease.release()

    async def aclose(self) -> None:
        """Stop the passes; a pass in progress stops at its next file and is waited for."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def stats(self) -> dict[str, Any]:
        """``fleet_capacity``, ``gc_runs``, ``gc_skipped`` (another node held the lease),
        ``gc_deleted``, ``gc_freed_bytes``, ``gc_errors``, ``gc_remaining_bytes`` (after
        this node's last pass)."""
        return {"fleet_capacity": self.capacity, "gc_runs": self.runs,
                "gc_skipped": self.skipped, "gc_deleted": self.deleted,
                "gc_freed_bytes": self.freed, "gc_errors": self.errors,
                "gc_remaining_bytes": self.last_remaining}
