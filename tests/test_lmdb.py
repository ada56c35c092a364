"""LMDB tier: the conformance suite plus budget-on-disk, warm restart, locking, corruption."""
# Some tests inspect the tier's directory directly from async code, on purpose.
# ruff: noqa: ASYNC240

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.testing.fakes import FakeClock
from kvtier.tiers.base import Block, Tier
from kvtier.tiers.lmdb import DirectoryLockedError, LMDBTier, default_overhead
from kvtier.tiers.registry import tier_from_url

_HEADER = 24 + 8 + 3 + 8  # frame header of a 1-d '<u2' or '|u1' block


class TestLMDBConformance(TierConformance):
    async def make_tier(self, capacity: int | None) -> Tier:
        path = self.tmp_path / f"lmdb{len(self._created)}"
        return LMDBTier(path, capacity=capacity if capacity is not None else 64 << 20)

    def capacity_for(self, n_blocks: int, block_nbytes: int = 1024) -> int:
        # The budget accounts stored frames: payload plus a small header.
        return n_blocks * (block_nbytes + _HEADER)


class TestLMDBCompressedConformance(TestLMDBConformance):
    async def make_tier(self, capacity: int | None) -> Tier:
        path = self.tmp_path / f"lmdbz{len(self._created)}"
        return LMDBTier(path, capacity=capacity if capacity is not None else 64 << 20,
                        compress_level=3, shuffle=True)


class TestLMDBThreadedReadsConformance(TestLMDBConformance):
    """Every read in a worker thread (``inline_reads=False``): what a read of a value not in
    the page cache, or larger than ``INLINE_READ_BYTES``, does."""

    async def make_tier(self, capacity: int | None) -> Tier:
        path = self.tmp_path / f"lmdbt{len(self._created)}"
        return LMDBTier(path, capacity=capacity if capacity is not None else 64 << 20,
                        inline_reads=False)


def _du(path: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[0])


async def test_disk_bounded_after_ten_times_capacity(tmp_path: Path) -> None:
    capacity = 8 << 20
    tier = LMDBTier(tmp_path / "db", capacity=capacity)
    evicted = 0

    async def on_evict(key: bytes, block: Block) -> None:
        nonlocal evicted
        evicted += 1

    tier.on_evict = on_evict
    rng = np.random.default_rng(0)
    sizes = [64 << 10, 256 << 10, 1 << 20, 96 << 10]
    written = 0
    i = 0
    while written < 10 * capacity:
        nbytes = sizes[i % len(sizes)]
        await tier.put(key_of(i), rng.integers(0, 255, nbytes, dtype=np.uint8))
        written += nbytes
        assert tier.used <= capacity
        i += 1
    assert evicted > 0
    await tier.aclose()
    bound = capacity + default_overhead(capacity) + (64 << 10)
    assert _du(tmp_path / "db") <= bound, f"du {_du(tmp_path / 'db')} > {bound}"


async def test_map_full_is_absorbed_by_evicting(tmp_path: Path) -> None:
    # A tiny overhead forces MapFullError (page rounding alone exceeds it): the tier must
    # evict more and keep serving, never raise.
    capacity = 4 << 20
    tier = LMDBTier(tmp_path / "db", capacity=capacity, overhead=256 << 10)
    for i in range(80):
        await tier.put(key_of(i), sample_block(i, nbytes=(64 << 10) + 64, dtype="|u1"))
    assert tier.stats()["map_full"] > 0
    got = await tier.get(key_of(79))
    assert got is not None and got.tobytes() == sample_block(79, (64 << 10) + 64, "|u1").tobytes()
    await tier.aclose()
    assert _du(tmp_path / "db") <= capacity + (256 << 10) + (64 << 10)


async def test_warm_restart_restores_contents_usage_and_recency(tmp_path: Path) -> None:
    clock = FakeClock()
    cap = 4 * (1024 + _HEADER)
    tier = LMDBTier(tmp_path / "db", capacity=cap, clock=clock)
    for i in range(4):
        clock.advance(1)
        await tier.put(key_of(i), sample_block(i))
    clock.advance(1)
    assert await tier.get(key_of(0)) is not None  # 0 becomes most recent; 1 is LRU now
    used = tier.used
    await tier.aclose()

    reopened = LMDBTier(tmp_path / "db", capacity=cap, clock=clock)
    assert await reopened.contains_many([key_of(i) for i in range(4)]) == [True] * 4
    assert reopened.used == used
    clock.advance(1)
    await reopened.put(key_of(9), sample_block(9))
    assert await reopened.contains_many([key_of(i) for i in (0, 1, 2, 3, 9)]) == \
        [True, False, True, True, True]
    got = await reopened.get(key_of(2))
    assert got is not None and got.tobytes() == sample_block(2).tobytes()
    await reopened.aclose()


async def test_second_opener_gets_clear_error(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=1 << 20)
    await tier.put(key_of(1), sample_block(1))
    with pytest.raises(DirectoryLockedError, match="already open"):
        LMDBTier(tmp_path / "db", capacity=1 << 20)
    await tier.aclose()
    again = LMDBTier(tmp_path / "db", capacity=1 << 20)
    assert await again.get(key_of(1)) is not None
    await again.aclose()


def test_other_process_is_refused(tmp_path: Path) -> None:
    import asyncio
    import sys

    tier = LMDBTier(tmp_path / "db", capacity=1 << 20)
    code = ("import sys; from kvtier.tiers.lmdb import LMDBTier, DirectoryLockedError\n"
            "try:\n LMDBTier(sys.argv[1], capacity=1<<20)\n"
            "except DirectoryLockedError as e:\n print('LOCKED', e); sys.exit(3)\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "db")], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "LOCKED" in proc.stdout
    asyncio.run(tier.aclose())


async def test_corrupt_value_is_miss_deleted_and_counted(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=1 << 20)
    block = sample_block(1, nbytes=8192)
    await tier.put(key_of(1), block)
    await tier.put(key_of(2), sample_block(2))
    env = tier._env
    assert env is not None
    with env.env.begin(write=True) as txn:  # flip one payload byte behind the tier's back
        raw = bytearray(txn.get(key_of(1), db=env.payload))
        raw[100] ^= 0xFF
        txn.put(key_of(1), bytes(raw), db=env.payload)
        txn.put(key_of(2), bytes(raw[:50]), db=env.payload)  # torn: shorter than declared
    out = np.full(block.shape, 7, dtype=block.dtype)
    assert await tier.get_into(key_of(2), out) is False
    assert (out == 7).all(), "a corrupt block must not reach the caller's buffer"
    assert await tier.get(key_of(1)) is None
    assert tier.stats()["corrupt"] == 2
    assert not await tier.contains(key_of(1))
    with env.env.begin() as txn:
        assert txn.get(key_of(1), db=env.payload) is None
    await tier.put(key_of(2), sample_block(2))
    assert await tier.get(key_of(2)) is not None
    await tier.aclose()


async def test_compression_shrinks_kv_like_data(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=64 << 20, compress_level=1, shuffle=True)
    rng = np.random.default_rng(3)
    kv = (rng.standard_normal((64, 1024)) * rng.uniform(0.01, 0.5, (1, 1024))).astype("<f2")
    await tier.put(key_of(1), kv)
    assert tier.used < kv.nbytes * 0.95
    got = await tier.get(key_of(1))
    assert got is not None and got.dtype == kv.dtype and np.array_equal(got, kv)
    await tier.aclose()


def test_from_url(tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/db?capacity=64MiB&compress=zstd:3&shuffle=1&sync=meta"
    tier = tier_from_url(url)
    assert isinstance(tier, LMDBTier)
    assert tier.capacity == 64 << 20 and tier.compress_level == 3 and tier.shuffle
    assert tier.sync == "meta" and tier.map_size >= (64 << 20) + default_overhead(64 << 20)
    import asyncio
    asyncio.run(tier.aclose())


@pytest.mark.parametrize("suffix", [
    "?capacity=1GiB&compress=lz4", "?capacity=1GiB&compress=zstd:99", "?capacity=1GiB&sync=2",
    "?capacity=1GiB&bogus=1", "?capacity=12XB",
])
def test_bad_urls_rejected(tmp_path: Path, suffix: str) -> None:
    with pytest.raises(ConfigError):
        tier_from_url(f"lmdb://{tmp_path}/db{suffix}")


@pytest.mark.parametrize("url", ["lmdb://host/db", "lmdb:///"])
def test_url_needs_local_path(url: str) -> None:
    with pytest.raises(ConfigError):
        tier_from_url(url)


async def test_sync0_cache_discarded_after_os_crash_kept_after_process_crash(
        tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=1 << 20)
    await tier.put(key_of(1), sample_block(1))
    assert (tmp_path / "db" / "kvtier.open").exists()
    await tier.aclose()
    assert not (tmp_path / "db" / "kvtier.open").exists()  # clean close

    # A marker from this boot = the process died: committed data is intact and kept.
    boot_file = Path("/proc/sys/kernel/random/boot_id")
    if not boot_file.exists():
        pytest.skip("no kernel boot id on this platform")
    boot = boot_file.read_text().strip()
    (tmp_path / "db" / "kvtier.open").write_text(boot)
    tier = LMDBTier(tmp_path / "db", capacity=1 << 20)
    assert await tier.get(key_of(1)) is not None
    assert tier.stats()["discarded_after_os_crash"] is False
    await tier.aclose()

    # A marker from another boot = the machine went down with sync=0: discard the cache.
    (tmp_path / "db" / "kvtier.open").write_text("00000000-dead-beef-0000-000000000000")
    tier = LMDBTier(tmp_path / "db", capacity=1 << 20)
    assert await tier.get(key_of(1)) is None
    assert tier.used == 0 and tier.stats()["discarded_after_os_crash"] is True
    await tier.put(key_of(2), sample_block(2))
    assert await tier.get(key_of(2)) is not None
    await tier.aclose()
