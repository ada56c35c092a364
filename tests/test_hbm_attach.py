"""HBM attach mode: kvtier over an engine-owned paged KV buffer ([num_slots, block_bytes])."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ConfigError, ShapeMismatchError, TierFullError
from kvtier.store import TieredStore
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import DLPackOnly
from kvtier.tiers.base import Block
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.hbm import HBMTier

SLOTS = 8
BLOCK = 2048


def engine_buffer() -> np.ndarray:
    """An engine's paged KV buffer: one row per slot, filled with a per-slot marker."""
    buf = np.empty((SLOTS, BLOCK), dtype=np.uint8)
    for slot in range(SLOTS):
        buf[slot] = 200 + slot
    return buf


def kv(i: int) -> Block:
    return sample_block(i, nbytes=BLOCK, dtype="<f2").reshape(4, 256)


async def test_blocks_land_in_the_engine_buffer() -> None:
    buf = engine_buffer()
    tier = HBMTier.attach(buf)
    assert tier.num_slots == SLOTS and tier.block_bytes == BLOCK and tier.attached
    for i in range(3):
        await tier.put(key_of(i), kv(i))
    for i in range(3):
        slot = tier.slot_of(key_of(i))
        assert slot is not None
        assert buf[slot].tobytes() == kv(i).tobytes()
    untouched = set(range(SLOTS)) - {tier.slot_of(key_of(i)) for i in range(3)}
    for slot in untouched:
        assert (buf[slot] == 200 + slot).all()
    got = await tier.get(key_of(1))
    assert got is not None and got.dtype == np.float16 and got.shape == (4, 256)
    # a smaller block keeps its own shape and only covers the start of its slot
    small = np.arange(10, dtype=np.int32)
    await tier.put(key_of(9), small)
    slot = tier.slot_of(key_of(9))
    assert slot is not None and buf[slot, :40].tobytes() == small.tobytes()
    assert (buf[slot, 40:] == 200 + slot).all()


async def test_block_bytes_inferred_from_engine_layout() -> None:
    # [num_blocks, 2 (k/v), layers, tokens, heads*dim] float16, like a paged KV cache
    buf = np.zeros((6, 2, 3, 4, 8), dtype=np.float16)
    tier = HBMTier.attach(buf)
    assert tier.num_slots == 6 and tier.block_bytes == 2 * 3 * 4 * 8 * 2
    block = np.random.default_rng(0).standard_normal((2, 3, 4, 8)).astype(np.float16)
    await tier.put(key_of(1), block)
    slot = tier.slot_of(key_of(1))
    assert slot is not None and np.array_equal(buf[slot], block)


@pytest.mark.parametrize(("make", "kwargs", "match"), [
    (lambda: np.zeros((4, 100), np.uint8)[:, ::2], {}, "contiguous"),
    (lambda: np.zeros(1000, np.uint8), {}, "block_bytes"),
    (lambda: np.zeros(1000, np.uint8), {"block_bytes": 300}, "block_bytes"),
    (lambda: np.zeros((0, 16), np.uint8), {}, "block_bytes"),
])
def test_attach_rejects_bad_buffers(make: object, kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HBMTier.attach(make(), **kwargs)  # type: ignore[operator]


def test_attach_rejects_read_only_buffer() -> None:
    buf = engine_buffer()
    buf.flags.writeable = False
    with pytest.raises(ConfigError, match="writeable"):
        HBMTier.attach(buf)
    with pytest.raises(ConfigError, match="capacity"):
        HBMTier(1 << 20, buffer=engine_buffer())


async def test_reserved_slots_are_never_written() -> None:
    buf = engine_buffer()
    tier = HBMTier.attach(buf)
    await tier.reserve_slots([0, 3, 5])
    assert tier.free_slots == SLOTS - 3 and tier.reserved_slots == {0, 3, 5}
    for i in range(30):
        await tier.put(key_of(i), kv(i))
        assert tier.slot_of(key_of(i)) not in {0, 3, 5}
    for slot in (0, 3, 5):
        assert (buf[slot] == 200 + slot).all()
    assert tier.used == (SLOTS - 3) * BLOCK
    tier.release_slots([3])
    await tier.put(key_of(100), kv(100))
    assert tier.slot_of(key_of(100)) == 3 and buf[3].tobytes() == kv(100).tobytes()


async def test_pinned_blocks_keep_their_slots_and_full_raises() -> None:
    buf = engine_buffer()
    tier = HBMTier.attach(buf)
    for i in range(SLOTS):
        await tier.put(key_of(i), kv(i))
    pinned = [key_of(i) for i in range(0, SLOTS, 2)]
    await tier.pin(pinned)
    slots = {k: tier.slot_of(k) for k in pinned}
    for i in range(SLOTS, SLOTS + 20):
        await tier.put(key_of(i), kv(i))
    for k in pinned:
        slot = slots[k]
        assert tier.slot_of(k) == slot and slot is not None
        assert buf[slot].tobytes() == kv(int.from_bytes(k[:4], "big")).tobytes()
    # every remaining slot reserved by the engine: a put has nowhere to go
    free_or_unpinned = [s for s in range(SLOTS) if s not in slots.values()]
    await tier.reserve_slots(free_or_unpinned)
    before = buf.copy()
    with pytest.raises(TierFullError, match="no free slot"):
        await tier.put(key_of(999), kv(999))
    assert np.array_equal(buf, before) and not await tier.contains(key_of(999))
    with pytest.raises(TierFullError, match="pinned"):
        await tier.reserve_slots([next(iter(slots.values()))])  # type: ignore[list-item]


async def test_eviction_demotes_to_dram_byte_identical() -> None:
    buf = engine_buffer()
    hbm = HBMTier.attach(buf)
    dram = DRAMTier(capacity=1 << 20)
    async with TieredStore([hbm, dram]) as store:
        for i in range(20):
            await store.put(key_of(i), kv(i))
        assert len(hbm) == SLOTS and hbm.evictions == 20 - SLOTS
        for i in range(20 - SLOTS):
            demoted = await dram.get(key_of(i))
            assert demoted is not None and demoted.dtype == np.float16
            assert demoted.shape == (4, 256) and demoted.tobytes() == kv(i).tobytes()
        for i in range(20):
            got = await store.get(key_of(i))
            assert got is not None and got.tobytes() == kv(i).tobytes()
        stats = store.stats()["tiers"]
        assert stats[0]["scheme"] == "hbm" and stats[0]["demotions"] == 0
        assert stats[1]["demotions"] >= 20 - SLOTS


async def test_reserving_a_held_slot_demotes_its_block() -> None:
    buf = engine_buffer()
    hbm = HBMTier.attach(buf)
    dram = DRAMTier(capacity=1 << 20)
    async with TieredStore([hbm, dram]) as store:
        await store.put(key_of(1), kv(1))
        slot = hbm.slot_of(key_of(1))
        assert slot is not None
        await hbm.reserve_slots([slot])
        assert hbm.slot_of(key_of(1)) is None and slot in hbm.reserved_slots
        got = await dram.get(key_of(1))
        assert got is not None and got.tobytes() == kv(1).tobytes()


async def test_store_promotes_only_into_free_slots() -> None:
    buf = engine_buffer()
    hbm = HBMTier.attach(buf)
    dram = DRAMTier(capacity=1 << 20)
    async with TieredStore([hbm, dram]) as store:
        await dram.put(key_of(7), kv(7))
        await hbm.reserve_slots(range(SLOTS))
        before = buf.copy()
        got = await store.get(key_of(7))  # hit below; promotion finds no slot: still a hit
        assert got is not None and got.tobytes() == kv(7).tobytes()
        assert np.array_equal(buf, before) and not await hbm.contains(key_of(7))
        hbm.release_slots([6])
        assert await store.get(key_of(7)) is not None
        assert hbm.slot_of(key_of(7)) == 6 and buf[6].tobytes() == kv(7).tobytes()


async def test_get_into_an_engine_slot_on_prefix_hit() -> None:
    buf = engine_buffer()
    hbm = HBMTier.attach(buf)
    dram = DRAMTier(capacity=1 << 20)
    async with TieredStore([hbm, dram], promote="top") as store:
        await store.put(key_of(1), kv(1))  # lands in an HBM slot
        await dram.put(key_of(2), kv(2))   # only below
        await hbm.reserve_slots([4, 5])    # the engine allocates two slots for a request
        view4 = buf[4].view(np.float16).reshape(4, 256)
        assert await store.get_into(key_of(1), view4) is True   # device slot -> slot copy
        assert await store.get_into(key_of(2), buf[5]) is True  # raw bytes from DRAM
        assert buf[4].tobytes() == kv(1).tobytes() and buf[5].tobytes() == kv(2).tobytes()
        assert await store.get_many_into([key_of(1), key_of(3)], [buf[4], buf[5]]) == \
            [True, False]


@pytest.mark.parametrize("out", [
    np.zeros((4, 256), np.float32), np.zeros((256, 4), np.float16),
    np.zeros(BLOCK - 1, np.uint8), np.zeros((4, 512), np.float16)[:, ::2],
], ids=["dtype", "shape", "too-small", "non-contiguous"])
async def test_get_into_mismatch_leaves_engine_buffer_untouched(out: np.ndarray) -> None:
    buf = engine_buffer()
    hbm = HBMTier.attach(buf)
    await hbm.put(key_of(1), kv(1))
    out[...] = 3
    before, engine_before = out.copy(), buf.copy()
    with pytest.raises(ShapeMismatchError):
        await hbm.get_into(key_of(1), out)
    assert np.array_equal(out, before) and np.array_equal(buf, engine_before)


async def test_slot_id_validation() -> None:
    tier = HBMTier.attach(engine_buffer())
    with pytest.raises(ValueError, match=r"slot_ids\[1\]"):
        await tier.reserve_slots([0, SLOTS])
    with pytest.raises(TypeError, match="slot_ids"):
        await tier.reserve_slots(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"slot_ids\[0\]"):
        await tier.reserve_slots(["0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not reserved"):
        tier.release_slots([1])
    assert tier.reserved_slots == frozenset() and tier.free_slots == SLOTS


async def test_attach_torch_tensor() -> None:
    torch = pytest.importorskip("torch")
    buf = torch.zeros((SLOTS, 2, BLOCK // 4), dtype=torch.float16)
    tier = HBMTier.attach(buf)
    assert tier.backend.name == "torch" and tier.num_slots == SLOTS
    block = kv(3).reshape(2, BLOCK // 4)
    await tier.put(key_of(3), block)
    slot = tier.slot_of(key_of(3))
    assert slot is not None and buf[slot].numpy().tobytes() == block.tobytes()
    await tier.reserve_slots([7])
    assert await tier.get_into(key_of(3), buf[7]) is True  # slot -> slot, on the device
    assert buf[7].numpy().tobytes() == block.tobytes()


async def test_acquire_slots_prefers_free_then_demotes_lru() -> None:
    buf = engine_buffer()
    hbm = HBMTier.attach(buf)
    dram = DRAMTier(capacity=1 << 20)
    async with TieredStore([hbm, dram]) as store:
        for i in range(6):
            await store.put(key_of(i), kv(i))
        await hbm.pin([key_of(0)])
        pages = await hbm.acquire_slots(4)  # 2 free slots, then the LRU unpinned: 1 and 2
        assert len(set(pages)) == 4 and hbm.reserved_slots == set(pages)
        assert [hbm.slot_of(key_of(i)) is None for i in range(6)] == \
            [False, True, True, False, False, False]
        for i in (1, 2):
            got = await dram.get(key_of(i))
            assert got is not None and got.tobytes() == kv(i).tobytes()
        before = dict(hbm.stats())
        with pytest.raises(TierFullError, match="count"):
            await hbm.acquire_slots(4)  # 3 unpinned blocks left, no free slot
        assert hbm.stats() == before
        with pytest.raises(ValueError, match="count"):
            await hbm.acquire_slots(-1)
        hbm.release_slots(pages)
        assert hbm.free_slots == 4


async def test_attach_foreign_dlpack_buffer_needs_a_backend_name() -> None:
    buf = engine_buffer()
    with pytest.raises(ConfigError, match="backend"):
        HBMTier.attach(DLPackOnly(buf), block_bytes=BLOCK)
    tier = HBMTier.attach(DLPackOnly(buf), block_bytes=BLOCK, backend="numpy")
    await tier.put(key_of(1), kv(1))
    slot = tier.slot_of(key_of(1))
    assert slot is not None and buf[slot].tobytes() == kv(1).tobytes()
