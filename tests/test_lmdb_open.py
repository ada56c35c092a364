"""LMDB tier opening: cancellation-safe cold open, writemap preallocation, the open marker."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.tmpfs import fill_up, mounted_tmpfs


@pytest.mark.slow
async def test_cancelled_cold_open_is_reused_not_repeated(tmp_path: Path) -> None:
    # Issue 9, bug 5: a store timeout cancelling the first open made the next call open
    # the same environment again in this process, which LMDB forbids.
    tier = LMDBTier(tmp_path / "db")
    n = 50_000  # an index that takes a while to load, so the first open is still running
    for start in range(0, n, 10_000):
        await tier.put_many([(key_of(i), b"x") for i in range(start, start + 10_000)])
    await tier.aclose()
    tier = LMDBTier(tmp_path / "db")
    first = asyncio.ensure_future(tier.contains(key_of(1)))
    # Polls a file the open's worker thread creates (nothing on the loop to wait on).
    while not (tmp_path / "db" / "kvtier.open").exists():  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await tier.contains(key_of(1))
    await tier.put(key_of(n), sample_block(1))
    got = await tier.get(key_of(n))
    assert got is not None and got.tobytes() == sample_block(1).tobytes()
    assert len(tier) == n + 1
    await tier.aclose()


async def _filled(path: Path, n: int) -> None:
    tier = LMDBTier(path, capacity=1 << 20)
    for i in range(n):
        await tier.put(key_of(i), sample_block(i))
    await tier.aclose()


async def _intact(path: Path, n: int) -> None:
    tier = LMDBTier(path, capacity=1 << 20)
    present = await tier.contains_many([key_of(i) for i in range(n)])
    assert all(present), f"{present.count(False)} of {n} blocks gone"
    assert tier.stats()["discarded_after_os_crash"] is False
    got = await tier.get(key_of(0))
    assert got is not None and got.tobytes() == sample_block(0).tobytes()
    await tier.aclose()


@pytest.mark.parametrize("marker", [b"", b"\xff\xfe garbage", b"not-a-boot-id"])
async def test_unreadable_open_marker_keeps_the_cache(tmp_path: Path, marker: bytes) -> None:
    # Issue 9, bug 13: an empty (or garbled) marker read as "the machine went down".
    await _filled(tmp_path / "db", 100)
    (tmp_path / "db" / "kvtier.open").write_bytes(marker)
    await _intact(tmp_path / "db", 100)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only); skipped where mount is not permitted."""
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        yield mnt


async def test_reopen_on_full_disk_keeps_the_cache(small_tmpfs: Path) -> None:
    # Issue 9, bug 13: the marker was rewritten with O_TRUNC; ENOSPC left it empty and the
    # next open unlinked data.mdb (100 of 100 blocks gone).
    db = small_tmpfs / "db"
    await _filled(db, 100)
    fill_up(small_tmpfs)
    await _intact(db, 100)  # the marker cannot be written: opens anyway
    await _intact(db, 100)


def test_writemap_on_a_disk_too_small_is_refused_not_sigbus(small_tmpfs: Path) -> None:
    # Issue 9, bug 12: with writemap=1 LMDB writes into a mapping of a sparse file, and a
    # full disk killed the process with SIGBUS. A subprocess, so a SIGBUS cannot take
    # pytest down with it.
    script = textwrap.dedent(f"""
        import asyncio
        from kvtier.errors import ConfigError
        from kvtier.testing.conformance import key_of, sample_block
        from kvtier.tiers.lmdb import LMDBTier

        async def main():
            tier = LMDBTier({str(small_tmpfs / "db")!r}, capacity=16 << 20, writemap=True)
            try:
                for i in range(16 * 64):
                    await tier.put(key_of(i), sample_block(i, nbytes=16 << 10))
            except ConfigError as exc:
                print("refused:", exc)
            finally:
                await tier.aclose()

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()},
                          check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "refused: writemap: cannot preallocate" in proc.stdout


async def test_writemap_preallocates_the_map(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "db", capacity=1 << 20, writemap=True)
    await tier.put(key_of(1), sample_block(1))
    data = tmp_path / "db" / "data.mdb"
    assert data.stat().st_blocks * 512 >= tier.map_size
    got = await tier.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(1).tobytes()
    await tier.aclose()


def test_bad_writemap_capacity_error_names_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="writemap"):
        LMDBTier.from_url(f"lmdb://{tmp_path}/db?capacity=1MiB&writemap=maybe")
