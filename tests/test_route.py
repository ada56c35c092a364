"""Owner-aware routing: ``pick_node`` and ``owner_runs`` (hand-computed) and ``store.route``'s
argument checks (routing by holders under ``placement=local`` against real `kvtier serve`
processes: tests/test_peer_local.py)."""

from __future__ import annotations

import pytest

from kvtier import open_store
from kvtier.errors import ConfigError
from kvtier.routing import owner_runs, pick_node
from kvtier.testing.conformance import key_of
from tests.helpers.peer_helpers import TOKEN


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

