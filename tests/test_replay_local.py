"""The local pool of the dry replay: blocks where they were computed, a holder directory,
last copies forwarded by global age, hot blocks moved or copied to their readers."""

from __future__ import annotations

import random

import pytest

from kvtier.replay.dry import block_key, run_dry
from kvtier.replay.local import LocalPool
from kvtier.replay.routing import LocateSimulation, routing_metrics
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import Request


def _keys(*ids: int) -> list[bytes]:
    return [block_key(i) for i in ids]


def _check(pool: LocalPool) -> None:
    """The directory lists exactly the nodes holding each block; no node is over budget."""
    listed = {(k, n) for k, nodes in pool.holders.items() for n in nodes}
    held = {(k, n) for n, blocks in enumerate(pool.held) for k in blocks}
    assert listed == held
    assert all(len(nodes) == len(set(nodes)) for nodes in pool.holders.values())
    assert all(len(blocks) <= pool.capacity for blocks in pool.held)


def test_blocks_stay_where_computed_and_are_read_from_any_holder() -> None:
    pool = LocalPool(2, 10, hot_reads=0)
    assert pool.serve(0, _keys(1, 2, 3)) == (0, 0)
    assert pool.holders[block_key(1)] == [0] and not pool.held[1]
    assert pool.serve(1, _keys(1, 2, 3, 4)) == (3, 3)  # prefix read from node 0
    assert pool.holders[block_key(4)] == [1]  # the new block is where it was computed
    assert pool.serve(0, _keys(1, 2, 3)) == (3, 0)
    assert pool.local_run(0, _keys(1, 2, 3, 4)) == 3 and pool.local_run(1, _keys(1)) == 0
    _check(pool)


def test_an_evicted_last_copy_goes_to_the_node_with_older_blocks() -> None:
    pool = LocalPool(2, 2, hot_reads=0)
    pool.serve(1, _keys(10, 11))  # node 1 full of old blocks
    pool.serve(0, _keys(1, 2))
    pool.serve(0, _keys(3))  # node 0 evicts its oldest: block 2 (the chain's tail)...
    assert pool.forwarded == 1 and pool.dropped_last == 1
    # ...which is younger than node 1's oldest (block 11), so it goes there; 11 is dropped.
    assert block_key(2) in pool.held[1] and block_key(11) not in pool.holders
    # A request on node 0 reads it back from node 1.
    assert pool.serve(0, _keys(1, 2)) == (2, 1)
    _check(pool)


def test_a_last_copy_older_than_everything_is_dropped() -> None:
    pool = LocalPool(2, 2, hot_reads=0)
    pool.serve(0, _keys(1, 2))
    pool.serve(1, _keys(10, 11))  # node 1's blocks are younger than node 0's
    pool.serve(0, _keys(3))
    assert pool.forwarded == 0 and pool.dropped_last == 1
    assert block_key(2) not in pool.holders
    _check(pool)


def test_a_node_with_room_takes_the_last_copy_and_the_margin_holds_back_swaps() -> None:
    pool = LocalPool(2, 2, hot_reads=0)
    pool.serve(0, _keys(1, 2, 3))
    assert pool.forwarded == 1 and block_key(3) in pool.held[1]
    # Block ages: 1 is the newest; with a margin, a victim only a little younger than the
    # other node's oldest stays dropped.
    strict = LocalPool(2, 2, hot_reads=0, forward_margin=10.0)
    strict.serve(1, _keys(10, 11))
    strict.serve(0, _keys(1, 2))
    strict.serve(0, _keys(3))
    assert strict.forwarded == 0 and strict.dropped_last == 1


def test_evicting_a_copy_that_has_another_drops_it_and_updates_the_directory() -> None:
    pool = LocalPool(3, 2, hot_reads=2, max_copies=2)
    pool.serve(0, _keys(1))
    assert pool.serve(1, _keys(1)) == (1, 1)
    assert pool.serve(2, _keys(1)) == (1, 1)  # hot, read by two nodes: copied to node 2
    assert pool.hot_copies == 1 and sorted(pool.holders[block_key(1)]) == [0, 2]
    pool.serve(2, _keys(5, 6))  # node 2 evicts its copy of block 1
    assert pool.dropped_copies == 1 and pool.holders[block_key(1)] == [0]
    _check(pool)


@pytest.mark.parametrize("max_copies", [1, 4])
def test_a_hot_block_one_node_reads_moves_to_it(max_copies: int) -> None:
    pool = LocalPool(2, 10, hot_reads=2, max_copies=max_copies)
    pool.serve(0, _keys(1, 2))
    pool.serve(1, _keys(1, 2))  # first remote read of each
    assert pool.hot_moves == 0
    assert pool.serve(1, _keys(1, 2)) == (2, 2)  # second: both move
    assert pool.hot_moves == 2 and pool.hot_copies == 0
    assert pool.holders[block_key(1)] == [1] and not pool.held[0]
    assert pool.serve(1, _keys(1, 2)) == (2, 0)
    _check(pool)


def test_random_traffic_keeps_the_directory_exact_and_loses_only_counted_blocks() -> None:
    rng = random.Random(7)
    pool = LocalPool(4, 30, hot_reads=2, max_copies=2, forward_margin=0.0)
    seen: set[bytes] = set()
    for _ in range(600):
        head = rng.randrange(20)
        keys = _keys(*(head * 100 + i for i in range(rng.randrange(1, 12))))
        pool.serve(rng.randrange(4), keys)
        seen.update(keys)
    _check(pool)
    # Every block seen is held somewhere or was dropped as a last copy, once per drop.
    assert len(seen) - len(pool.holders) <= pool.dropped_last
    assert pool.forwarded > 0 and pool.hot_copies > 0 and pool.hot_moves > 0
    assert max(len(nodes) for nodes in pool.holders.values()) <= 2


def test_simulation_local_mode_counts_reads_and_forwards_as_remote_bytes() -> None:
    reqs = [Request(0.0, 3 * 512, 1, [1, 2, 3]), Request(0.0, 3 * 512, 1, [1, 2, 3])]
    sim = Simulation("local", "rr", "lru", 2, [10])
    run_dry(reqs, [sim], block_bytes=100)
    row = sim.result(100)
    assert row["hit_blocks"] == 3 and row["bytes_remote_read"] == 300
    assert row["bytes_remote_written"] == 0 and row["remote_share"] == 1.0
    assert row["local_pool"]["remote_reads"] == 3
    with pytest.raises(ValueError, match="local"):
        Simulation("local", "rr", "arc", 2, [10])
    with pytest.raises(ValueError, match="local"):
        Simulation("local", "rr", "lru", 2, [10, 10])


def test_locate_on_the_local_pool_routes_to_the_holder() -> None:
    reqs = [Request(0.0, 4 * 512, 1, [0, 100 * c, 100 * c + 1, 100 * c + 2])
            for _ in range(3) for c in range(1, 9)]
    sim = LocateSimulation("local", "locate", "lru", 4, [100])
    run_dry(reqs, [sim], block_bytes=1)
    # After the first round every conversation goes where its blocks are: only block 0,
    # computed once, is read remotely (by the conversations routed elsewhere).
    assert sim.hit_blocks == 7 + 2 * 8 * 4
    assert routing_metrics(sim, 1)["remote_write_bytes_per_request"] == 0
    assert sim.remote_hits <= 8 + 2 * 8
