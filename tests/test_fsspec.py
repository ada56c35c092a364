"""Fsspec tier on file:// and memory://: conformance, layout, atomic publish, faults."""
# These tests inspect and damage files and remount filesystems directly, on purpose, from
# inside async tests; blocking there is harmless.
# ruff: noqa: ASYNC221, ASYNC240

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import register_implementation

from kvtier.errors import ConfigError, TierError, TierFullError
from kvtier.store import TieredStore
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier, key_path
from kvtier.tiers.registry import tier_from_url
from tests.helpers.tmpfs import mounted_tmpfs

_HEADER = 24 + 8 + 3 + 8  # frame header of a 1-d '<u2' or '|u1' block


class TestFileConformance(TierConformance):
    async def make_tier(self, capacity: int | None) -> Tier:
        return FsspecTier(f"file://{self.tmp_path}/t{len(self._created)}", capacity=capacity)

    def capacity_for(self, n_blocks: int, block_nbytes: int = 1024) -> int:
        return n_blocks * (block_nbytes + _HEADER)


class TestMemoryConformance(TestFileConformance):
    async def make_tier(self, capacity: int | None) -> Tier:
        return tier_from_url(f"memory://kvtest-{uuid.uuid4().hex}",
                             capacity=capacity, compress="zstd:1", shuffle="1")


class TestUnboundedFileConformance(TierConformance):
    bounded = False

    async def make_tier(self, capacity: int | None) -> Tier:
        return tier_from_url(f"file://{self.tmp_path}/u{len(self._created)}")


async def test_layout_is_content_addressed(tmp_path: Path) -> None:
    tier = FsspecTier(f"file://{tmp_path}/kv")
    key = b"../../etc/passwd"
    await tier.put(key, sample_block(1))
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    assert [str(p.relative_to(tmp_path / "kv")) for p in files] == \
        [f"{key.hex()[:2]}/{key.hex()[2:4]}/{key.hex()}.kvb"]
    long_key = b"x" * 128
    path = key_path("/r", long_key)
    assert len(path.rsplit("/", 1)[1]) < 255 and "xx" not in path
    assert key_path("/r", b"\x01", fanout=2) == "/r/01/00/01.kvb"
    await tier.aclose()


async def test_two_nodes_share_a_directory_and_readers_see_whole_blocks(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"
    node_a, node_b = FsspecTier(url), FsspecTier(url)
    block = sample_block(7, nbytes=1 << 20)
    stop = False
    seen: list[bool] = []

    async def reader() -> None:
        while not stop:
            got = await node_b.get(key_of(1))
            seen.append(got is not None)
            if got is not None:
                assert got.tobytes() == block.tobytes()
            await asyncio.sleep(0)

    task = asyncio.create_task(reader())
    await asyncio.gather(*(node.put(key_of(1), block) for _ in range(10)
                           for node in (node_a, node_b)))
    await asyncio.sleep(0.05)
    stop = True
    await task
    assert node_b.stats()["corrupt"] == 0 and any(seen)
    leftovers = [p.name for p in (tmp_path / "shared").rglob("*.tmp")]
    assert leftovers == []
    await node_a.aclose()
    await node_b.aclose()


async def test_corrupt_file_is_counted_miss_and_store_keeps_serving(tmp_path: Path) -> None:
    file_tier = FsspecTier(f"file://{tmp_path}/kv")
    await file_tier.put(key_of(1), sample_block(1))
    await file_tier.put(key_of(2), sample_block(2))
    path = Path(file_tier.path_of(key_of(1)))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))
    Path(file_tier.path_of(key_of(2))).write_bytes(b"KVTB\x01")  # torn write
    async with TieredStore([DRAMTier(capacity=1 << 20), file_tier]) as store:
        assert await store.get(key_of(1)) is None
        assert await store.get(key_of(2)) is None
        await store.put(key_of(3), sample_block(3))
        assert await store.get(key_of(3)) is not None
        assert file_tier.stats()["corrupt"] == 2
        assert not path.exists()


# ------------------------------------------------------------------ real filesystem faults
@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only); skipped where mount is not permitted."""
    with mounted_tmpfs(tmp_path / "mnt", "1m") as mnt:
        yield mnt


async def test_read_only_directory_mid_run(tiny_tmpfs: Path) -> None:
    file_tier = FsspecTier(f"file://{tiny_tmpfs}/kv")
    store = TieredStore([DRAMTier(capacity=4 * 1024), file_tier])
    for i in range(8):  # the first ones are demoted into the file tier
        await store.put(key_of(i), sample_block(i))
    on_disk = [i for i in range(8) if Path(file_tier.path_of(key_of(i))).exists()]
    assert on_disk
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    for i in range(8, 16):  # demotions now fail with EROFS: the victims stay, the puts fail
        with pytest.raises(TierFullError):
            await store.put(key_of(i), sample_block(i))
    for i in range(8):  # on disk or kept in DRAM: every acknowledged block
        got = await store.get(key_of(i))
        assert got is not None and got.tobytes() == sample_block(i).tobytes()
    with pytest.raises(TierError, match="Read-only"):
        await file_tier.put(key_of(99), sample_block(99))
    assert file_tier.stats()["io_errors"] >= 1
    assert store.stats()["tiers"][1]["errors"] >= 1
    await store.aclose()


async def test_disk_full_is_a_counted_error(tiny_tmpfs: Path) -> None:
    file_tier = FsspecTier(f"file://{tiny_tmpfs}/kv")
    store = TieredStore([DRAMTier(capacity=256 << 10), file_tier])
    acked = []
    for i in range(12):  # 3 MiB into a 1 MiB filesystem
        try:
            await store.put(key_of(i), sample_block(i, nbytes=256 << 10))
        except TierFullError:  # its victim could not be demoted: kept, this put refused
            continue
        acked.append(i)
    assert file_tier.stats()["io_errors"] >= 1
    assert 0 < len(acked) < 12
    assert not list(tiny_tmpfs.rglob("*.tmp")), "a failed write left its temp file"
    for i in acked:
        got = await store.get(key_of(i))  # never raises; every acknowledged block is intact
        assert got is not None and got.tobytes() == sample_block(i, nbytes=256 << 10).tobytes()
    await store.aclose()


class _FullMemoryFS(MemoryFileSystem):
    """A memory filesystem whose writes fail with ENOSPC once ``full`` is set."""

    protocol = "fullmem"
    full = False

    def pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if _FullMemoryFS.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        super().pipe_file(path, value, *args, **kwargs)


async def test_enospc_from_a_filesystem_wrapper() -> None:
    register_implementation("fullmem", _FullMemoryFS, clobber=True)
    tier = tier_from_url(f"fullmem://kv-{uuid.uuid4().hex}")
    await tier.put(key_of(1), sample_block(1))
    _FullMemoryFS.full = True
    try:
        with pytest.raises(TierError, match="No space"):
            await tier.put(key_of(2), sample_block(2))
        async with TieredStore([DRAMTier(capacity=2048), tier]) as store:
            for i in range(10, 12):
                await store.put(key_of(i), sample_block(i))
            for i in range(12, 16):  # no room without demoting into the full tier
                with pytest.raises(TierFullError, match="No space"):
                    await store.put(key_of(i), sample_block(i))
            for i in (1, 10, 11):
                got = await store.get(key_of(i))
                assert got is not None and got.tobytes() == sample_block(i).tobytes()
    finally:
        _FullMemoryFS.full = False


def test_from_url_separates_own_and_storage_options(tmp_path: Path) -> None:
    tier = tier_from_url(f"file://{tmp_path}/kv?capacity=1GiB&compress=zstd:3&fanout=1")
    assert isinstance(tier, FsspecTier)
    assert tier.capacity == 1 << 30 and tier.compress_level == 3 and tier.fanout == 1
    assert tier.storage_options == {} and tier.root == f"{tmp_path}/kv"
    assert tier.stats()["scheme"] == "file"
    mem = tier_from_url("memory://kv?capacity=1MiB&skip_instance_cache=true",
                        storage_options={"extra": "x"})
    assert isinstance(mem, FsspecTier)
    assert mem.storage_options == {"skip_instance_cache": True, "extra": "x"}


@pytest.mark.parametrize("url", [
    "file:///tmp/kv?fanout=9", "file:///tmp/kv?capacity=9ZB", "file:///tmp/kv?compress=lz4",
    "file:///tmp/kv?timeout=-1", "file:///tmp/kv?no_such_option=1",
])
def test_bad_urls_rejected(url: str) -> None:
    with pytest.raises(ConfigError):
        tier_from_url(url)


async def test_compressed_roundtrip_on_disk(tmp_path: Path) -> None:
    tier = FsspecTier(f"file://{tmp_path}/kv", compress_level=1, shuffle=True)
    rng = np.random.default_rng(0)
    kv = (rng.standard_normal((32, 512)) * 0.05).astype("<f2")
    await tier.put(key_of(1), kv)
    assert Path(tier.path_of(key_of(1))).stat().st_size < kv.nbytes * 0.95
    got = await tier.get(key_of(1))
    assert got is not None and np.array_equal(got, kv)
    await tier.aclose()


# ------------------------------------------------------------------------------ kvtier gc
@pytest.mark.slow
async def test_gc_trims_shared_directory_by_last_use(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from kvtier.cli import main

    url = f"file://{tmp_path}/shared"
    node_a, node_b = FsspecTier(url), FsspecTier(url)
    for i in range(10):
        await (node_a if i % 2 else node_b).put(key_of(i), sample_block(i, nbytes=4096))
    paths = [Path(node_a.path_of(key_of(i))) for i in range(10)]
    frame = paths[0].stat().st_size
    for i, path in enumerate(paths):  # block i last used at t0 + i
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    stale_tmp = paths[0].parent / f".{paths[0].name}.{uuid.uuid4().hex}.tmp"
    stale_tmp.write_bytes(b"partial")
    os.utime(stale_tmp, (1_000_000, 1_000_000))
    (tmp_path / "shared" / "README").write_text("not ours")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "kvtier.cli", "gc", url, "--capacity", str(4 * frame)]

    assert main([*cmd[3:], "--dry-run"]) == 0
    assert "would delete 7 files" in capsys.readouterr().out and all(p.exists() for p in paths)
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True)
    assert "deleted 7 files" in done.stdout, done.stdout
    assert [p.exists() for p in paths] == [False] * 6 + [True] * 4
    assert not stale_tmp.exists() and (tmp_path / "shared" / "README").exists()
    got = await node_b.get(key_of(9))
    assert got is not None and await node_b.get(key_of(0)) is None
    await node_a.aclose()
    await node_b.aclose()


def test_gc_refuses_bad_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    assert main(["gc", f"file://{tmp_path}", "--capacity", "lots"]) == 2
    assert "--capacity" in capsys.readouterr().out


async def test_read_of_old_block_on_read_only_mount(tiny_tmpfs: Path) -> None:
    # Issue 9, bug 6: a hit on a block whose atime is older than an hour called os.utime,
    # which fails with EROFS on a read-only mount (EPERM on a file another user owns).
    tier = FsspecTier(f"file://{tiny_tmpfs}/kv")
    await tier.put(key_of(1), sample_block(1))
    path = tier.path_of(key_of(1))
    os.utime(path, (1_000_000, 1_000_000))  # an old block
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    got = await tier.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(1).tobytes()
    assert tier.stats()["io_errors"] == 0
    assert os.stat(path).st_atime == 1_000_000  # the read wrote no metadata
    await tier.aclose()


class _BuggyMemoryFS(MemoryFileSystem):
    """A memory filesystem with a programming error in its read path."""

    protocol = "buggymem"

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        raise AttributeError("'NoneType' object has no attribute 'read'")


async def test_programming_error_is_not_a_miss() -> None:
    # Issue 9, bug 9: `_IO_ERRORS = (Exception,)` turned bugs into counted misses.
    register_implementation("buggymem", _BuggyMemoryFS, clobber=True)
    tier = tier_from_url(f"buggymem://kv-{uuid.uuid4().hex}")
    await tier.put(key_of(1), sample_block(1))
    with pytest.raises(AttributeError):
        await tier.get(key_of(1))
    assert tier.stats()["io_errors"] == 0
    await tier.aclose()


def test_policy_option(tmp_path: Path) -> None:
    for name in ("lru", "s3fifo", "arc"):
        tier = tier_from_url(f"file://{tmp_path}/kv?capacity=1MiB&policy={name}")
        assert isinstance(tier, FsspecTier) and tier.stats()["policy"] == name
    with pytest.raises(ConfigError, match="policy"):
        tier_from_url(f"file://{tmp_path}/kv?capacity=1MiB&policy=mru")


@pytest.mark.parametrize("nowait", ["0", "auto"])
async def test_contains_many_sees_other_writers_files_and_removals(tmp_path: Path,
                                                                   nowait: str) -> None:
    """One batch of existence checks (on the loop or in one thread): a reader that never
    wrote sees the files another node wrote, in key order, and misses removed ones."""
    url = f"file://{tmp_path}/kv?nowait={nowait}"
    writer, reader = FsspecTier.from_url(url), FsspecTier.from_url(url)
    try:
        await writer.put_many([(key_of(i), sample_block(i)) for i in (0, 1, 3)])
        keys = [key_of(i) for i in range(5)]
        assert await reader.contains_many(keys) == [True, True, False, True, False]
        os.remove(await reader._path(key_of(1)))
        assert await reader.contains_many(keys) == [True, False, False, True, False]
        assert await writer.contains_many(keys[:2]) == [True, True]  # its own: held
    finally:
        await writer.aclose()
        await reader.aclose()
