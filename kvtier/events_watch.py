"""Noticing what other processes did to a tier's directory, so that its KV events stay true.

A router subscribed to a running store (``kvtier serve --events``) learns what each tier
admits and drops from that store's own calls. Another process can change a directory
under it: ``kvtier gc`` (or a fleet gc on another node) deletes blocks of a shared
``file://`` directory, an operator wipes a directory. The serving process must then say so
(``BlockRemoved`` for what went, ``AllBlocksCleared`` for a tier left empty), without a
cost on every ``get``. So:

- whoever deletes blocks of a ``file://`` directory writes its **epoch marker**
  (:func:`bump_epoch`: ``ROOT/.kvtier-gc/epoch``, a new random id per gc pass that
  deleted something);
- a serving tier polls a few paths' ``stat`` on a timer (:class:`DirectoryWatch`: the
  marker and the directory itself, whose entries change when it is wiped) and, when one
  moved, checks what it holds against storage, reporting what is gone.

An ``lmdb://`` directory has one owner process; ``kvtier gc`` asks that owner to trim
itself through a request file it watches (:mod:`kvtier.tiers.lmdb_gc`).

Cost: one ``stat`` per watched path per interval, in a worker thread; a recheck (one
``stat`` per held block) only after a change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

__all__ = ["DEFAULT_WATCH_INTERVAL", "EPOCH_NAME", "DirectoryWatch", "bump_epoch",
           "write_json_atomically"]

log = logging.getLogger("kvtier.events")

#: The epoch marker's file name (in a ``file://`` tier's gc directory ``ROOT/.kvtier-gc``).
EPOCH_NAME = "epoch"
#: Seconds between a serving tier's looks at its directory (URL option ``watch=``).
DEFAULT_WATCH_INTERVAL = 2.0

#: What a path looked like: ``(inode, mtime ns, size)``, ``None`` when it is not there.
Signature = tuple[tuple[int, int, int] | None, ...]


def write_json_atomically(path: Path, record: dict[str, object]) -> None:
    """Write ``record`` as JSON to ``path`` through a temp file and a rename (a reader never
    sees half of it). Blocking."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def bump_epoch(directory: str | os.PathLike[str], what: str) -> None:
    """Tell the tiers watching ``directory`` that blocks under it were deleted: write a new
    epoch marker there (``what``: who and why, for logs). Blocking.

    Raises
    ------
    OSError
        When the marker cannot be written (the caller decides whether that matters).
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomically(folder / EPOCH_NAME, {"epoch": uuid.uuid4().hex,
                                                "time": time.time(), "what": what})


def signature(paths: Sequence[Path]) -> Signature:
    """``(inode, mtime ns, size)`` of each path (``None``: missing or unreadable)."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class DirectoryWatch:
    """Polls ``paths`` every ``interval`` seconds and awaits ``changed()`` when any of them
    moved (appeared, vanished, was replaced or rewritten) since the last look.

    Concurrency: one task on the loop :meth:`start` ran on; the ``stat`` calls run in a
    worker thread (a hung NFS mount stalls the watch, never the loop); ``changed`` is
    awaited before the next look, so rechecks never overlap. A failing ``changed`` is
    logged and counted (``errors``); the watch goes on.

    Parameters
    ----------
    paths
        Files or directories to watch.
    interval
        Seconds between looks (> 0).
    changed
        Awaited on the loop after a change was seen.
    name
        For logs.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], interval: float,
                 changed: Callable[[], Awaitable[None]], *, name: str) -> None:
        if not interval > 0:
            raise ValueError(f"interval: expected > 0 seconds, got {interval!r}")
        self.paths = [Path(p) for p in paths]
        self.interval = interval
        self.name = name
        self._changed = changed
        self._last: Signature | None = None
        self._task: asyncio.Task[None] | None = None
        self.changes = self.errors = 0

    def start(self) -> None:
        """Start polling on the running loop (idempotent); the first look, taken at once,
        is the baseline."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def look(self) -> bool:
        """Look once now; await ``changed`` if something moved. Returns whether it did."""
        now = await asyncio.to_thread(signature, self.paths)
        if self._last is None or now == self._last:  # the first look is the baseline
            self._last = now
            return False
        self._last = now
        self.changes += 1
        try:
            await self._changed()
        except Exception as exc:  # a failing recheck must not end the watch
            self.errors += 1
            log.warning("%s: recheck after a change of %s failed: %r", self.name,
                        ", ".join(map(str, self.paths)), exc)
        return True

    async def _run(self) -> None:
        if self._last is None:
            self._last = await asyncio.to_thread(signature, self.paths)
        while True:
            await asyncio.sleep(self.interval)
            await self.look()

    async def aclose(self) -> None:
        """Stop polling (a recheck in progress is cancelled at its next await)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
