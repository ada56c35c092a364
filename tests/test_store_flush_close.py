"""``flush()`` is a watermark and ``put_many`` hands back the completion of its own
write-through writes (issue 20, bug 3): under a steady stream of puts the queue is never
empty, and a flush that waited for that never returned. ``aclose()`` lets the calls in flight
finish before it closes the tiers under them (issue 20, suspected item)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvtier.errors import ClosedError
from kvtier.store import TieredStore
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Block
from kvtier.tiers.dram import DRAMTier


async def _steady_puts(store: TieredStore, first: int, started: asyncio.Event) -> None:
    """Keep the write-through queue non-empty: a new key every few milliseconds, forever."""
    i = first
    while True:
        await store.put(key_of(i), sample_block(i))
        i += 1
        if i - first >= 4:
            started.set()


async def test_flush_returns_under_steady_put_load() -> None:
    slow = LatencyTier(DRAMTier(), delay=0.005)
    async with TieredStore([DRAMTier(), slow], write_policy="write_through",
                           write_workers=1, write_queue_size=8) as store:
        for i in range(3):
            await store.put(key_of(i), sample_block(i))
        started = asyncio.Event()
        load = asyncio.create_task(_steady_puts(store, 1000, started))
        try:
            await started.wait()
            await asyncio.wait_for(store.flush(), 5)
            # Everything queued before the flush is below; the load kept going meanwhile.
            assert all([await slow.inner.contains(key_of(i)) for i in range(3)])
            assert not load.done()
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load


class _GatedTier(DRAMTier):
    """A DRAM tier whose puts of the keys in ``held`` wait until ``gate`` is set."""

    def __init__(self, held: set[bytes]) -> None:
        super().__init__()
        self.held = held
        self.gate = asyncio.Event()

    async def _put(self, key: bytes, block: Block) -> None:
        if key in self.held:
            await self.gate.wait()
        await super()._put(key, block)


async def test_put_many_completion_waits_for_its_own_writes_only() -> None:
    lower = _GatedTier({key_of(0)})
    async with TieredStore([DRAMTier(), lower], write_policy="write_through",
                           write_workers=2) as store:
        await store.put(key_of(0), sample_block(0))  # its write-through write hangs
        try:
            written = await store.put_many([(key_of(i), sample_block(i)) for i in (1, 2)])
            await asyncio.wait_for(written, 5)
            assert written.done()
            assert [await lower.contains(key_of(i)) for i in (0, 1, 2)] == [False, True, True]
            flushing = asyncio.ensure_future(store.flush())
            await asyncio.sleep(0.02)
            assert not flushing.done()  # the flush does wait for key 0's write
        finally:
            lower.gate.set()
        await asyncio.wait_for(flushing, 5)
        assert await lower.contains(key_of(0))


async def test_put_many_completion_is_done_without_write_through() -> None:
    async with TieredStore([DRAMTier(), DRAMTier()]) as store:
        written = await store.put_many([(key_of(1), sample_block(1))])
        assert written.done()
        await written
        assert (await store.put_many([])).done()


async def test_put_many_completion_is_released_when_close_abandons_the_queue() -> None:
    lower = _GatedTier({key_of(1)})
    store = TieredStore([DRAMTier(), lower], write_policy="write_through", write_workers=1)
    written = await store.put_many([(key_of(1), sample_block(1)), (key_of(2), sample_block(2))])
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0.02)
    closing.cancel()  # the close's flush is cut short; the queued write is abandoned
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    await asyncio.wait_for(written, 5)
    assert store.closed and store.stats()["write_through_writes"] == 0


async def test_vllm_save_waits_for_its_own_writes_not_the_whole_queue() -> None:
    """A vLLM save reports finished once its blocks are below, even while another request's
    write-through write is still pending (a flush of the whole queue would wait for it)."""
    from kvtier.integrations.vllm import _put_and_wait_written

    lower = _GatedTier({key_of(0)})
    async with TieredStore([DRAMTier(), lower], write_policy="write_through",
                           write_workers=2) as store:
        await store.put(key_of(0), sample_block(0))
        try:
            await asyncio.wait_for(
                _put_and_wait_written(store, items=[(key_of(1), sample_block(1))]), 5)
            assert await lower.contains(key_of(1)) and not await lower.contains(key_of(0))
        finally:
            lower.gate.set()


async def test_close_lets_a_put_in_flight_finish_its_demotion() -> None:
    """A put whose eviction is demoting into a slow tier when ``aclose`` starts: the demotion
    lands (the block is not lost to a tier closed under it), and calls made after ``aclose``
    began raise ``ClosedError``."""
    one_block = sample_block(1).nbytes
    slow = LatencyTier(DRAMTier(), delay=0.1)
    store = TieredStore([DRAMTier(one_block), slow])
    await store.put(key_of(1), sample_block(1))
    putting = asyncio.ensure_future(store.put(key_of(2), sample_block(2)))  # demotes key 1
    await asyncio.sleep(0.02)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0)
    with pytest.raises(ClosedError):
        await store.get(key_of(1))
    await asyncio.wait_for(putting, 5)
    await asyncio.wait_for(closing, 5)
    stats = store.stats()
    assert stats["evictions_refused"] == 0 and stats["tiers"][1]["errors"] == 0
    assert stats["tiers"][1]["demotions"] == 1
