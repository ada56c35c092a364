"""DRAM tier: the conformance suite plus what is specific to host memory."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.registry import tier_from_url


class TestDRAMConformance(TierConformance):
    async def make_tier(self, capacity: int | None) -> Tier:
        return DRAMTier(capacity=capacity)


async def test_get_is_zero_copy_and_read_only() -> None:
    tier = DRAMTier(capacity=1 << 20)
    await tier.put(key_of(1), sample_block(1))
    first, second = await tier.get(key_of(1)), await tier.get(key_of(1))
    assert first is not None and second is not None
    assert np.shares_memory(first, second)
    assert not first.flags.writeable
    with pytest.raises(ValueError):
        first[0] = 1


def test_from_url_parses_capacity() -> None:
    tier = tier_from_url("dram://?capacity=8GiB")
    assert isinstance(tier, DRAMTier) and tier.capacity == 8 << 30
    assert tier_from_url("dram://").capacity is None


@pytest.mark.parametrize("url", [
    "dram://?capacity=8QB", "dram://?capacity=-1", "dram://?capacity=abc",
    "dram://?capacity=1.5.2GiB", "dram://?capcity=1GiB", "dram://host/path",
])
def test_bad_urls_rejected(url: str) -> None:
    with pytest.raises(ConfigError):
        tier_from_url(url)
