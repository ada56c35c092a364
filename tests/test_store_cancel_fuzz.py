"""Cancellation fuzz (issue 9): thousands of mixed store calls on a three-tier chain (small
DRAM, DRAM, LMDB), cancelled at random points. Afterwards every key is writable and reads
back its own bytes, budgets hold, no tier counted an error, and flush/aclose finish."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from kvtier.store import open_store
from kvtier.testing.conformance import key_of

KEYS = 48
BLOCK = 512  # uint16 elements: 1 KiB blocks


def value(key: int, version: int) -> np.ndarray:
    """A block whose every element names its key (and a version), so wrong bytes show."""
    return np.full(BLOCK, key * 1000 + version % 1000, np.uint16)


def check(key: int, block: np.ndarray | None) -> None:
    if block is not None:
        assert block.shape == (BLOCK,) and block.dtype == np.uint16
        first = int(block[0])
        assert first // 1000 == key, f"key {key} returned a block of key {first // 1000}"
        assert (block == first).all(), f"key {key} returned a torn block"


@pytest.mark.slow
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_random_cancellation_leaves_a_consistent_store(tmp_path: Path,
                                                             write_policy: str) -> None:
    rng = random.Random(20261130 + len(write_policy))
    urls = ["dram://?capacity=12KiB", "dram://?capacity=40KiB",
            f"lmdb://{tmp_path}/lmdb?capacity=4MiB"]
    store = await open_store(urls, write_policy=write_policy, write_workers=2)
    version = 0

    async def one_op() -> None:
        nonlocal version
        version += 1
        op = rng.random()
        ks = rng.sample(range(KEYS), rng.randint(1, 6))
        if op < 0.3:
            k = ks[0]
            check(k, await store.get(key_of(k)))
        elif op < 0.5:
            got = await store.get_many([key_of(k) for k in ks])
            for k, block in zip(ks, got, strict=True):
                check(k, block)
        elif op < 0.7:
            await store.put(key_of(ks[0]), value(ks[0], version))
        elif op < 0.88:
            await store.put_many([(key_of(k), value(k, version)) for k in ks])
        else:
            await store.delete_many([key_of(k) for k in ks])

    cancelled = 0
    for _ in range(600):
        tasks = [asyncio.create_task(one_op()) for _ in range(8)]
        how = rng.random()
        if how < 0.5:
            # Cancel after a random number of loop iterations: a different await point each
            # time (tier calls, LMDB's worker threads, key locks, the write-through queue).
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                await asyncio.sleep(rng.choice([0.0002, 0.001]))
            for task in rng.sample(tasks, rng.randint(1, len(tasks))):
                task.cancel()
        elif how < 0.7:
            tasks = [asyncio.create_task(asyncio.wait_for(t, rng.choice([1e-4, 1e-3, 5e-3])))
                     for t in tasks]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, asyncio.CancelledError | TimeoutError):
                cancelled += 1
            elif isinstance(result, BaseException):
                raise result
    assert cancelled > 300  # the fuzz did cancel calls at many points

    await asyncio.wait_for(store.flush(), 10)
    stats = store.stats()
    assert [t["errors"] for t in stats["tiers"]] == [0, 0, 0]
    for tier in store.tiers:
        assert tier.capacity is None or tier.used <= tier.capacity
    assert len(store._keys) == 0  # no per-key state left behind by a cancelled call
    final = {k: value(k, 999) for k in range(KEYS)}
    for k in range(KEYS):
        await asyncio.wait_for(store.put(key_of(k), final[k]), 5)
    await asyncio.wait_for(store.flush(), 10)
    got = await store.get_many([key_of(k) for k in range(KEYS)])
    assert all(g is not None and g.tobytes() == final[k].tobytes() for k, g in enumerate(got))
    for k in rng.sample(range(KEYS), 10):
        one = await store.get(key_of(k))
        assert one is not None and one.tobytes() == final[k].tobytes()
    await asyncio.wait_for(store.aclose(), 30)
    assert [t["errors"] for t in store.stats()["tiers"]] == [0, 0, 0]
