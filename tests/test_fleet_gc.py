"""A shared ``file://`` directory bounded as a fleet (issue 22 item 9): nodes log their reads
(reads leave atime alone), and ``kvtier gc`` keeps the blocks they read even when their
files are the oldest. Three tier objects write one directory; a reader that cannot write
the log still reads. Real files, the real CLI in-process."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.testing.conformance import key_of
from kvtier.tiers.fleet_lease import GcLease
from kvtier.tiers.fleet_uses import USE_DIR, read_uses
from kvtier.tiers.fsspec import FsspecTier

BLOCK = 16 << 10


def _block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


async def test_gc_keeps_blocks_nodes_read(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/shared"
    writers = [FsspecTier.from_url(url) for _ in range(3)]
    for n, tier in enumerate(writers):
        for i in range(n * 10, n * 10 + 10):
            await tier.put(key_of(i), _block(i))
    hot = [i for i in range(30) if i % 3 == 0]
    for i in hot:  # node 1 reads these
        got = await writers[1].get(key_of(i))
        assert got is not None and np.array_equal(got, _block(i))
    # Then the files age as on a noatime mount (relatime: within a day of the last atime
    # update): the blocks node 1 read are the oldest by mtime and atime.
    now = time.time()
    for i in range(30):
        age = 10_000 if i % 3 == 0 else 1_000
        os.utime(writers[0].path_of(key_of(i)), (now - age, now - age))
    for tier in writers:
        await tier.aclose()  # writes the pending use log
    logged, _ = read_uses(str(tmp_path / "shared"))
    assert {key_of(i).hex() for i in hot} <= set(logged)

    left = _gc_keeping(url, [writers[0].path_of(key_of(i)) for i in range(30)], 12)
    assert "deleted 18 files" in capsys.readouterr().out
    assert left >= set(hot), sorted(left)  # the read blocks survive although oldest


def _gc_keeping(url: str, paths: list[str], blocks: int) -> set[int]:
    """Run ``kvtier gc`` with room for ``blocks`` blocks; the indexes of surviving paths."""
    assert main(["gc", url, "--capacity", str(blocks * os.path.getsize(paths[0]))]) == 0
    return {i for i, path in enumerate(paths) if os.path.exists(path)}


async def test_reader_that_cannot_log_still_reads(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    url = f"file://{tmp_path}/shared"
    writer = FsspecTier.from_url(url)
    await writer.put(key_of(1), _block(1))
    await writer.aclose()
    (tmp_path / "shared" / USE_DIR).write_bytes(b"")  # the log folder cannot be made
    reader = FsspecTier.from_url(url + "?probe=0")
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.fsspec"):
        for _ in range(3):
            got = await reader.get(key_of(1))
            assert got is not None and np.array_equal(got, _block(1))
        await reader.aclose()
    assert sum("cannot write the use log" in r.getMessage() for r in caplog.records) == 1
    assert reader.fleet is not None and reader.fleet.uses is not None
    assert not reader.fleet.uses.enabled


def test_use_log_option(tmp_path: Path) -> None:
    off = FsspecTier.from_url(f"file://{tmp_path}/a?use_log=0").fleet
    on = FsspecTier.from_url(f"file://{tmp_path}/b").fleet
    assert off is not None and off.uses is None and on is not None and on.uses is not None
    assert FsspecTier.from_url("memory://kvtier-uselog").fleet is None  # file:// only


async def test_three_nodes_one_background_gc_at_a_time(tmp_path: Path) -> None:
    """Three tiers with fleet_capacity on one directory plus a reader with probe=0: the
    directory is trimmed to the fleet's budget, read blocks stay, a held lease makes the
    others skip, and the deleting node forgets its own deleted keys."""
    root = tmp_path / "shared"
    frame = 16 << 10
    url = f"file://{root}?fleet_capacity={12 * (frame + 4096)}&gc_interval=3600"
    writer = FsspecTier.from_url(f"file://{root}")
    for i in range(30):
        await writer.put(key_of(i), _block(i))
    paths = [writer.path_of(key_of(i)) for i in range(30)]
    size = _sizes(paths[:1])[0]
    reader = FsspecTier.from_url(f"file://{root}?probe=0")
    hot = [i for i in range(30) if i % 3 == 0]
    for i in hot:
        assert await reader.get(key_of(i)) is not None
    await reader.fleet.uses.flush()  # type: ignore[union-attr]
    now = time.time()
    for i in range(30):  # the read blocks are the oldest files
        age = 10_000 if i in hot else 1_000
        os.utime(writer.path_of(key_of(i)), (now - age, now - age))

    nodes = [FsspecTier.from_url(url) for _ in range(3)]
    held = nodes[0]
    await held.open()  # its first pass ran at once (interval 1 h: no second one)
    for _ in range(200):
        if held.stats()["gc_runs"]:
            break
        await asyncio.sleep(0.02)
    stats = held.stats()
    assert stats["gc_runs"] == 1 and stats["gc_deleted"] > 0
    left = {i for i, s in enumerate(_sizes(paths)) if s}
    assert left >= set(hot) and len(left) * size <= stats["fleet_capacity"]

    held_gc = held.fleet.collector  # type: ignore[union-attr]
    assert held_gc is not None and held_gc.lease.acquire()  # a pass in progress
    try:
        for node in nodes[1:]:
            await node.open()
            gc = node.fleet.collector  # type: ignore[union-attr]
            assert gc is not None and await gc.collect() is None
            assert node.stats()["gc_skipped"] >= 1
    finally:
        held_gc.lease.release()
    # Once released, another node takes the lease; the nodes' own first background passes
    # (started at open) may hold it for a moment first, so allow them to finish.
    collector = nodes[1].fleet.collector  # type: ignore[union-attr]
    assert collector is not None
    for _ in range(250):
        if await collector.collect() is not None:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("no gc pass ran after the lease was released")

    # The writer's own budget forgets what a fleet gc deleted when it is the deleting node.
    own = FsspecTier.from_url(url)
    await own.put(key_of(100), _block(100))
    os.utime(own.path_of(key_of(100)), (now - 99_999, now - 99_999))
    await own.open()
    for _ in range(200):
        if own.stats()["gc_runs"]:
            break
        await asyncio.sleep(0.02)
    assert not await own.contains(key_of(100))
    for tier in (writer, reader, *nodes, own):
        await tier.aclose()
    assert GcLease(str(root), "after").acquire()  # every pass released its lease


def _sizes(paths: list[str]) -> list[int]:
    """Each file's size, 0 where it is gone."""
    return [os.path.getsize(p) if os.path.exists(p) else 0 for p in paths]


def test_fleet_capacity_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fleet_capacity"):
        FsspecTier.from_url("memory://kv?fleet_capacity=1GiB")
    with pytest.raises(ConfigError, match="fleet_capacity"):
        FsspecTier.from_url(f"file://{tmp_path}?fleet_capacity=0")
    with pytest.raises(ConfigError, match="gc_interval"):
        FsspecTier.from_url(f"file://{tmp_path}?fleet_capacity=1GiB&gc_interval=0")
