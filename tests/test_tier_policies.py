"""``policy=lru|s3fifo|arc`` on every budgeted tier: the conformance suite with each
non-default policy (the default, lru, runs in each tier's own test module), and the
``policy=`` option's parsing."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvtier.errors import ConfigError
from kvtier.testing.conformance import BLOCK_BYTES, TierConformance
from kvtier.tiers.base import Tier
from kvtier.tiers.budget import BudgetedTier, parse_policy
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.hbm import HBMTier
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.registry import tier_from_url

_HEADER = 24 + 8 + 3 + 8  # frame header of a 1-d '<u2' or '|u1' block


class _PolicyConformance(TierConformance):
    policy: ClassVar[str]
    # The eviction order is the policy's, not LRU's: a hit protects a block differently.
    lru_visible = False


class _FramedCapacity(_PolicyConformance):
    def capacity_for(self, n_blocks: int, block_nbytes: int = BLOCK_BYTES) -> int:
        return n_blocks * (block_nbytes + _HEADER)


class TestDRAMS3FIFO(_PolicyConformance):
    policy = "s3fifo"

    async def make_tier(self, capacity: int | None) -> Tier:
        return DRAMTier(capacity, policy=self.policy)


class TestDRAMARC(TestDRAMS3FIFO):
    policy = "arc"


class TestLMDBS3FIFO(_FramedCapacity):
    policy = "s3fifo"

    async def make_tier(self, capacity: int | None) -> Tier:
        return LMDBTier(self.tmp_path / f"db{len(self._created)}",
                        capacity=capacity if capacity is not None else 64 << 20,
                        policy=self.policy)


class TestLMDBARC(TestLMDBS3FIFO):
    policy = "arc"


class TestFileS3FIFO(_FramedCapacity):
    policy = "s3fifo"

    async def make_tier(self, capacity: int | None) -> Tier:
        return FsspecTier(f"file://{self.tmp_path}/t{len(self._created)}", capacity=capacity,
                          policy=self.policy)


class TestFileARC(TestFileS3FIFO):
    policy = "arc"


class TestHBMS3FIFO(_PolicyConformance):
    policy = "s3fifo"

    async def make_tier(self, capacity: int | None) -> Tier:
        return HBMTier(capacity if capacity is not None else 64 * BLOCK_BYTES,
                       block_bytes=BLOCK_BYTES, backend="numpy", policy=self.policy)


class TestHBMARC(TestHBMS3FIFO):
    policy = "arc"


@pytest.mark.parametrize("url", [
    "dram://?capacity=1MiB&policy={p}",
    "lmdb://{tmp}/db?capacity=1MiB&policy={p}",
    "file://{tmp}/f?capacity=1MiB&policy={p}",
    "hbm://?capacity=4KiB&block_bytes=1KiB&backend=numpy&policy={p}",
])
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "ARC", ""])
async def test_policy_url_option(tmp_path: object, url: str, policy: str) -> None:
    tier = tier_from_url(url.format(p=policy, tmp=tmp_path))
    assert isinstance(tier, BudgetedTier)
    assert tier.stats()["policy"] == (policy.lower() or "lru")
    await tier.aclose()


@pytest.mark.parametrize("bad", ["mru", "lfu", "1", "lru,arc"])
def test_unknown_policy_refused_naming_the_option(bad: str) -> None:
    with pytest.raises(ConfigError, match="policy: expected one of lru, s3fifo, arc"):
        parse_policy(bad)
    with pytest.raises(ConfigError, match="policy"):
        tier_from_url(f"dram://?capacity=1MiB&policy={bad}")
