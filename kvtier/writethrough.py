"""The write-through queue: background copies of puts into the lower tiers.

Bounded by bytes (and by item count): when admitting a block would exceed the bound,
``enqueue`` waits (backpressure); writes are never dropped. A block larger than the byte
bound is admitted alone, when nothing else is pending. The bound covers blocks queued *and*
being written, so it bounds the memory the queue holds. A queued write is skipped if the key
was put again or deleted since (its generation moved), and writes of one key hold the key's
lock, so an old value never lands after a newer one.

:meth:`WriteThrough.flush` is a watermark: it waits for the writes queued before it was
called, not for the queue to be empty (which, under a steady stream of puts, it never is).
:meth:`WriteThrough.enqueue` can also count a write into a :class:`WritesDone`, the
completion of one caller's own writes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.singleflight import KeyRegistry, KeyState
from kvtier.stats import StoreCounters
from kvtier.tasks import TaskSet
from kvtier.tiers.base import Block

__all__ = ["WriteThrough", "WritesDone"]

log = logging.getLogger("kvtier.store")
#: ``write(tier_index, key, block) -> accepted``; must not raise for tier failures.
TierWrite = Callable[[int, bytes, Block], Awaitable[bool]]


class WritesDone:
    """Completion of the write-through writes one call queued (what
    :meth:`TieredStore.put_many <kvtier.store.TieredStore.put_many>` returns).

    ``await done`` (or ``await done.wait()``) returns once each of those writes has been
    attempted in every tier below (or skipped because the key was written or deleted again
    since, or the store closed); writes other calls queued are not waited for. Tier failures
    are counted in the store's stats, not raised here. A caller that does not need it can drop
    it: nothing is left pending. Use it on the store's event loop.
    """

    __slots__ = ("_event", "_left")

    def __init__(self) -> None:
        self._left = 0
        self._event = asyncio.Event()
        self._event.set()  # nothing queued yet

    def done(self) -> bool:
        """Whether every write counted here has been attempted."""
        return self._event.is_set()

    async def wait(self) -> None:
        """Wait until every write counted here has been attempted."""
        await self._event.wait()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    def _add(self) -> None:
        self._left += 1
        self._event.clear()

    def _finish(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._event.set()

    def __repr__(self) -> str:
        return f"<WritesDone {'done' if self.done() else f'{self._left} pending'}>"


@dataclass(slots=True)
class _Item:
    key: bytes
    block: Block
    gen: int
    state: KeyState
    first_tier: int
    seq: int
    done: WritesDone | None


class WriteThrough:
    """Queue + workers writing blocks into tiers ``first_tier..n_tiers-1``.

    Parameters
    ----------
    keys
        The store's per-key registry (generations and per-key locks).
    write
        Writes one block into one tier (the store's counted, guarded write).
    n_tiers
        Number of tiers in the chain.
    max_bytes, max_items
        Bounds of what is pending (queued or being written).
    workers
        Tasks draining the queue; they start on the first :meth:`enqueue` (they need a
        running loop).
    counters
        Store-wide counters (``write_through_writes``, ``write_through_superseded``).
    """

    def __init__(self, *, keys: KeyRegistry, write: TierWrite, n_tiers: int, max_bytes: int,
                 max_items: int, workers: int, counters: StoreCounters) -> None:
        self._keys = keys
        self._write = write
        self._n_tiers = n_tiers
        self._max_bytes = max_bytes
        self._max_items = max_items
        self._n_workers = workers
        self._counters = counters
        self._queue: collections.deque[_Item] = collections.deque()
        self._pending_bytes = 0
        self._pending_items = 0
        # Sequence numbers of the writes queued or being written, oldest first (an
        # OrderedDict: the oldest is found in O(1) however many finished before it).
        self._next_seq = 0
        self._unfinished: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._changed: asyncio.Condition | None = None
        self._workers = TaskSet()

    @property
    def depth(self) -> int:
        """Writes queued and not yet picked up by a worker."""
        return len(self._queue)

    @property
    def pending_bytes(self) -> int:
        """Bytes of blocks queued or being written."""
        return self._pending_bytes

    def _fits(self, nbytes: int) -> bool:
        if self._pending_items == 0:
            return True  # alone, any block fits (else a big one would wait forever)
        return (self._pending_items < self._max_items
                and self._pending_bytes + nbytes <= self._max_bytes)

    async def enqueue(self, key: bytes, block: Block, first_tier: int,
                      done: WritesDone | None = None) -> None:
        """Queue ``block`` for the tiers from ``first_tier`` down; waits while full.

        ``done``, if given, counts this write until it has been attempted.
        """
        if first_tier >= self._n_tiers:
            return
        if self._changed is None:
            self._changed = asyncio.Condition()
            for i in range(self._n_workers):
                self._workers.start(self._worker(self._changed), name=f"kvtier-wt-{i}")
        changed = self._changed
        nbytes = block.nbytes
        async with changed:
            await changed.wait_for(lambda: self._fits(nbytes))
            state = self._keys.watch(key)
            # The caller may reuse its buffer once put returns; the queue needs its own copy.
            seq = self._next_seq
            self._next_seq += 1
            self._queue.append(_Item(key, np.array(block, copy=True), state.gen, state,
                                     first_tier, seq, done))
            self._unfinished[seq] = None
            if done is not None:
                done._add()
            self._pending_bytes += nbytes
            self._pending_items += 1
            changed.notify_all()

    async def _worker(self, changed: asyncio.Condition) -> None:
        while True:
            async with changed:
                await changed.wait_for(lambda: bool(self._queue))
                item = self._queue.popleft()
            try:
                await self._write_below(item)
            except Exception:  # pragma: no cover - the write callback already catches
                log.exception("write-through of %s failed", item.key.hex())
            finally:
                self._keys.unwatch(item.key, item.state)
                self._finished(item)  # before any await: a cancelled worker still counts it
                async with changed:
                    changed.notify_all()

    def _finished(self, item: _Item) -> None:
        self._pending_bytes -= item.block.nbytes
        self._pending_items -= 1
        del self._unfinished[item.seq]
        if item.done is not None:
            item.done._finish()

    async def _write_below(self, item: _Item) -> None:
        async with item.state.lock:
            for index in range(item.first_tier, self._n_tiers):
                if item.state.gen != item.gen:
                    self._counters.write_through_superseded += 1
                    return
                if await self._write(index, item.key, item.block):
                    self._counters.write_through_writes += 1

    def _written_below(self, mark: int) -> bool:
        """Whether every write with a sequence number below ``mark`` has been attempted."""
        return not self._unfinished or next(iter(self._unfinished)) >= mark

    async def flush(self) -> None:
        """Wait until every write queued before this call has been attempted.

        Writes queued meanwhile are not waited for, so a flush returns under a steady stream
        of puts.
        """
        changed = self._changed
        if changed is None:
            return
        mark = self._next_seq
        async with changed:
            await changed.wait_for(lambda: self._written_below(mark))

    async def aclose(self) -> None:
        """Flush, then stop the workers.

        If the flush is cancelled, the writes still queued are abandoned and their
        :class:`WritesDone` completions released.
        """
        try:
            await self.flush()
        finally:
            await self._workers.cancel_all()
            while self._queue:
                item = self._queue.popleft()
                self._keys.unwatch(item.key, item.state)
                self._finished(item)
