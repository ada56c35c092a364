"""Issue-15 matrix: candidate specs, chain placements, the no-tail admission, the hybrid layout
and the goal column (hand-computed expectations on tiny traces)."""

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
    assert parse_candidate("arc+cascade+notail@anchor:1") == {
        "policy": "arc", "cascade": True, "notail": True, "placement": "anchor:1"}
    assert parse_candidate("lru")["placement"] == "block"
    with pytest.raises(ValueError, match="candidate"):
        parse_candidate("lru+spill")


@pytest.mark.parametrize(("placement", "shards"), [("anchor:1", 1), ("root:1", 2)])
def test_chain_placements_keep_a_chain_on_few_shards(placement: str, shards: int) -> None:
    sim = Simulation("pooled", "rr", "lru", 4, [100], placement=placement)
    run_dry([_row(list(range(1, 41)))], [sim], block_bytes=1)
    used = [len(chain.tiers[0]) for chain in sim.chains]  # type: ignore[arg-type]
    # anchor:1: all 40 blocks with block 1's owner; root:1: block 0 may sit elsewhere.
    assert sum(used) == 40
    assert sum(1 for u in used if u) <= shards
    assert max(used) >= 39


def test_anchor_copies_a_shared_head_per_chain() -> None:
    sim = Simulation("pooled", "rr", "lru", 8, [100], placement="anchor:1")
    # Two conversations share block 0 (a system prompt); each chain lives on its own anchor.
    reqs = [_row([0, 10, 11]), _row([0, 20, 21]), _row([0, 10, 11, 12]), _row([0, 20, 21, 22])]
    run_dry(reqs, [sim], block_bytes=1)
    owners = {sim.owner(k) for k in (b"\x0a" + bytes(7), b"\x14" + bytes(7))}
    holders = sum(1 for chain in sim.chains if (0).to_bytes(8, "little") in chain.tiers[0])
    assert holders == len(owners)  # block 0 stored once per anchor shard
    assert sim.hit_blocks == 3 + 3  # the second turns hit their whole first turn


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


def test_anchor_and_notail_handle_a_request_of_one_partial_block() -> None:
    # notail feeds such a request with no keys at all; anchor placement must not index it
    sim = Simulation("pooled", "rr", "arc", 4, [10], placement="anchor:1")
    wrapped = _NoTail(sim)
    run_dry([_row([7], tokens=100), _row([7, 8], tokens=600)], [wrapped], block_bytes=1)
    assert wrapped.result(1)["block_refs"] == 3
