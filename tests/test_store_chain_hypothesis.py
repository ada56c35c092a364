"""Stateful test: a 3-tier DRAM chain with tiny budgets against a dict model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from kvtier.testing.chain import make_chain_machine
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.hypothesis_profiles import examples

pytestmark = pytest.mark.slow  # 50-step runs (400 under the thorough profile, 100 in ci)

KB = 1024


def dram_chain() -> list[Tier]:
    # 3 / 5 / 8 blocks of 1 KiB; blocks are 0.5-3.5 KiB, so nearly every put evicts somewhere,
    # and a 3.5 KiB block skips the top tier.
    return [DRAMTier(capacity=3 * KB, name="t0"), DRAMTier(capacity=5 * KB, name="t1"),
            DRAMTier(capacity=8 * KB, name="t2")]


TestDRAMChain = make_chain_machine(
    dram_chain, block_sizes=(512, 1024, 1536, 2048, 3584), settings=settings(
        max_examples=examples(400), stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])).TestCase
