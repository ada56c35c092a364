"""Owner-aware routing: ``pick_node`` (hand-computed) and ``store.route`` from a router process's
``BlockingStore`` against real `kvtier serve` processes on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvtier import BlockingStore, open_store
from kvtier.errors import ConfigError
from kvtier.peer.client import PeerClient
from kvtier.routing import owner_runs, pick_node
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import TOKEN, serve_processes


def test_longest_run_wins_ties_go_to_the_least_loaded() -> None:
    assert pick_node([0, 5, 3], [0, 0, 0]) == 1
    assert pick_node([2, 0, 2], [4, 1, 3], bound=None) == 2
    assert pick_node([0, 0, 0], [2, 1, 1]) == 1


def test_a_node_over_the_bound_is_skipped_unless_it_is_the_lightest() -> None:
    # mean with this request = (9 + 3 + 3 + 1) / 3 = 16/3 -> bound 6.67: 9 + 1 is over.
    assert pick_node([7, 1, 0], [9, 3, 3]) == 1
    assert pick_node([7, 1, 0], [9, 3, 3], bound=None) == 0
    assert pick_node([7, 1], [5, 5]) == 0  # equal loads: the lightest is always allowed


def test_owner_runs_stop_at_the_first_block_a_candidate_does_not_own() -> None:
    owners = [["a", "b"], ["a"], ["a", "c"], ["c"]]
    assert owner_runs(owners, ["a", "b", "c", "d"]) == [3, 1, 0, 0]


@pytest.mark.parametrize("runs, loads", [([], []), ([1], [1, 2])])
def test_bad_pick_node_input_is_a_value_error(runs: list[int], loads: list[float]) -> None:
    with pytest.raises(ValueError, match="runs"):
        pick_node(runs, loads)


async def test_route_needs_a_pool_and_candidates() -> None:
    async with open_store(["dram://"]) as store:
        with pytest.raises(ConfigError, match="peers://"):
            store.route([key_of(1)], ["h1:7070"])
    async with open_store([f"peers://127.0.0.1:9?token={TOKEN}"]) as pooled:
        with pytest.raises(ValueError, match="candidates"):
            pooled.route([key_of(1)], [])


def _chain(index: int, length: int = 6) -> list[bytes]:
    return [key_of(index * 100 + i) for i in range(length)]


async def _held_by(member: str, keys: list[bytes]) -> list[bool]:
    client = PeerClient(member, token=TOKEN, timeout=5.0)
    try:
        return await client.exists_many(keys)
    finally:
        await client.close()


def test_route_sends_a_prompt_to_the_owner_of_its_chain(tmp_path: Path) -> None:
    """A router process (BlockingStore over the pool, no segment of its own) routes each
    prompt to the member that holds its whole chain, with no request to the pool; under
    load it spills to the least loaded member instead."""
    with serve_processes(tmp_path, 3, ["--tier", "dram://"]) as procs:
        members = [p.member for p in procs]
        url = f"peers://{','.join(members)}?token={TOKEN}&timeout=5&placement=anchor:1"
        chains = [_chain(c) for c in range(12)]
        with BlockingStore([url]) as router:
            for chain in chains:
                router.put_many([(k, sample_block(i)) for i, k in enumerate(chain)])
            picks = [router.route(chain, members) for chain in chains]
            stats = router.stats()["tiers"][0]
            assert stats.get("get_requests", 0) == stats.get("exists_requests", 0) == 0
            assert len(set(picks)) > 1  # chains spread over the members
            for chain, pick in zip(chains, picks, strict=True):
                assert asyncio.run(_held_by(pick, chain)) == [True] * len(chain)
                others = [m for m in members if m != pick]
                assert not any(any(asyncio.run(_held_by(m, chain))) for m in others)
            busy = picks[0]
            load = {m: (10.0 if m == busy else 2.0) for m in members}
            spilled = router.route(chains[0], members, load)
            assert spilled != busy and load[spilled] == min(load.values())
            # Only some members are candidates (a router's healthy engines): the owner when
            # it is one, else the least loaded of them.
            rest = [m for m in members if m != busy]
            assert router.route(chains[0], rest, {rest[0]: 1.0}) == rest[1]
        # A fresh router that never saw the puts learns the chain from the prompt itself.
        with BlockingStore([url]) as fresh:
            assert [fresh.route(chain, members) for chain in chains] == picks
            got = fresh.get_many(chains[5])
            assert all(np.array_equal(b, sample_block(i)) for i, b in enumerate(got))
