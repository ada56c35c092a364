"""DRAM arena: slots by size class in one mapping, reused only once nothing references them,
heap memory when no slot fits, and the pinned-memory registration hook."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from kvtier.backends.numpy_backend import NumpyBackend
from kvtier.errors import ConfigError
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.dram_arena import HostArena, slot_bytes

BLOCK = 256 << 10


def block(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def in_arena(tier: DRAMTier, got: np.ndarray) -> bool:
    arena = tier.arena
    assert arena is not None
    return arena.owns(got.base)


async def test_blocks_live_in_the_arena_and_gets_are_read_only_views() -> None:
    tier = DRAMTier(capacity=4 * BLOCK)
    value = np.arange(BLOCK // 2, dtype=np.uint16).reshape(4, -1)
    await tier.put(key(0), value)
    got = await tier.get(key(0))
    assert got is not None and in_arena(tier, got)
    assert got.dtype == np.uint16 and got.shape == (4, BLOCK // 8)
    assert np.array_equal(got, value) and not got.flags.writeable
    assert got is await tier.get(key(0))  # zero copy
    stats = tier.stats()
    assert stats["arena_bytes"] >= 4 * BLOCK and stats["arena_overflow"] == 0


async def test_held_slot_is_not_reused_until_released() -> None:
    tier = DRAMTier(capacity=2 * BLOCK)
    await tier.put(key(0), block(0))
    held = (await tier.get(key(0)))[BLOCK // 2:]  # a derived view keeps the slot too
    for i in range(1, 6):  # evicts key 0, then cycles the other slot
        await tier.put(key(i), block(i))
    assert np.array_equal(held, block(0)[BLOCK // 2:])
    stats = tier.stats()
    assert stats["arena_overflow"] >= 1  # the held slot was never handed out again
    del held
    reused, overflow = stats["arena_reused"], stats["arena_overflow"]
    for i in range(6, 10):
        await tier.put(key(i), block(i))
    stats = tier.stats()
    assert stats["arena_reused"] == reused + 4  # no more heap blocks once it is back
    assert stats["arena_overflow"] == overflow
    for i in (8, 9):
        got = await tier.get(key(i))
        assert got is not None and np.array_equal(got, block(i)) and in_arena(tier, got)


async def test_view_released_on_another_thread_frees_its_slot() -> None:
    tier = DRAMTier(capacity=BLOCK)
    await tier.put(key(0), block(0))
    held = [await tier.get(key(0))]
    assert await tier.delete(key(0))
    assert tier.stats()["arena_free_bytes"] == 0
    worker = threading.Thread(target=held.clear)
    worker.start()
    worker.join()
    assert tier.stats()["arena_free_bytes"] == slot_bytes(BLOCK)
    await tier.put(key(1), block(1))
    assert tier.stats()["arena_reused"] == 1


async def test_small_blocks_reuse_slots_of_their_class() -> None:
    tier = DRAMTier(capacity=64 << 10)
    for i in range(20):
        await tier.put(key(0), block(i, 1000))  # class: 1024 bytes
    got = await tier.get(key(0))
    assert got is not None and np.array_equal(got, block(19, 1000)) and in_arena(tier, got)
    assert tier.stats()["arena_reused"] == 19


async def test_other_size_classes_fall_back_to_the_heap() -> None:
    tier = DRAMTier(capacity=2 * BLOCK)
    await tier.put(key(0), block(0))
    await tier.put(key(1), block(1))  # the arena is carved into two BLOCK slots
    await tier.put(key(2), block(2, BLOCK // 2))  # evicts one; no slot of its class
    got = await tier.get(key(2))
    assert got is not None and np.array_equal(got, block(2, BLOCK // 2))
    assert not in_arena(tier, got) and tier.stats()["arena_overflow"] == 1
    assert tier.used <= tier.capacity  # type: ignore[operator]


@pytest.mark.parametrize("url", ["dram://?capacity=1MiB&prefault=1",
                                 "dram://?capacity=1MiB&prefault=0&hugepages=0",
                                 "dram://?capacity=1MiB&hugepages=0",
                                 "dram://?capacity=1MiB&prefault=1&hugepages=0",
                                 "dram://?capacity=1MiB&prefault=1&hugepages=1"])
async def test_prefault_and_hugepages_options(url: str) -> None:
    tier = DRAMTier.from_url(url)
    stats = tier.stats()
    mode = "off" if "prefault=0" in url else "open" if "prefault=1" in url else "background"
    assert stats["prefault"] == mode
    # A 1 MiB arena is faulted in at construction even in background mode (a thread
    # would cost more); a background prefault that this kernel refuses says why.
    assert stats["prefaulted"] == (mode == "open" or (mode == "background"
                                                      and stats["prefault_error"] is None))
    if "hugepages=0" in url:
        assert not stats["hugepages"]
    assert stats["arena_bytes"] >= 1 << 20
    for i in range(4):
        await tier.put(key(i), block(i))
    for i in range(4):
        got = await tier.get(key(i))
        assert got is not None and np.array_equal(got, block(i))
    await tier.aclose()


@pytest.mark.parametrize(("url", "message"), [
    ("dram://?prefault=1", "need an arena"),
    ("dram://?capacity=1MiB&arena=0&hugepages=1", "need an arena"),
    ("dram://?arena=1", "arena: needs a capacity"),
    ("dram://?capacity=1MiB&prefault=maybe", "prefault"),
])
def test_bad_arena_options(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DRAMTier.from_url(url)


def test_heap_tier_when_asked_or_unbounded() -> None:
    assert DRAMTier.from_url("dram://?capacity=1MiB&arena=0").arena is None
    assert DRAMTier().arena is None
    assert "arena_bytes" not in DRAMTier().stats()


async def test_register_host_memory_once_and_unregister_at_close() -> None:
    backend = NumpyBackend()
    tier = DRAMTier(capacity=4 * BLOCK)
    tier.register_host_memory(backend)
    tier.register_host_memory(backend)  # once
    assert len(backend.registered) == 1
    arena = tier.arena
    assert arena is not None
    registered = backend.registered[0]
    assert registered.ctypes.data == arena.buffer.ctypes.data
    assert registered.nbytes == arena.nbytes and tier.stats()["pinned"]
    await tier.put(key(0), block(0))
    got = await tier.get(key(0))
    assert got is not None  # a stored block lies inside the registered range
    start = got.ctypes.data - registered.ctypes.data
    assert start >= 0 and start + got.nbytes <= registered.nbytes
    await tier.aclose()
    assert backend.registered == [] and not tier.stats()["pinned"]
    assert np.array_equal(got, block(0))  # the mapping outlives the tier while viewed


def test_register_host_memory_needs_an_arena_and_a_capable_backend() -> None:
    with pytest.raises(ConfigError, match="no arena"):
        DRAMTier().register_host_memory(NumpyBackend())
    with pytest.raises(ConfigError, match="register_host"):
        DRAMTier(capacity=BLOCK).register_host_memory(object())


def test_arena_slot_outlives_the_arena_object() -> None:
    arena = HostArena(1 << 20)
    raw = arena.allocate(BLOCK)
    assert raw is not None
    raw[:] = 7
    del arena
    gc.collect()
    assert int(raw.sum()) == 7 * BLOCK
