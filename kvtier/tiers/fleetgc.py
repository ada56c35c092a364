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

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.tiers.fsspec import BLOCK_SUFFIX
from kvtier.tiers.uselog import read_uses, stale_logs

__all__ = ["LEASE_NAME", "Entry", "GcLease", "GcResult", "collect_local", "plan", "scan_local"]

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
