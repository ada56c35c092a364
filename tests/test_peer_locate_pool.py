"""store.locate_prefix against real `kvtier serve` processes: per node and pool-wide counts,
and a hung or killed member left out within the deadline."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.peer.locate import LocalPrefix, PrefixLocation, locate_prefix
from kvtier.peer.tier import PeerTier
from kvtier.store import open_store
from tests.helpers.load import LoopLag
from tests.helpers.peer_helpers import TOKEN, ServeProcess, serve_processes

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

BLOCK = np.arange(2048, dtype=np.uint16)
K = [bytes([i]) * 16 for i in range(1, 13)]
SLACK = 3.0  # scheduling slack on a loaded 2-core machine; the deadline itself is exact


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    with serve_processes(tmp_path, 3, ["--tier", "dram://?capacity=64MiB"]) as procs:
        yield procs


def _url(members: list[str]) -> str:
    return f"peers://{','.join(members)}?token={TOKEN}&timeout=0.5&replicas=1"


def _owner_runs(tier: PeerTier, keys: list[bytes]) -> dict[str, int]:
    """Per member, the leading keys it owns (where the pool put them)."""
    runs = {}
    for member in tier.members.members:
        owned = [tier.members.order(k)[0] == member for k in keys]
        runs[member] = next((i for i, own in enumerate(owned) if not own), len(keys))
    return runs


async def test_prefix_put_through_the_pool_is_located_per_node(
        three: list[ServeProcess]) -> None:
    members = [p.member for p in three]
    async with open_store(["dram://", _url(members)], node="client") as store, \
            open_store([_url(members)], node="router") as router:
        await store.put_many([(k, BLOCK) for k in K[:8]])
        tier = store.tiers[1]
        assert isinstance(tier, PeerTier)
        runs = _owner_runs(tier, K[:8])

        found = await store.locate_prefix(K[:8], timeout=5)
        assert isinstance(found, PrefixLocation) and found.node == "client"
        assert found.pool == 8
        assert found.nodes["client"] == LocalPrefix(8, "dram", {"dram": 8})
        for member in members:
            blocks = runs[member]
            assert found.nodes[member] == (
                LocalPrefix(blocks, "dram", {"dram": blocks}) if blocks else LocalPrefix(0))
        assert found.best() == "client"

        # A process without private tiers holds nothing locally, but reads all 8 pool-wide.
        seen = await router.locate_prefix(K[:8], timeout=5)
        assert seen.nodes["router"] == LocalPrefix(0) and seen.pool == 8
        assert {m: seen.nodes[m] for m in members} == {m: found.nodes[m] for m in members}

        # A prefix one member holds in full (written to it alone) is a long local run there.
        async with PeerTier([members[0]], token=TOKEN) as only_first:
            await only_first.put_many([(k, BLOCK) for k in K[8:12]])
        there = await router.locate_prefix(K[8:12], timeout=5)
        assert there.nodes[members[0]].blocks == 4 and there.best() == members[0]
        assert all(there.nodes[m].blocks == 0 for m in members[1:])

        # Nothing changed recency or contents; a wrong token is refused (left out).
        assert await locate_prefix(members, K[:8], token="wrong", deadline=5) == {}


async def test_a_hung_and_a_killed_member_are_left_out_within_the_deadline(
        three: list[ServeProcess]) -> None:
    members = [p.member for p in three]
    async with open_store(["dram://", _url(members)], node="client") as store:
        await store.put_many([(k, BLOCK) for k in K[:8]])
        hung, killed = three[1], three[2]
        hung.signal(signal.SIGSTOP)
        killed.signal(signal.SIGKILL)
        try:
            deadline = 1.0
            with LoopLag().measure() as lag:  # a late timer under load is not locate's doing
                t0 = time.monotonic()
                found = await store.locate_prefix(K[:8], timeout=deadline)
                elapsed = time.monotonic() - t0
            assert elapsed < deadline + SLACK + 2 * lag.worst
            assert set(found.nodes) == {"client", members[0]}
            assert found.nodes["client"].blocks == 8
        finally:
            hung.signal(signal.SIGCONT)


async def test_locate_prefix_validates_its_arguments_and_answers_without_a_pool() -> None:
    async with open_store(["dram://"], node="solo") as store:
        await store.put_many([(k, BLOCK) for k in K[:3]])
        with pytest.raises(TypeError, match="keys"):
            await store.locate_prefix(b"k" * 16)
        with pytest.raises(ValueError, match="timeout"):
            await store.locate_prefix(K[:2], timeout=0)
        found = await store.locate_prefix([*K[:2], K[5], K[2]])
        assert found.nodes == {"solo": LocalPrefix(2, "dram", {"dram": 2})} and found.pool == 2
        empty = await store.locate_prefix([])
        assert empty.pool == 0 and empty.best() is None
