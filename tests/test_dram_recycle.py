"""DRAM tier buffer recycling: a dropped block's buffer is reused only when nobody holds it.

A reader's zero-copy view (or any view derived from it) must keep its bytes through every
later overwrite, eviction and delete of its key; with no reader, puts of large blocks copy
into recycled buffers (``stats()["recycled"]``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.tiers.base import Block
from kvtier.tiers.dram import DRAMTier

BLOCK = 512 << 10  # large enough to be recycled
#: Blocks in an arena slot (the default with a capacity) and in heap memory.
ARENA = pytest.mark.parametrize("arena", [True, False], ids=["arena", "heap"])


def block(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def churn(tier: DRAMTier, rounds: int) -> None:
    """Overwrite, evict and delete key 0 (and its neighbours) over and over."""
    for i in range(1, rounds):
        await tier.put(key(0), block(i))  # overwrite
        for j in range(1, 6):  # push key 0 out by budget
            await tier.put(key(j), block(100 * i + j))
        await tier.delete(key(1))
        await tier.put(key(0), block(i + 1000))
        assert await tier.delete(key(0))


@pytest.mark.parametrize("hold", ["get result", "derived view"])
@ARENA
async def test_reader_view_never_changes(hold: str, arena: bool) -> None:
    tier = DRAMTier(capacity=4 * BLOCK, arena=arena)
    await tier.put(key(0), block(0))
    got = await tier.get(key(0))
    assert got is not None
    # A view's base is the buffer itself, not the block: the two are checked separately.
    held = got if hold == "get result" else got[BLOCK // 2:]
    expected = block(0)[:BLOCK] if hold == "get result" else block(0)[BLOCK // 2:]
    del got
    for _ in range(8):
        await churn(tier, 5)
        assert np.array_equal(held, expected)
    # Buffers were recycled meanwhile, just never the one the reader holds.
    assert tier.stats()["recycled"] > 0


@ARENA
async def test_overwrites_recycle_when_nobody_holds_the_block(arena: bool) -> None:
    tier = DRAMTier(capacity=8 * BLOCK, arena=arena)
    for i in range(20):
        await tier.put(key(0), block(i))
        got = await tier.get(key(0))
        assert got is not None and np.array_equal(got, block(i)) and not got.flags.writeable
        del got
    stats = tier.stats()
    assert stats["recycled"] >= 18
    assert stats["used"] == BLOCK


@ARENA
async def test_eviction_and_delete_recycle(arena: bool) -> None:
    tier = DRAMTier(capacity=2 * BLOCK, arena=arena)
    for i in range(10):  # each put past the second evicts the oldest block
        await tier.put(key(i), block(i))
    assert tier.stats()["recycled"] >= 7
    assert await tier.delete(key(9))
    assert tier.stats()["spare_bytes"] == BLOCK
    await tier.put(key(20), block(20))  # reuses the deleted block's buffer
    assert tier.stats()["spare_bytes"] == 0
    got = await tier.get(key(20))
    assert got is not None and np.array_equal(got, block(20))


async def test_block_kept_by_eviction_callback_is_not_recycled() -> None:
    # A lower tier (or a queue) that keeps the demoted block itself.
    kept: list[tuple[bytes, Block]] = []

    async def keep(k: bytes, b: Block) -> None:
        kept.append((k, b))

    tier = DRAMTier(capacity=2 * BLOCK)
    tier.on_evict = keep
    for i in range(12):
        await tier.put(key(i), block(i))
    assert len(kept) == 10
    for k, b in kept:
        assert np.array_equal(b, block(int.from_bytes(k, "big")))
    assert tier.stats()["recycled"] == 0


@ARENA
async def test_recycled_buffer_takes_any_dtype_and_shape(arena: bool) -> None:
    tier = DRAMTier(capacity=4 * BLOCK, arena=arena)
    await tier.put(key(0), block(0))
    value = np.arange(BLOCK // 4, dtype=np.float32).reshape(8, -1)
    await tier.put(key(0), value)
    assert tier.stats()["recycled"] == 1
    got = await tier.get(key(0))
    assert got is not None
    assert got.dtype == np.float32 and got.shape == value.shape
    assert np.array_equal(got, value)


async def test_small_blocks_are_not_pooled_on_the_heap() -> None:
    tier = DRAMTier(capacity=1 << 20, arena=False)
    for i in range(10):
        await tier.put(key(0), block(i, 4096))
    assert await tier.delete(key(0))
    stats = tier.stats()
    assert stats["recycled"] == 0 and stats["spare_bytes"] == 0


async def test_spare_pool_is_bounded_and_cleared_on_close() -> None:
    tier = DRAMTier(capacity=16 * BLOCK, arena=False)  # spare pool: an eighth, 2 blocks
    for i in range(6):
        await tier.put(key(i), block(i))
    for i in range(6):
        assert await tier.delete(key(i))
    assert tier.stats()["spare_bytes"] == 2 * BLOCK
    await tier.aclose()
    assert tier.stats()["spare_bytes"] == 0
