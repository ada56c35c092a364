"""DRAM -> LMDB -> file chain, end to end: demotion down the chain, promotion up, restart,
and the store's hypothesis state machine over the real persistent tiers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings

from kvtier.store import open_store
from kvtier.testing.chain import make_chain_machine
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.hypothesis_profiles import examples

KB = 1024
BLOCK = 64 * KB
FRAME = BLOCK + 43  # a 1-d '|u1' block's frame


def _urls(tmp: Path) -> list[str]:
    return [f"dram://?capacity={4 * BLOCK}",
            f"lmdb://{tmp}/lmdb?capacity={8 * FRAME}",
            f"file://{tmp}/files"]


def _blk(i: int) -> object:
    return sample_block(i, nbytes=BLOCK, dtype="|u1")


async def test_demotion_down_and_promotion_up(tmp_path: Path) -> None:
    store = await open_store(_urls(tmp_path))
    dram, lmdb_tier, files = store.tiers
    assert isinstance(lmdb_tier, LMDBTier) and isinstance(files, FsspecTier)
    for i in range(20):
        await store.put(key_of(i), _blk(i))
    # 4 blocks fit in DRAM and 8 in LMDB: the oldest 8 went all the way down to files.
    assert await dram.contains_many([key_of(i) for i in range(16, 20)]) == [True] * 4
    assert await lmdb_tier.contains_many([key_of(i) for i in range(8, 16)]) == [True] * 8
    assert await files.contains_many([key_of(i) for i in range(8)]) == [True] * 8
    assert lmdb_tier.evictions >= 8 and dram.evictions >= 16

    got = await store.get(key_of(0))  # a file hit, promoted into DRAM and LMDB
    assert got is not None and got.tobytes() == _blk(0).tobytes()
    assert await dram.contains(key_of(0)) and await lmdb_tier.contains(key_of(0))
    # That promotion pushed LMDB's two oldest (8, 9) down to files; 15 is still in LMDB.
    assert await files.contains_many([key_of(8), key_of(9)]) == [True, True]
    got = await store.get(key_of(15))  # an LMDB hit, promoted into DRAM
    assert got is not None and got.tobytes() == _blk(15).tobytes()
    assert await dram.contains(key_of(15))
    stats = store.stats()["tiers"]
    assert [t["hits"] for t in stats] == [0, 1, 1]
    assert stats[1]["promotions"] + stats[0]["promotions"] >= 2
    for i in range(20):  # nothing was lost anywhere in the chain
        got = await store.get(key_of(i))
        assert got is not None and got.tobytes() == _blk(i).tobytes(), i
    await store.aclose()

    # Restart: DRAM is empty, LMDB comes back warm, files are still there.
    store = await open_store(_urls(tmp_path))
    assert await store.tiers[1].contains(key_of(15))  # the index loads on first use
    assert store.tiers[1].used == 8 * FRAME
    for i in range(20):
        got = await store.get(key_of(i))
        assert got is not None and got.tobytes() == _blk(i).tobytes(), i
    await store.aclose()


_dirs: list[str] = []


def _persistent_chain() -> list[Tier]:
    tmp = tempfile.mkdtemp(prefix="kvtier-chain-")
    _dirs.append(tmp)
    header = 43
    return [DRAMTier(capacity=3 * KB, name="dram"),
            LMDBTier(f"{tmp}/lmdb", capacity=5 * (KB + header), name="lmdb"),
            FsspecTier(f"file://{tmp}/files", capacity=8 * (KB + header), name="file")]


def _cleanup() -> None:
    while _dirs:
        shutil.rmtree(_dirs.pop(), ignore_errors=True)


TestPersistentChain = make_chain_machine(_persistent_chain, cleanup=_cleanup, settings=settings(
    max_examples=examples(25), stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])).TestCase
