"""LMDB reads on the event loop: only for uncompressed values in the page cache, with the
same verification as the threaded path; everything else goes to a worker thread."""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.residency import is_resident, mincore_available

pytestmark = pytest.mark.skipif(not mincore_available(), reason="needs mincore (Linux)")

BLOCK = 256 << 10


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_is_resident_follows_the_page_cache(tmp_path: Path) -> None:
    anon = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    view = memoryview(anon)
    assert not is_resident(view[10:])  # never touched: no page behind it
    anon[: 2 * mmap.PAGESIZE] = b"x" * (2 * mmap.PAGESIZE)
    assert is_resident(view[10 : 2 * mmap.PAGESIZE])
    assert not is_resident(view[10 : 2 * mmap.PAGESIZE + 1])
    assert is_resident(view[:0])


async def test_resident_reads_run_inline_and_verify(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=64 * BLOCK)
    await tier.put_many((key(i), block(i)) for i in range(4))
    got = await tier.get(key(0))
    assert got is not None and np.array_equal(got, block(0))
    out = np.zeros(BLOCK, np.uint8)
    assert await tier.get_into(key(1), out) and np.array_equal(out, block(1))
    many = await tier.get_many([key(2), key(9), key(3)])
    assert many[1] is None and np.array_equal(many[0], block(2))  # type: ignore[arg-type]
    assert np.array_equal(many[2], block(3))  # type: ignore[arg-type]
    assert tier.stats()["reads_inline"] == 3
    assert tier.stats()["hits"] == 4 and tier.stats()["misses"] == 1
    await tier.aclose()


@pytest.mark.parametrize("url_options", ["inline_reads=0", "compress=zstd:1"])
async def test_threaded_reads_when_off_or_compressed(tmp_path: Path, url_options: str) -> None:
    tier = LMDBTier.from_url(f"lmdb://{tmp_path}/db?capacity=16MiB&{url_options}")
    value = (np.arange(BLOCK) % 7).astype(np.uint8)  # compresses (random bytes are kept raw)
    await tier.put(key(0), value)
    got = await tier.get(key(0))
    assert got is not None and np.array_equal(got, value)
    out = np.zeros(BLOCK, np.uint8)
    assert await tier.get_into(key(0), out) and np.array_equal(out, value)
    assert tier.stats()["reads_inline"] == 0
    await tier.aclose()


async def test_large_batches_read_inline_in_groups(tmp_path: Path) -> None:
    """A resident batch larger than INLINE_READ_BYTES is read on the loop in groups of at
    most that size (here 16 + 4 blocks), yielding to other tasks between them."""
    tier = LMDBTier(tmp_path / "db", capacity=64 * BLOCK)
    keys = [key(i) for i in range(20)]  # 5 MiB: more than INLINE_READ_BYTES
    await tier.put_many((k, block(i)) for i, k in enumerate(keys))
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    before = turns
    got = await tier.get_many(keys)
    ticker.cancel()
    assert all(np.array_equal(g, block(i)) for i, g in enumerate(got))  # type: ignore[arg-type]
    assert tier.stats()["reads_inline"] == 2
    assert turns > before  # the other task ran between the groups
    await tier.aclose()


async def test_a_block_too_large_for_the_loop_reads_the_rest_in_a_thread(
        tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=64 << 20)
    big = np.random.default_rng(7).integers(0, 256, 5 << 20, dtype=np.uint8)
    await tier.put_many([(key(0), block(0)), (key(1), big), (key(2), block(2))])
    got = await tier.get_many([key(0), key(1), key(2)])
    assert np.array_equal(got[0], block(0)) and np.array_equal(got[1], big)  # type: ignore[arg-type]
    assert np.array_equal(got[2], block(2))  # type: ignore[arg-type]
    assert tier.stats()["reads_inline"] == 1  # key 0 on the loop; keys 1-2 in one thread hop
    await tier.aclose()


async def test_values_not_in_the_page_cache_read_in_a_thread(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(b"p" * (4 * mmap.PAGESIZE))
    _drop_from_page_cache(probe)
    with probe.open("rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        if is_resident(memoryview(mapped)):
            pytest.skip("this filesystem keeps dropped pages cached (tmpfs?)")
    tier = LMDBTier(tmp_path / "db", capacity=64 * BLOCK)
    await tier.put(key(0), block(0))
    await tier.aclose()
    _drop_from_page_cache(tmp_path / "db" / "data.mdb")
    tier = LMDBTier(tmp_path / "db", capacity=64 * BLOCK)
    got = await tier.get(key(0))  # faulted in by the worker thread
    assert got is not None and np.array_equal(got, block(0))
    assert tier.stats()["reads_inline"] == 0
    got = await tier.get(key(0))  # now resident
    assert got is not None and np.array_equal(got, block(0))
    assert tier.stats()["reads_inline"] == 1
    await tier.aclose()


@pytest.mark.parametrize("batch", [False, True], ids=["get", "get_many"])
async def test_read_buffers_are_reused_but_never_under_a_held_block(tmp_path: Path,
                                                                    batch: bool) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=64 * BLOCK)
    await tier.put_many((key(i), block(i)) for i in range(20))
    held = await tier.get(key(0))
    view = held[BLOCK // 2:]  # a derived view keeps the slot too
    del held
    for _ in range(10):
        if batch:  # 5 MiB: read in a worker thread
            got = await tier.get_many([key(i) for i in range(1, 20)])
            assert all(np.array_equal(g, block(i + 1)) for i, g in enumerate(got))  # type: ignore[arg-type]
        else:
            for i in range(1, 4):
                one = await tier.get(key(i))
                assert one is not None and np.array_equal(one, block(i))
                del one
        got = []
        assert np.array_equal(view, block(0)[BLOCK // 2:])
    assert tier.stats()["read_slots_reused"] > 0
    await tier.aclose()


@pytest.mark.parametrize("call", ["get", "get_many", "get_into"])
async def test_a_large_block_being_evicted_is_read_in_a_thread(tmp_path: Path,
                                                               call: str) -> None:
    """A victim left the policy while it is demoted (still readable): its size comes from
    the eviction, so a block too large for the loop is still read in a worker thread."""
    big = np.random.default_rng(7).integers(0, 256, 5 << 20, dtype=np.uint8)
    tier = LMDBTier(tmp_path / "db", capacity=(5 << 20) + 4096)
    demoting = asyncio.Event()
    release = asyncio.Event()

    async def on_evict(k: bytes, b: np.ndarray) -> None:
        demoting.set()
        await release.wait()

    tier.on_evict = on_evict
    await tier.put(key(0), big)
    put = asyncio.create_task(tier.put(key(1), big[::-1].copy()))
    await demoting.wait()  # key 0 is leaving: out of the policy, still readable
    if call == "get":
        got = await tier.get(key(0))
    elif call == "get_many":
        got = (await tier.get_many([key(0)]))[0]
    else:
        got = np.zeros_like(big)
        assert await tier.get_into(key(0), got)
    assert got is not None and np.array_equal(got, big)
    assert tier.stats()["reads_inline"] == 0
    release.set()
    await put
    await tier.aclose()
