"""The write-through queue: background copies of puts into the lower tiers.

Bounded: when the queue is full, ``enqueue`` waits (backpressure) - writes are never dropped.
A queued write is skipped if the key was put again or deleted since (its generation moved),
and writes of one key hold the key's lock, so an old value never lands after a newer one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from kvtier.singleflight import KeyRegistry, KeyState
from kvtier.stats import StoreCounters
from kvtier.tiers.base import Block

__all__ = ["WriteThrough"]

log = logging.getLogger("kvtier.store")
#: ``write(tier_index, key, block) -> accepted``; must not raise for tier failures.
TierWrite = Callable[[int, bytes, Block], Awaitable[bool]]


@dataclass(slots=True)
class _Item:
    key: bytes
    block: Block
    gen: int
    state: KeyState
    first_tier: int


class WriteThrough:
    """Queue + workers writing blocks into tiers ``first_tier..n_tiers-1``.

    Workers start on the first :meth:`enqueue` (they need a running loop).
    """

    def __init__(self, *, keys: KeyRegistry, write: TierWrite, n_tiers: int, size: int,
                 workers: int, counters: StoreCounters) -> None:
        self._keys = keys
        self._write = write
        self._n_tiers = n_tiers
        self._size = size
        self._n_workers = workers
        self._counters = counters
        self._queue: asyncio.Queue[_Item] | None = None
        self._workers: list[asyncio.Task[None]] = []

    @property
    def depth(self) -> int:
        """Writes queued and not yet picked up by a worker."""
        return self._queue.qsize() if self._queue is not None else 0

    async def enqueue(self, key: bytes, block: Block, first_tier: int) -> None:
        """Queue ``block`` for the tiers from ``first_tier`` down; waits while the queue is full."""
        if first_tier >= self._n_tiers:
            return
        if self._queue is None:
            self._queue = asyncio.Queue(self._size)
            self._workers = [asyncio.create_task(self._worker(self._queue), name=f"kvtier-wt-{i}")
                             for i in range(self._n_workers)]
        state = self._keys.watch(key)
        # The caller may reuse its buffer once put returns; the queue needs its own copy.
        item = _Item(key, np.array(block, copy=True), state.gen, state, first_tier)
        try:
            await self._queue.put(item)
        except BaseException:
            self._keys.unwatch(key, state)
            raise

    async def _worker(self, queue: asyncio.Queue[_Item]) -> None:
        while True:
            item = await queue.get()
            try:
                await self._write_below(item)
            except Exception:  # pragma: no cover - the write callback already catches
                log.exception("write-through of %s failed", item.key.hex())
            finally:
                self._keys.unwatch(item.key, item.state)
                queue.task_done()

    async def _write_below(self, item: _Item) -> None:
        async with item.state.lock:
            for index in range(item.first_tier, self._n_tiers):
                if item.state.gen != item.gen:
                    self._counters.write_through_superseded += 1
                    return
                if await self._write(index, item.key, item.block):
                    self._counters.write_through_writes += 1

    async def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        if self._queue is not None:
            await self._queue.join()

    async def aclose(self) -> None:
        """Flush, then stop the workers."""
        try:
            await self.flush()
        finally:
            for task in self._workers:
                task.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)
            self._workers = []
