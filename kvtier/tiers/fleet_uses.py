"""Block use in a shared ``file://`` directory, recorded without atime.

Reads write no file metadata (a read-only mount must work, and most mounts use ``relatime``
or ``noatime``), so a block's access time says little about when a node last read it. Each
tier object therefore appends the names of the blocks it read to its own log under
``ROOT/.kvtier-uses/``, and the gc (:mod:`kvtier.tiers.fleet_gc`) takes a block's last use
from those logs, falling back to its modification time.

Layout and format
-----------------
- ``ROOT/.kvtier-uses/<writer>.<start>.log``: one writer (tier object) per file, so appends
  of different nodes never interleave, on NFS either (``O_APPEND`` is atomic only within
  one client). Lines are ``<unix time> <block name>`` (the file name without ``.kvb``); a
  torn last line of a crashed writer is skipped by the reader.
- ``ROOT/.kvtier-uses/summary``: written by the gc (temp file, then rename): the last use
  of every block that survived it, taken from the segments it then deletes.

Bounded
-------
- The read path only adds a name to an in-memory set. A background task writes the set every
  ``interval`` seconds in one ``write`` from a worker thread, skipping names it logged less
  than ``resolution`` seconds ago (a hot block costs one line per ``resolution``, not one
  per read). The set is capped: past :data:`MAX_PENDING` names it is written at once.
- A writer starts a new segment every ``segment_age`` seconds or ``segment_bytes`` bytes,
  and deletes its own segments older than ``retention``. The gc folds segments closed for
  more than two ``segment_age`` into the summary and deletes them.
- A writer that cannot write the log (a read-only reader: ``EROFS``, ``EACCES``, ``EPERM``;
  a file where the log folder should be) says so once and stops logging; its reads work as
  before. Other errors (a full or flaky mount) are logged (one line a minute at most) and
  the next write tries again.

Clocks: times in the logs are the writers' wall clocks; nodes are assumed to be NTP-synced
to well under ``segment_age`` (an hour by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvtier.tasks import TaskSet
from kvtier.tiers.base import run_to_end
from kvtier.warnsummary import WarningSummary

__all__ = ["MAX_PENDING", "SUMMARY_NAME", "USE_DIR", "UseRecorder", "fold_segments",
           "read_uses", "writer_name"]

log = logging.getLogger("kvtier.tiers.fsspec")

#: Folder under the tier root holding the use logs (a dot folder: never a block path).
USE_DIR = ".kvtier-uses"
SUMMARY_NAME = "summary"
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_.-]+\.(\d+)\.log$")
#: Names held before the set is written early.
MAX_PENDING = 65536
# Names remembered as recently logged (for ``resolution``); older ones may be logged twice.
_RECENT_NAMES = 1 << 18
# Errors that will not go away by themselves (a read-only mount, permissions, a file where
# the log folder should be): the writer stops; others (a full or flaky mount) it retries.
_PERMANENT = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR)


def writer_name() -> str:
    """``<host>-<pid>-<random>``: names this process's writer (and lease holder)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "node"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class UseRecorder:
    """The reads of one tier object, appended to its own log under ``root/.kvtier-uses``.

    Concurrency: :meth:`note` is called on the event loop (the tier's read path) and costs a
    set insertion; the writes happen in one background task, one worker thread at a time.
    :meth:`aclose` writes what is pending and returns once nothing more will be written.

    Parameters
    ----------
    root
        The tier's root directory.
    interval
        Seconds between writes.
    resolution
        A name logged less than this many seconds ago is not logged again.
    segment_age, segment_bytes
        When a writer starts a new segment file.
    retention
        The writer deletes its own segments older than this.
    clock
        Wall-clock time source (tests).
    """

    def __init__(self, root: str, *, interval: float = 5.0, resolution: float = 60.0,
                 segment_age: float = 3600.0, segment_bytes: int = 64 << 20,
                 retention: float = 7 * 86400.0, clock: Callable[[], float] = time.time) -> None:
        self.directory = os.path.join(root, USE_DIR)
        self.writer = writer_name()
        self.interval = interval
        self.resolution = resolution
        self.segment_age = segment_age
        self.segment_bytes = segment_bytes
        self.retention = retention
        self._clock = clock
        self.enabled = True
        self.lines = self.errors = 0
        self._pending: set[str] = set()
        self._recent: OrderedDict[str, float] = OrderedDict()
        self._segment: tuple[str, float] | None = None  # path, start time
        self._last_start = -1  # segment names stay unique within one second
        self._runner = TaskSet()  # the one task that writes every interval
        self._wake: asyncio.Event | None = None
        self._writing = asyncio.Lock()  # one append at a time (the loop's and a gc's)
        self._warnings = WarningSummary(log, interval=60.0)  # a flaky mount: a line a minute
        self._closed = False

    def note(self, name: str) -> None:
        """Record a read of block ``name`` (file name without suffix). On the loop."""
        if not self.enabled or self._closed:
            return
        self._pending.add(name)
        if not self._runner:
            self._wake = asyncio.Event()
            self._runner.start(self._run(), name="kvtier-use-log")
        elif len(self._pending) >= MAX_PENDING and self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        wake = self._wake
        while self.enabled and wake is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.interval)
            wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write the names noted since the last write (those not logged within
        ``resolution``)."""
        if not self._pending or not self.enabled:
            return
        now = self._clock()
        names = [n for n in self._pending if now - self._recent.get(n, -1e18) >= self.resolution]
        self._pending = set()
        if not names:
            return
        try:
            async with self._writing:
                # Waited for to its end, even by a cancelled caller: an append in a worker
                # thread cannot be stopped, and must not land after aclose returned.
                await run_to_end(asyncio.ensure_future(
                    asyncio.to_thread(self._append, names, now)))
        except OSError as exc:
            self.errors += 1
            self._segment = None  # start afresh (its folder may have been removed)
            if exc.errno in _PERMANENT:
                self.enabled = False
                log.warning("cannot write the use log in %s (%s): this node's reads will not "
                            "keep blocks from the gc (a read-only reader?)", self.directory, exc)
            else:
                self._warnings.warn(f"use log {self.directory}", "write", str(exc))
            return
        for name in names:
            self._recent[name] = now
            self._recent.move_to_end(name)
        while len(self._recent) > _RECENT_NAMES:
            self._recent.popitem(last=False)

    def _append(self, names: Iterable[str], now: float) -> None:
        path = self._current_segment(now)
        data = "".join(f"{now:.0f} {name}\n" for name in names).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        self.lines += data.count(b"\n")
        if size >= self.segment_bytes:
            self._segment = None  # the next write starts a new one

    def _current_segment(self, now: float) -> str:
        if self._segment is None or now - self._segment[1] >= self.segment_age:
            os.makedirs(self.directory, exist_ok=True)
            self._drop_old_segments(now)
            start = self._last_start = max(int(now), self._last_start + 1)
            path = os.path.join(self.directory, f"{self.writer}.{start}.log")
            self._segment = (path, float(start))
        return self._segment[0]

    def _drop_old_segments(self, now: float) -> None:
        with os.scandir(self.directory) as it:
            mine = [e for e in it if e.name.startswith(self.writer + ".")]
        for entry in mine:
            found = _SEGMENT_RE.match(entry.name)
            if found and now - int(found.group(1)) > self.retention:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    async def aclose(self) -> None:
        """Write what is pending and stop; nothing is written after this returns."""
        await self._runner.cancel_all()
        await self.flush()
        self._closed = True
        self._warnings.flush()

    def stats(self) -> dict[str, Any]:
        """``use_log`` (whether it writes), ``use_log_lines`` and ``use_log_errors``."""
        return {"use_log": self.enabled, "use_log_lines": self.lines,
                "use_log_errors": self.errors}


def _parse_lines(lines: Iterable[str], into: dict[str, float]) -> None:
    for line in lines:
        if not line.endswith("\n"):
            continue  # torn by a writer that died mid-append
        stamp, _, name = line.rstrip("\n").partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        if name and when > into.get(name, 0.0):
            into[name] = when


def _segments(root: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(os.path.join(root, USE_DIR)) as it:
            yield from (e for e in it if _SEGMENT_RE.match(e.name))
    except (FileNotFoundError, NotADirectoryError):
        return


def read_uses(root: str) -> tuple[dict[str, float], list[str]]:
    """The last logged read of each block name under ``root`` (summary and every writer's
    segments), and the segments read."""
    last: dict[str, float] = {}
    read: list[str] = []
    directory = os.path.join(root, USE_DIR)
    for path in [os.path.join(directory, SUMMARY_NAME), *(e.path for e in _segments(root))]:
        try:
            with open(path, encoding="ascii", errors="replace") as fh:
                _parse_lines(fh, last)
        except FileNotFoundError:
            continue  # no summary yet, or a segment deleted by its writer meanwhile
        if not path.endswith(SUMMARY_NAME):
            read.append(path)
    return last, read


def _older_than(paths: Iterable[str], now: float, age: float) -> list[str]:
    found = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            if now - os.stat(path).st_mtime > age:
                found.append(path)
    return found


def fold_segments(root: str, uses: dict[str, float], segments: list[str], *,
                  now: float, segment_age: float = 3600.0) -> int:
    """Fold the ``segments`` closed for more than ``2 * segment_age`` (their writer has moved
    on: it never appends to a segment older than ``segment_age``) into the summary: write
    ``uses`` (the last use of every block still present) as the summary, then delete them.
    Nothing is written while no segment is closed, so the summary is rewritten about once
    per ``segment_age`` and writer, not at every gc pass. Blocking; run under the gc lease.
    Returns the segments deleted."""
    directory = os.path.join(root, USE_DIR)
    closed = _older_than(segments, now, 2 * segment_age)
    if not closed:
        return 0
    tmp = os.path.join(directory, f".{SUMMARY_NAME}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="ascii") as fh:
            fh.writelines(f"{when:.0f} {name}\n" for name, when in uses.items())
        os.replace(tmp, os.path.join(directory, SUMMARY_NAME))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The temp files of a gc that died while writing the summary go too.
    leftovers = [e.path for e in os.scandir(directory)
                 if e.name.startswith(f".{SUMMARY_NAME}.") and e.name.endswith(".tmp")
                 and e.path != tmp]
    for path in [*closed, *_older_than(leftovers, now, 2 * segment_age)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return len(closed)
