"""``file://?nowait=1``: cached files are read on the loop (``RWF_NOWAIT``), the rest in a
worker thread, with the same verification and miss/corruption handling either way."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.fsspec import FsspecTier

pytestmark = pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs RWF_NOWAIT")

BLOCK = 256 << 10


def block(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _drop_from_page_cache(path: str) -> bool:
    """Evict ``path`` from the page cache; whether the filesystem let it go."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


async def test_cached_files_are_read_on_the_loop(tmp_path: Path) -> None:
    tier = FsspecTier.from_url(f"file://{tmp_path}/t?nowait=1")
    await tier.put(key(0), block(0))
    got = await tier.get(key(0))
    assert got is not None and np.array_equal(got, block(0))
    assert await tier.get(key(1)) is None
    stats = tier.stats()
    assert stats["reads_nowait"] == 1 and stats["hits"] == 1 and stats["misses"] == 1
    await tier.aclose()


async def test_uncached_and_compressed_files_go_to_a_thread(tmp_path: Path) -> None:
    tier = FsspecTier.from_url(f"file://{tmp_path}/t?nowait=1&compress=zstd:1")
    value = (np.arange(BLOCK) % 7).astype(np.uint8)  # compresses
    await tier.put(key(0), value)
    await tier.put(key(1), block(1))  # random: stored uncompressed
    got = await tier.get(key(0))
    assert got is not None and np.array_equal(got, value)
    assert tier.stats()["reads_nowait"] == 0  # a small file, but it inflates to 256 KiB
    if not _drop_from_page_cache(tier.path_of(key(1))):
        pytest.skip("this filesystem keeps dropped pages cached")
    got = await tier.get(key(1))
    assert got is not None and np.array_equal(got, block(1))
    assert tier.stats()["reads_nowait"] == 0  # not cached: read in a thread
    got = await tier.get(key(1))
    assert got is not None and np.array_equal(got, block(1))
    assert tier.stats()["reads_nowait"] == 1  # cached by the read before
    await tier.aclose()


async def test_corrupt_file_read_on_the_loop_is_a_deleted_miss(tmp_path: Path) -> None:
    tier = FsspecTier.from_url(f"file://{tmp_path}/t?nowait=1")
    await tier.put(key(0), block(0))
    path = Path(tier.path_of(key(0)))
    data = bytearray(path.read_bytes())  # noqa: ASYNC240 (test set-up)
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # noqa: ASYNC240
    assert await tier.get(key(0)) is None
    assert tier.stats()["corrupt"] == 1
    assert not path.exists()  # noqa: ASYNC240
    await tier.aclose()


def test_nowait_is_for_file_urls_only() -> None:
    with pytest.raises(ConfigError, match="nowait: only for file://"):
        FsspecTier.from_url("memory://x?nowait=1")
