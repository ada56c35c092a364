"""Trimming a shared ``file://`` directory as a whole: the scan, the plan, the deletes, and
the lease that lets one node at a time do it.

Used by ``kvtier gc`` and by a ``file://...?fleet_capacity=SIZE`` tier, which runs it in the
background every ``gc_interval`` seconds. A block's last use is the latest of its
modification time, its access time and the reads every node logged
(:mod:`kvtier.tiers.uselog`); the least recently used blocks go first, and writers' temp
files older than ``tmp_age``.

The lease (``ROOT/.kvtier-gc.lease``, created exclusively, refreshed while a gc runs, taken
over once ``lease_ttl`` seconds old) keeps the nodes of a fleet from scanning the same
directory at once. It is an economy, not a safety device: two gcs that do overlap (two nodes
taking over one expired lease together) delete idempotently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.fsspec import BLOCK_SUFFIX
from kvtier.tiers.uselog import read_uses, stale_logs

__all__ = ["LEASE_NAME", "Entry", "FleetCollector", "GcLease", "GcResult", "collect_local",
           "plan", "scan_local"]

log = logging.getLogger("kvtier.tiers.fsspec")

LEASE_NAME = ".kvtier-gc.lease"
BLOCK_RE = re.compile(r"^(?:[0-9a-f]{2,200}|h[0-9a-f]{64})" + re.escape(BLOCK_SUFFIX) + "$")
TMP_RE = re.compile(r"^\..+" + re.escape(BLOCK_SUFFIX) + r"\.[0-9a-f]{32}\.tmp$")


@dataclass(frozen=True)
class Entry:
    """One file under the tier root."""

    path: str
    size: int
    last_use: float
    temp: bool


@dataclass
class GcResult:
    """What one gc pass found and did."""

    files: int = 0
    total: int = 0
    remaining: int = 0
    freed: int = 0
    deleted: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def scan_local(root: str) -> Iterator[Entry]:
    """Every block and temp file under ``root``, with its last use."""
    uses = read_uses(root)
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for item in it:
                    if item.is_dir(follow_symlinks=False):
                        stack.append(item.path)
                    elif item.is_file(follow_symlinks=False):
                        block = bool(BLOCK_RE.match(item.name))
                        temp = bool(TMP_RE.match(item.name))
                        if block or temp:
                            st = item.stat(follow_symlinks=False)
                            last = max(st.st_atime, st.st_mtime, uses.get(item.name, 0.0))
                            yield Entry(item.path, st.st_size, last, temp)
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


def collect_local(root: str, capacity: int, *, tmp_age: float = 3600.0,
                  use_horizon: float = 7 * 86400.0, dry_run: bool = False,
                  stop: threading.Event | None = None,
                  lease: GcLease | None = None) -> GcResult:
    """Trim ``root`` to ``capacity`` bytes (blocking: run it in a thread). ``stop`` ends the
    deletes early (a closing tier); a held ``lease`` is refreshed as the deletes go."""
    entries = list(scan_local(root))
    now = time.time()
    doomed, remaining = plan(entries, capacity, now=now, tmp_age=tmp_age)
    result = GcResult(files=len(entries), total=sum(e.size for e in entries),
                      remaining=remaining)
    if not dry_run:
        for path in stale_logs(root, now, use_horizon):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for n, entry in enumerate(doomed):
        if lease is not None and n % 256 == 0:
            lease.refresh()
        if stop is not None and stop.is_set():
            result.remaining += sum(e.size for e in doomed[len(result.deleted):])
            break
        if not dry_run:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass  # another node or gc got there first
            except OSError as exc:
                result.failed.append((entry.path, str(exc)))
                continue
        result.freed += entry.size
        result.deleted.append(entry.path)
    return result


class GcLease:
    """``ROOT/.kvtier-gc.lease``: at most one holder at a time, taken over once stale.

    Parameters
    ----------
    root
        The shared directory.
    holder
        Who holds it (written into the file, checked before a release).
    ttl
        Seconds after its last refresh that a lease counts as abandoned.
    """

    def __init__(self, root: str, holder: str, ttl: float = 600.0) -> None:
        self.path = os.path.join(root, LEASE_NAME)
        self.holder = holder
        self.ttl = ttl

    def acquire(self) -> bool:
        """Take the lease if it is free or stale; whether this holder has it now."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    age = time.time() - os.stat(self.path).st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                if age <= self.ttl:
                    return False
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # abandoned (its holder died mid-gc)
                continue
            try:
                os.write(fd, f"{self.holder}\n".encode())
            finally:
                os.close(fd)
            return True
        return False

    def refresh(self) -> None:
        """Tell the others the holder is still at work."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path)

    def release(self) -> None:
        """Give the lease back, if it is still this holder's."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                mine = fh.read().strip() == self.holder
        except FileNotFoundError:
            return
        if mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class FleetCollector:
    """A tier's background gc of its shared directory (``fleet_capacity=``): a pass every
    ``interval`` seconds when this node gets the lease.

    Parameters
    ----------
    root
        The shared directory.
    capacity
        Byte budget of the whole directory.
    interval
        Seconds between passes (the first runs at :meth:`start`).
    holder
        This node's name on the lease.
    forget
        Called on the loop with the paths a pass deleted (the tier drops its own keys).
    before
        Awaited before each pass (the tier writes its pending use log, so its own recent
        reads count).
    """

    def __init__(self, root: str, capacity: int, interval: float, holder: str,
                 forget: Callable[[list[str]], None],
                 before: Callable[[], Awaitable[None]] | None = None) -> None:
        self.root = root
        self.capacity = capacity
        self.interval = interval
        self.lease = GcLease(root, holder, ttl=max(600.0, 10 * interval))
        self._forget = forget
        self._before = before
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self.runs = self.skipped = self.deleted = self.freed = self.errors = 0

    def start(self) -> None:
        """Start the passes on the running loop."""
        if self._task is None:
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
        done = asyncio.get_running_loop().run_in_executor(None, self._once)
        try:
            result = await asyncio.shield(done)
        except asyncio.CancelledError:
            self._stop.set()  # the pass stops at its next delete; wait for it to let go
            with contextlib.suppress(Exception):
                await done
            raise
        if result is None:
            self.skipped += 1
            return None
        self.runs += 1
        self.deleted += len(result.deleted)
        self.freed += result.freed
        self.errors += len(result.failed)
        self._forget(result.deleted)
        return result

    def _once(self) -> GcResult | None:
        if not self.lease.acquire():
            return None
        try:
            return collect_local(self.root, self.capacity, stop=self._stop, lease=self.lease)
        finally:
            self.lease.release()

    async def aclose(self) -> None:
        """Stop the passes (a pass in progress stops at its next delete)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def stats(self) -> dict[str, Any]:
        """``fleet_capacity``, ``gc_runs``, ``gc_skipped`` (another node held the lease),
        ``gc_deleted``, ``gc_freed_bytes``, ``gc_errors``."""
        return {"fleet_capacity": self.capacity, "gc_runs": self.runs,
                "gc_skipped": self.skipped, "gc_deleted": self.deleted,
                "gc_freed_bytes": self.freed, "gc_errors": self.errors}
