"""Unit tests of the store's parts, each built alone with what it needs (no TieredStore)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvtier.closeflush import CloseFlush
from kvtier.errors import TierError, TierFullError
from kvtier.placement import Placement
from kvtier.promotion import Promotion
from kvtier.readpath import ReadPath
from kvtier.singleflight import KeyRegistry
from kvtier.stats import StoreCounters
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import FailingTier, LatencyTier
from kvtier.tierchain import TierChain, finish_even_if_cancelled
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.writethrough import WriteThrough


def make_chain(*tiers: Tier) -> TierChain:
    return TierChain(list(tiers), StoreCounters())


# ----------------------------------------------------------------------------- Promotion
def test_promotion_targets_per_policy() -> None:
    assert list(Promotion("all").targets(key_of(1), 2)) == [0, 1]
    assert list(Promotion("top").targets(key_of(1), 2)) == [0]
    assert list(Promotion("all").targets(key_of(1), 0)) == []
    third = Promotion(3)
    assert [list(third.targets(key_of(1), 1)) for _ in range(3)] == [[], [], [0]]
    third.targets(key_of(2), 1)
    third.forget(key_of(2))
    assert len(third) == 0


def test_promotion_counts_are_bounded_and_validated() -> None:
    policy = Promotion(5, counter_size=3)
    for i in range(10):
        policy.targets(key_of(i), 1)
    assert len(policy) == 3
    with pytest.raises(ValueError, match="promote"):
        Promotion("some")
    with pytest.raises(ValueError, match="promote_counter_size"):
        Promotion("all", counter_size=0)


# ----------------------------------------------------------------------------- TierChain
async def test_chain_write_counts_by_kind_and_swallows_tier_failures() -> None:
    broken = FailingTier(DRAMTier(), fail={"put"})
    chain = make_chain(DRAMTier(), broken)
    assert await chain.write(0, key_of(1), sample_block(1), "promote")
    assert not await chain.write(1, key_of(1), sample_block(1), "demote")
    assert chain.tier_counters[0].promotions == 1
    assert chain.tier_counters[1].errors == 1 and chain.tier_counters[1].demotions == 0


async def test_finish_even_if_cancelled_completes_then_raises() -> None:
    done: list[int] = []

    async def steps() -> int:
        for i in range(3):
            await asyncio.sleep(0.02)
            done.append(i)
        return 7

    task = asyncio.create_task(finish_even_if_cancelled(steps()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == [0, 1, 2]
    assert await finish_even_if_cancelled(steps()) == 7


# ----------------------------------------------------------------------------- ReadPath
async def test_read_path_single_flight_and_promotion_alone() -> None:
    slow = LatencyTier(DRAMTier(), delay=0.05)
    top = DRAMTier()
    chain = make_chain(top, slow)
    reads = ReadPath(chain, KeyRegistry(), Promotion("all"), lambda: False)
    await slow.inner.put(key_of(1), sample_block(1))
    got = await asyncio.gather(*(reads.get(key_of(1), None) for _ in range(5)))
    assert all(g is not None for g in got)
    assert slow.calls["get"] == 1 and chain.counters.single_flight_joins == 4
    assert await top.contains(key_of(1))


async def test_read_path_hands_a_timed_out_fetch_to_followers() -> None:
    slow = LatencyTier(DRAMTier(), delay=0.1)
    chain = make_chain(DRAMTier(), slow)
    reads = ReadPath(chain, KeyRegistry(), Promotion("all"), lambda: False)
    await slow.inner.put(key_of(1), sample_block(1))
    loop = asyncio.get_running_loop()
    leader = asyncio.create_task(reads.get(key_of(1), loop.time() + 0.03))
    await asyncio.sleep(0.005)
    follower = asyncio.create_task(reads.get(key_of(1), None))
    assert await leader is None
    assert await follower is not None


# ----------------------------------------------------------------------------- Placement
async def test_placement_demotion_no_tier_takes_is_refused() -> None:
    lower, bottom = DRAMTier(), DRAMTier()
    chain = make_chain(DRAMTier(), FailingTier(lower, fail={"put"}),
                       FailingTier(bottom, fail={"put"}))
    placement = Placement(chain, KeyRegistry(), Promotion(), None)
    await bottom.put(key_of(1), sample_block(1))
    with pytest.raises(TierFullError, match="no tier below accepted"):
        await placement.demoter(0)(key_of(1), sample_block(2))
    assert chain.counters.evictions_refused == 1
    # The evicting tier keeps the newer value, which still shadows the older copy below.
    assert await bottom.contains(key_of(1))


async def test_placement_pool_index_and_pool_failure_raises() -> None:
    pool = FailingTier(DRAMTier(), fail={"put"})
    pool.shared = True
    chain = make_chain(DRAMTier(), pool)
    placement = Placement(chain, KeyRegistry(), Promotion(), None)
    assert placement.pool_index(0) == 1 and placement.pool_index(1) is None
    with pytest.raises(TierError, match="pool"):
        await placement.put(key_of(1), sample_block(1), 0)
    off = Placement(chain, KeyRegistry(), Promotion(), None, pool_write_through=False)
    assert off.pool_index(0) is None


async def test_placement_delete_clears_every_tier_and_reports_presence() -> None:
    a, b = DRAMTier(), DRAMTier()
    chain = make_chain(a, b)
    placement = Placement(chain, KeyRegistry(), Promotion(), None)
    await b.put(key_of(1), sample_block(1))
    await a.put(key_of(2), sample_block(2))
    assert await placement.delete([key_of(1), key_of(2), key_of(3)]) == [True, True, False]
    assert a.used == 0 and b.used == 0


# ----------------------------------------------------------------------------- WriteThrough
async def test_write_through_bounds_pending_bytes_and_drains() -> None:
    writes: list[bytes] = []
    gate = asyncio.Event()

    async def write(index: int, key: bytes, block: np.ndarray) -> bool:
        await gate.wait()
        writes.append(key)
        return True

    queue = WriteThrough(keys=KeyRegistry(), write=write, n_tiers=2, max_bytes=3000,
                         max_items=100, workers=1, counters=StoreCounters())
    block = np.zeros(1000, np.uint8)
    for i in range(3):
        await queue.enqueue(key_of(i), block, 1)
    blocked = asyncio.create_task(queue.enqueue(key_of(3), block, 1))
    await asyncio.sleep(0.02)
    assert not blocked.done() and queue.pending_bytes == 3000
    gate.set()
    await blocked
    await queue.flush()
    assert writes == [key_of(i) for i in range(4)] and queue.pending_bytes == 0
    await queue.aclose()


# ----------------------------------------------------------------------------- CloseFlush
async def test_close_flush_copies_top_copy_once_into_persistent_tier() -> None:
    top, middle, disk = DRAMTier(), DRAMTier(), DRAMTier()
    disk.persistent = True
    chain = make_chain(top, middle, disk)
    await top.put(key_of(1), sample_block(2))  # current value
    await middle.put(key_of(1), sample_block(1))  # an older, shadowed copy
    await middle.put(key_of(2), sample_block(3))
    flush = CloseFlush(chain, timeout=5)
    assert flush.active
    assert await flush.run() == 2
    got = await disk.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(2).tobytes()
    assert await disk.contains(key_of(2))
    assert not CloseFlush(make_chain(DRAMTier(), DRAMTier()), timeout=5).active
