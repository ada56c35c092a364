"""TieredStore under concurrency: many tasks at once, and the races DESIGN section 5 names."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from kvtier.store import TieredStore
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Block, Tier
from kvtier.tiers.dram import DRAMTier

KB = 1024


class KeyedLatencyTier(LatencyTier):
    """A LatencyTier that also records which keys were read (to check single flight)."""

    def __init__(self, inner: Tier, delay: float) -> None:
        super().__init__(inner, delay=delay)
        self.reads: dict[bytes, int] = {}

    async def _get(self, key: bytes) -> Block | None:
        self.reads[key] = self.reads.get(key, 0) + 1
        return await super()._get(key)


def assert_budgets(store: TieredStore) -> None:
    for tier in store.tiers:
        if tier.capacity is not None:
            assert tier.used <= tier.capacity, tier


async def holders(store: TieredStore, key: bytes) -> list[int]:
    return [i for i, t in enumerate(store.tiers) if await t.contains(key)]


async def test_thousand_concurrent_mixed_ops() -> None:
    bottom = KeyedLatencyTier(DRAMTier(), delay=0.03)
    store = TieredStore([DRAMTier(capacity=16 * KB, name="top"),
                         DRAMTier(capacity=48 * KB, name="mid"), bottom])
    cold = [key_of(10_000 + i) for i in range(20)]
    for i, key in enumerate(cold):
        await bottom.inner.put(key, sample_block(10_000 + i))
    hot = [key_of(i) for i in range(60)]
    written: dict[bytes, set[bytes]] = {k: set() for k in hot}
    rng = random.Random(7)

    async def cold_get(key: bytes) -> None:
        block = await store.get(key)
        assert block is not None
        np.testing.assert_array_equal(block, sample_block(int.from_bytes(key[:4], "big")))
        assert_budgets(store)

    async def hot_put(key: bytes, seed: int) -> None:
        value = sample_block(seed, rng.choice([512, 1024, 2048]))
        written[key].add(value.tobytes())
        if rng.random() < 0.5:
            await store.put(key, value)
        else:
            await store.put_many([(key, value)])
        assert_budgets(store)

    async def hot_get(key: bytes) -> None:
        block = await store.get(key)
        if block is not None:
            assert block.tobytes() in written[key]
        assert_budgets(store)

    async def hot_delete(key: bytes) -> None:
        await store.delete(key)
        assert_budgets(store)

    ops = ([cold_get(rng.choice(cold)) for _ in range(400)]
           + [hot_put(rng.choice(hot), seed) for seed in range(300)]
           + [hot_get(rng.choice(hot)) for _ in range(250)]
           + [hot_delete(rng.choice(hot)) for _ in range(50)])
    rng.shuffle(ops)
    async with asyncio.timeout(60):  # a deadlock fails here instead of hanging the suite
        await asyncio.gather(*ops)
        # Every cold key was read from the slow tier exactly once, however many asked.
        assert {k: bottom.reads.get(k, 0) for k in cold} == dict.fromkeys(cold, 1)
        assert store.stats()["single_flight_joins"] >= 400 - len(cold)
        assert_budgets(store)
        for key in hot:
            block = await store.get(key)
            if block is not None:
                assert block.tobytes() in written[key]
        for i, key in enumerate(cold):
            block = await store.get(key)
            assert block is not None
            np.testing.assert_array_equal(block, sample_block(10_000 + i))
        await store.aclose()


async def test_delete_during_demotion_does_not_resurrect() -> None:
    mid = LatencyTier(DRAMTier(), delay=0.05)
    store = TieredStore([DRAMTier(capacity=KB), mid, DRAMTier()])
    await store.put(key_of(1), sample_block(1))
    evicting = asyncio.create_task(store.put(key_of(2), sample_block(2)))
    await asyncio.sleep(0.01)  # key 1 is now being demoted into the slow middle tier
    assert await store.delete(key_of(1)) is True
    await evicting
    assert await holders(store, key_of(1)) == []
    assert await store.get(key_of(1)) is None
    await store.aclose()


async def test_delete_during_lower_read_is_not_undone_by_promotion() -> None:
    bottom = LatencyTier(DRAMTier(), delay=0.05)
    store = TieredStore([DRAMTier(), DRAMTier(), bottom])
    await bottom.inner.put(key_of(1), sample_block(1))
    reading = asyncio.create_task(store.get(key_of(1)))
    await asyncio.sleep(0.01)
    await store.delete(key_of(1))
    await reading  # started before the delete: may return the old block, must not promote it
    assert await holders(store, key_of(1)) == []
    await store.aclose()


async def test_put_during_lower_read_wins_over_promotion() -> None:
    bottom = LatencyTier(DRAMTier(), delay=0.05)
    store = TieredStore([DRAMTier(), bottom])
    await bottom.inner.put(key_of(1), sample_block(1))
    reading = asyncio.create_task(store.get(key_of(1)))
    await asyncio.sleep(0.01)
    await store.put(key_of(1), sample_block(2))
    await reading
    got = await store.get(key_of(1))
    assert got is not None
    np.testing.assert_array_equal(got, sample_block(2))
    await store.aclose()


async def test_concurrent_write_through_puts_of_one_key_end_with_the_last() -> None:
    slow = LatencyTier(DRAMTier(), delay=0.005)
    store = TieredStore([DRAMTier(capacity=4 * KB), slow, DRAMTier()],
                        write_policy="write_through", write_workers=8, write_queue_size=4)
    async with asyncio.timeout(30):
        for round_ in range(5):
            await asyncio.gather(*(store.put(key_of(k), sample_block(100 * round_ + k))
                                   for k in range(8)))
        await store.flush()
    for k in range(8):
        for index, tier in enumerate(store.tiers):
            copy = await tier.get(key_of(k))
            if copy is not None:
                np.testing.assert_array_equal(copy, sample_block(400 + k), err_msg=str(index))
        assert 2 in await holders(store, key_of(k))
    assert_budgets(store)
    await store.aclose()


async def test_concurrent_batch_deletes_do_not_deadlock() -> None:
    store = TieredStore([DRAMTier(capacity=2 * KB), LatencyTier(DRAMTier(), delay=0.001)],
                        write_policy="write_through", write_workers=2)
    keys = [key_of(i) for i in range(10)]
    await store.put_many((k, sample_block(i)) for i, k in enumerate(keys))
    async with asyncio.timeout(30):
        await asyncio.gather(store.delete_many(keys), store.delete_many(keys[::-1]),
                             store.put_many((k, sample_block(50)) for k in keys[:3]))
        await store.flush()
    for key in keys[3:]:
        assert await holders(store, key) == []
    await store.aclose()


async def test_concurrent_get_many_share_lower_tier_reads() -> None:
    bottom = KeyedLatencyTier(DRAMTier(), delay=0.03)
    store = TieredStore([DRAMTier(capacity=64 * KB), bottom])
    chain = [key_of(i) for i in range(8)]
    for i, key in enumerate(chain):
        await bottom.inner.put(key, sample_block(i))
    calls = ([store.get_many(chain) for _ in range(10)]
             + [store.get_many(chain[2:5] + chain[2:3]) for _ in range(5)]
             + [store.get(chain[i % 8]) for i in range(16)])
    async with asyncio.timeout(30):
        results = await asyncio.gather(*calls)
    assert bottom.reads == dict.fromkeys(chain, 1)
    for blocks in results[:10]:
        assert isinstance(blocks, list)
        for i, block in enumerate(blocks):
            assert block is not None
            np.testing.assert_array_equal(block, sample_block(i))
    for blocks in results[10:15]:
        assert isinstance(blocks, list)
        assert [b is not None and b.tobytes() == sample_block(i).tobytes()
                for b, i in zip(blocks, [2, 3, 4, 2], strict=True)] == [True] * 4
    assert store.stats()["hits"] == 10 * 8 + 5 * 4 + 16
    await store.aclose()
