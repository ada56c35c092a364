"""An evicted block that no lower tier takes (a full disk, a failing tier) stays where it is,
and the put that needed the room fails: an acknowledged block never vanishes (issue 21)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import TierError, TierFullError
from kvtier.store import TieredStore
from kvtier.testing.conformance import BLOCK_BYTES, key_of, sample_block
from kvtier.testing.fakes import FailingTier
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.tmpfs import fill_up, mounted_tmpfs

DRAM_BLOCKS = 8
PUTS = 40


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only; skipped elsewhere)."""
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        yield mnt


async def _put_past_the_top(store: TieredStore) -> tuple[list[int], int]:
    """Put more blocks than the top tier holds; returns the acknowledged ones and how many
    puts raised (always ``TierError``)."""
    acked: list[int] = []
    refused = 0
    for i in range(PUTS):
        try:
            await store.put(key_of(i), sample_block(i))
        except TierError:
            refused += 1
        else:
            acked.append(i)
    return acked, refused


async def _assert_readable(store: TieredStore, acked: list[int]) -> None:
    got = await store.get_many([key_of(i) for i in acked])
    lost = [i for i, block in zip(acked, got, strict=True) if block is None]
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged blocks vanished: {lost}"
    assert all(block is not None and block.tobytes() == sample_block(i).tobytes()
               for i, block in zip(acked, got, strict=True))


async def _check(lower: Tier) -> TieredStore:
    store = TieredStore([DRAMTier(capacity=DRAM_BLOCKS * BLOCK_BYTES), lower],
                        close_flush=False)
    async with store:
        acked, refused = await _put_past_the_top(store)
        await _assert_readable(store, acked)
        assert len(acked) == DRAM_BLOCKS and refused == PUTS - DRAM_BLOCKS
        stats = store.stats()
        assert stats["evictions_refused"] >= refused
        assert stats["tiers"][0]["used"] <= DRAM_BLOCKS * BLOCK_BYTES  # never over budget
        assert stats["tiers"][0]["evictions"] == 0
        # Room made by a delete is used again: the refusal lasts only while the tier is full.
        await store.delete(key_of(acked[0]))
        await store.put(key_of(1000), sample_block(1000))
        await _assert_readable(store, [*acked[1:], 1000])
    return store


async def test_dram_over_a_full_lmdb_refuses_puts_instead_of_dropping_acked_blocks(
        small_tmpfs: Path) -> None:
    lmdb = LMDBTier(small_tmpfs / "db", capacity=64 << 20)
    assert not await lmdb.contains(key_of(0))  # opened while the disk has room
    fill_up(small_tmpfs)
    await _check(lmdb)


async def test_dram_over_a_refusing_tier_refuses_puts_instead_of_dropping() -> None:
    await _check(FailingTier(DRAMTier(), fail={"put"}))


async def test_a_put_that_cannot_make_room_says_the_store_is_full() -> None:
    # A full store raises TierFullError (a peer server answers 507 Insufficient Storage).
    lower = FailingTier(DRAMTier(), fail={"put"})
    async with TieredStore([DRAMTier(capacity=BLOCK_BYTES), lower]) as store:
        await store.put(key_of(1), sample_block(1))
        with pytest.raises(TierFullError, match="no tier accepted"):
            await store.put(key_of(2), sample_block(2))
        with pytest.raises(TierFullError):
            await store.put_many([(key_of(3), sample_block(3))])
        lower.fail = set()  # the lower tier recovers: evictions demote again
        await store.put(key_of(2), sample_block(2))
        assert await lower.inner.contains(key_of(1))
        await _assert_readable(store, [1, 2])


async def test_a_put_whose_lower_tiers_all_fail_is_a_tier_error() -> None:
    # Every tier failed (none was merely full): TierError, not TierFullError.
    async with TieredStore([FailingTier(DRAMTier(), fail={"put"}),
                            FailingTier(DRAMTier(), fail={"put"})]) as store:
        with pytest.raises(TierError) as caught:
            await store.put(key_of(1), sample_block(1))
        assert type(caught.value) is TierError


async def test_a_promotion_that_needs_a_refused_eviction_is_skipped() -> None:
    lower = FailingTier(DRAMTier(), fail={"put"})
    async with TieredStore([DRAMTier(capacity=BLOCK_BYTES), lower], promote="all") as store:
        await store.put(key_of(1), sample_block(1))
        await lower.inner.put(key_of(2), sample_block(2))
        got = await store.get(key_of(2))  # promoting it would evict key 1 into the lower tier
        assert got is not None and got.tobytes() == sample_block(2).tobytes()
        assert await store.tiers[0].contains(key_of(1))
        assert not await store.tiers[0].contains(key_of(2))
        await _assert_readable(store, [1, 2])
