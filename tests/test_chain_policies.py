"""The store's hypothesis chain machine with each eviction policy in every tier: a DRAM chain,
and DRAM -> LMDB -> file over the real persistent tiers (the lru runs are in
test_store_chain_hypothesis.py and test_chain_persist.py)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from kvtier.testing.chain import make_chain_machine
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.hypothesis_profiles import examples

pytestmark = pytest.mark.slow  # six hypothesis machines, tens of seconds together

KB = 1024
_HEADER = 43
_SETTINGS = settings(max_examples=examples(120), stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
_PERSIST_SETTINGS = settings(max_examples=examples(12), stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


def _dram_chain(policy: str) -> list[Tier]:
    return [DRAMTier(capacity=3 * KB, policy=policy, name="t0"),
            DRAMTier(capacity=5 * KB, policy=policy, name="t1"),
            DRAMTier(capacity=8 * KB, policy=policy, name="t2")]


_dirs: list[str] = []


def _persistent_chain(policy: str) -> list[Tier]:
    tmp = tempfile.mkdtemp(prefix="kvtier-chain-policy-")
    _dirs.append(tmp)
    return [DRAMTier(capacity=3 * KB, policy=policy, name="dram"),
            LMDBTier(f"{tmp}/lmdb", capacity=5 * (KB + _HEADER), policy=policy, name="lmdb"),
            FsspecTier(f"file://{tmp}/files", capacity=8 * (KB + _HEADER), policy=policy,
                       name="file")]


def _cleanup() -> None:
    while _dirs:
        shutil.rmtree(_dirs.pop(), ignore_errors=True)


_SIZES = (512, 1024, 1536, 2048, 3584)


TestS3FIFODRAMChain = make_chain_machine(lambda: _dram_chain("s3fifo"), block_sizes=_SIZES,
                                         settings=_SETTINGS).TestCase
TestARCDRAMChain = make_chain_machine(lambda: _dram_chain("arc"), block_sizes=_SIZES,
                                      settings=_SETTINGS).TestCase
TestS3FIFOPersistentChain = make_chain_machine(lambda: _persistent_chain("s3fifo"),
                                               cleanup=_cleanup,
                                               settings=_PERSIST_SETTINGS).TestCase
TestARCPersistentChain = make_chain_machine(lambda: _persistent_chain("arc"), cleanup=_cleanup,
                                            settings=_PERSIST_SETTINGS).TestCase
