"""Issue-15 matrix: candidate specs, the no-tail admission, the hybrid layout and the goal
column (hand-computed expectations on tiny traces)."""

from __future__ import annotations

import pytest

from kvtier.replay.dry import run_dry
from kvtier.replay.hybrid import HybridSimulation
from kvtier.replay.matrix import _NoTail, cell_table, parse_candidate
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import Request


def _row(ids: list[int], tokens: int | None = None) -> Request:
    return Request(0.0, len(ids) * 512 if tokens is None else tokens, 1, ids)


def test_parse_candidate() -> None:
    assert parse_candidate("arc+cascade+notail@hybrid:25:session") == {
        "policy": "arc", "cascade": True, "notail": True, "placement": "hybrid:25:session"}
    assert parse_candidate("lru")["placement"] == "block"
    with pytest.raises(ValueError, match="candidate"):
        parse_candidate("lru+spill")
    # Chain placements are retired: the pool places every block by its own key.
    for spec in ("lru@anchor:1", "lru@chunk:16", "lru@root:1"):
        with pytest.raises(ValueError, match="candidate"):
            parse_candidate(spec)


def test_notail_never_admits_a_partial_last_block_but_counts_it() -> None:
    sim = Simulation("pooled", "rr", "lru", 2, [10])
    wrapped = _NoTail(sim)
    reqs = [_row([1, 2, 3], tokens=2 * 512 + 100), _row([1, 2, 3], tokens=2 * 512 + 100),
            _row([1, 2, 4], tokens=3 * 512)]
    run_dry(reqs, [wrapped], block_bytes=1)
    row = wrapped.result(1)
    assert row["block_refs"] == 9
    # request 2 hits 1,2 (3 was never admitted); request 3 hits 1,2 and inserts its full 4
    assert row["hit_blocks"] == 4 and row["inserted_blocks"] == 3


def test_hybrid_private_tier_serves_what_the_pool_evicted() -> None:
    # One node, private 2 blocks (LRU) above a 1-block pool shard: a 2-block chain read twice
    # hits both blocks although the pool holds only one of them.
    sim = HybridSimulation("rr", "lru", 1, 2, 1)
    run_dry([_row([1, 2]), _row([1, 2])], [sim], block_bytes=1)
    row = sim.result(1)
    assert row["hit_blocks"] == 2 and row["tier_capacity_blocks"] == [2, 1]
    assert row["tier_hit_share"] == [1.0, 0.0]


def test_goal_column_uses_session_best_and_ideal_lru_minus_slack() -> None:
    def r(config: str, rate: float) -> dict[str, object]:
        return {"trace": "t", "nodes": 4, "capacity_blocks": 1000, "config": config,
                "prefix_hit_rate_blocks": rate}

    rows = [r("session lru", .20), r("session s3fifo", .30), r("session arc", .25),
            r("ideal lru", .28), r("ideal s3fifo", .31), r("ideal arc", .29),
            r("pooled x", .296), r("pooled y", .294)]
    table = cell_table(rows, "x")
    assert "| 30.00 (s3fifo) | 28.00 | 31.00 (s3fifo) | 29.60 (x) | 29.60 | 30.00 | -0.40 | yes |" \
        in table
    assert "| -0.60 | no |" in cell_table(rows, "y")


def test_notail_handles_a_request_of_one_partial_block() -> None:
    # notail feeds such a request with no keys at all
    sim = Simulation("pooled", "rr", "arc", 4, [10])
    wrapped = _NoTail(sim)
    run_dry([_row([7], tokens=100), _row([7, 8], tokens=600)], [wrapped], block_bytes=1)
    assert wrapped.result(1)["block_refs"] == 3
