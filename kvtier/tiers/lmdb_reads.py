"""Where an ``lmdb://`` tier's reads run: on the event loop when they can, else in a worker
thread.

Every LMDB transaction runs start to commit inside one call of
:class:`~kvtier.tiers.lmdb_env.BlockEnv`, and reads copy out before their transaction ends.
Such a call runs in a worker thread, except (``inline_reads``, on by default) a read of at
most :data:`INLINE_READ_BYTES` whose values are uncompressed and in the page cache
(``mincore``): it runs on the event loop, since it then costs a checksum and a memcpy, less
than the thread hop (about 65 us on the benchmark machine, ``docs/performance.md``). Its
B-tree lookup touches a few pages that every read and write of the tier touches too; were
one evicted, that read would take one page fault on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.deadline import in_thread
from kvtier.errors import CorruptBlockError
from kvtier.tasks import TaskSet
from kvtier.tiers.base import Block, copy_into
from kvtier.tiers.lmdb_env import BlockEnv, NotResident

__all__ = ["INLINE_READ_BYTES", "EnvReader"]

T = TypeVar("T")

#: Reads of at most this many frame bytes (one 4 MiB block and its header) may run on the
#: event loop (``inline_reads``).
INLINE_READ_BYTES = (4 << 20) + 4096


class EnvReader:
    """The reads of one LMDB tier's environment, on the loop or in a worker thread.

    Parameters
    ----------
    inline
        Whether reads may run on the event loop (``inline_reads`` where ``mincore`` is
        available).
    frame_bytes
        Stored bytes of a held block (above :data:`INLINE_READ_BYTES` when unknown).
    track
        Where the worker-thread calls are tracked, so the tier's close waits for them.

    Notes
    -----
    Runs on the tier's event loop; the tier hands each call the environment it has open.
    ``reads_inline`` counts the reads served on the loop.
    """

    def __init__(self, *, inline: bool, frame_bytes: Callable[[bytes], int],
                 track: TaskSet) -> None:
        self.inline = inline
        self.reads_inline = 0  # reads served on the loop (resident, uncompressed)
        self._frame_bytes = frame_bytes
        self._track = track

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread."""
        # asyncio.to_thread without its Task wrapper (one loop hop less per read). Shielded
        # and tracked: a cancelled caller does not drop the future while its thread is still
        # inside the environment, and aclose() waits for it.
        return await in_thread(fn, *args, what="lmdb read", wait_started=False,
                               track=self._track)

    async def read(self, env: BlockEnv, keys: list[bytes]) -> list[Any]:
        """``env.read(keys)``: resident groups of at most ``INLINE_READ_BYTES`` on the loop,
        yielding between groups (a batch holds the loop no longer than a single inline get
        does), and the rest, from the first group that is not resident, in one thread hop.
        A batch of 16 x 1 MiB read in one thread ran at 0.93x its single gets per byte."""
        out: list[Any] = []
        start = 0
        while self.inline and start < len(keys):
            end, size = start, 0
            while end < len(keys):
                grown = size + self._frame_bytes(keys[end])
                if grown > INLINE_READ_BYTES:
                    break
                size, end = grown, end + 1
            if end == start:
                break  # the next block alone is too large to read on the loop
            try:
                out += env.read(keys[start:end], resident_only=True)
            except NotResident:
                break
            self.reads_inline += 1
            start = end
            if start < len(keys):
                await asyncio.sleep(0)
        if start < len(keys):
            out += await self.in_thread(env.read, keys[start:])
        return out

    async def read_into(self, env: BlockEnv, key: bytes, out: Block
                        ) -> bool | CorruptBlockError:
        """Copy ``key`` into ``out``: straight from the map when it can be read on the loop;
        else a worker thread reads it into memory of the tier's own (a read-arena slot) and
        the copy into ``out`` happens here, after the await, so a caller that gave up (a
        store deadline) never finds ``out`` written later."""
        if self.inline and self._frame_bytes(key) <= INLINE_READ_BYTES:
            try:
                found = env.read_into(key, out, resident_only=True)
            except NotResident:
                pass
            else:
                self.reads_inline += 1
                return found
        res = (await self.in_thread(env.read, [key]))[0]
        if res is None:
            return False
        if isinstance(res, CorruptBlockError):
            return res
        copy_into(res, out)  # checks ``out`` first: a mismatch raises before any write
        return True
