"""Block use of a shared ``file://`` directory, recorded without atime.

Reads never write file metadata (a read-only mount must work, and most mounts use
``relatime`` or ``noatime``), so a block's access time says little about when a node last
read it, and ``kvtier gc`` ranking by atime/mtime would evict hot blocks. Instead every tier
object appends the names of the blocks it read to its own log under
``ROOT/.kvtier-use/``, one file per writer and hour (``<writer>.<hour>.log``, lines
``<unix time> <block file name>``), and the gc takes a block's last use as the latest of
its modification time and its logged reads.

- Cheap on the read path: a hit adds the name to an in-memory set; a background task
  appends the set every ``interval`` seconds (and at close) in one write from a worker
  thread. The set is bounded; past it the oldest interval's names are written early.
- One file per writer: appends never interleave between nodes, on NFS either.
- A node that cannot write the log (a read-only reader) says so once and stops logging;
  its reads still work.
- Logs older than the gc's horizon are deleted by the gc.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator

__all__ = ["USE_DIR", "UseLog", "read_uses", "stale_logs"]

log = logging.getLogger("kvtier.tiers.fsspec")

#: Folder under the tier root holding the use logs (a dot folder: not a block path).
USE_DIR = ".kvtier-use"
_LOG_SUFFIX = ".log"
_MAX_PENDING = 65536  # names held before an early write


class UseLog:
    """The reads of one tier object, appended to its own log under ``root/.kvtier-use``.

    Parameters
    ----------
    root
        The tier's root directory.
    interval
        Seconds between appends.
    """

    def __init__(self, root: str, interval: float = 5.0) -> None:
        self.directory = os.path.join(root, USE_DIR)
        self.interval = interval
        self.writer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.enabled = True
        self.lines_written = 0
        self._pending: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def note(self, name: str) -> None:
        """Record a read of the block file ``name`` (its base name)."""
        if not self.enabled:
            return
        self._pending.add(name)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif len(self._pending) >= _MAX_PENDING:
            self._task.cancel()  # _run writes what is pending and starts over
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.enabled:
                await asyncio.sleep(self.interval)
                await self.flush()
        except asyncio.CancelledError:
            await self.flush()

    async def flush(self) -> None:
        """Append what was read since the last write."""
        if not self._pending or not self.enabled:
            return
        names, self._pending = self._pending, set()
        try:
            await asyncio.to_thread(self._append, names, time.time())
        except OSError as exc:
            self.enabled = False
            log.warning("cannot write the use log in %s (%s); this node's reads will not "
                        "keep blocks from kvtier gc (a read-only reader?)", self.directory, exc)

    def _append(self, names: set[str], now: float) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory,
                            f"{self.writer}.{int(now // 3600)}{_LOG_SUFFIX}")
        data = "".join(f"{now:.0f} {name}\n" for name in sorted(names)).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self.lines_written += len(names)

    async def aclose(self) -> None:
        """Write what is pending and stop the background task."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush()


def _logs(root: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(os.path.join(root, USE_DIR)) as it:
            yield from (e for e in it if e.is_file() and e.name.endswith(_LOG_SUFFIX))
    except (FileNotFoundError, NotADirectoryError):
        return


def read_uses(root: str) -> dict[str, float]:
    """The last logged read of each block file name under ``root`` (every writer's logs).
    Lines that do not parse (a torn last line of a crashed writer) are skipped."""
    last: dict[str, float] = {}
    for entry in _logs(root):
        try:
            with open(entry.path, encoding="ascii", errors="replace") as fh:
                for line in fh:
                    stamp, _, name = line.rstrip("\n").partition(" ")
                    try:
                        when = float(stamp)
                    except ValueError:
                        continue
                    if name and when > last.get(name, 0.0):
                        last[name] = when
        except FileNotFoundError:
            continue  # deleted by another gc meanwhile
    return last


def stale_logs(root: str, now: float, horizon: float) -> list[str]:
    """Use logs last written more than ``horizon`` seconds before ``now``."""
    out = []
    for entry in _logs(root):
        with contextlib.suppress(FileNotFoundError):
            if now - entry.stat().st_mtime > horizon:
                out.append(entry.path)
    return out
