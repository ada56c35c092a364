"""kvtier.events_watch: the directory watch behind gc and wipe events (its end-to-end test,
with real processes, is tests/test_events_gc.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.events_watch import EPOCH_NAME, DirectoryWatch, bump_epoch
from kvtier.store import TieredStore
from kvtier.tiers.fleet_gc import collect_local
from kvtier.tiers.fsspec import FsspecTier


async def test_a_look_sees_a_marker_appear_change_and_vanish(tmp_path: Path) -> None:
    calls: list[int] = []

    async def changed() -> None:
        calls.append(1)

    watch = DirectoryWatch([tmp_path / EPOCH_NAME], 60.0, changed, name="t")
    assert not await watch.look()  # the first look is the baseline
    assert not await watch.look()
    bump_epoch(tmp_path, "test")
    assert await watch.look() and not await watch.look()
    first = json.loads((tmp_path / EPOCH_NAME).read_text())["epoch"]
    bump_epoch(tmp_path, "test")  # a new epoch, even within one mtime tick: a new inode
    assert json.loads((tmp_path / EPOCH_NAME).read_text())["epoch"] != first
    assert await watch.look()
    (tmp_path / EPOCH_NAME).unlink()
    assert await watch.look()
    assert len(calls) == watch.changes == 3 and watch.errors == 0


async def test_a_failing_recheck_is_counted_and_the_watch_goes_on(tmp_path: Path) -> None:
    async def changed() -> None:
        raise OSError("mount gone")

    watch = DirectoryWatch([tmp_path / EPOCH_NAME], 60.0, changed, name="t")
    await watch.look()
    bump_epoch(tmp_path, "test")
    assert await watch.look()
    assert watch.errors == 1
    with pytest.raises(ValueError, match="interval"):
        DirectoryWatch([tmp_path], 0, changed, name="t")


async def test_another_gc_of_the_directory_becomes_removals_then_a_clear(tmp_path: Path) -> None:
    """In one process for speed: a gc pass (what ``kvtier gc`` runs) deletes the tier's
    files; the tier's watch rechecks and the store's subscribers hear of each block, then
    of the emptied tier."""
    root = tmp_path / "kv"
    tier = FsspecTier(f"file://{root}", use_log=False, watch=3600.0, name="file")
    store = TieredStore([tier], node="n")
    await tier.open()
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    async with store:
        sub = store.events(resync=False)
        await store.put_many([(k, np.zeros(256, np.uint8)) for k in keys])
        assert tier.fleet is not None and tier.fleet.watch is not None
        await tier.fleet.watch.look()  # baseline after the puts
        result = collect_local(str(root), 2 * 300, None)  # keeps about 2 of 4 blocks
        assert 0 < len(result.deleted) < len(keys)
        assert await tier.fleet.watch.look()
        gone = {k for e in sub.drain_nowait() if isinstance(e, BlockRemoved) for k in e.keys}
        assert gone == {k for k in keys if not (root / tier.path_of(k)).exists()}
        assert len(gone) == len(result.deleted)
        collect_local(str(root), 0, None)
        assert await tier.fleet.watch.look()
        events = [e for e in sub.drain_nowait() if not isinstance(e, BlockStored)]
        assert {k for e in events if isinstance(e, BlockRemoved) for k in e.keys} == \
            set(keys) - gone
        assert isinstance(events[-1], AllBlocksCleared) and events[-1].tier == "file"
        assert tier.used == 0
