"""Bounded-load spill for anchored chains in the dry replay: a new chain whose ring owner has
taken more than ``1 + spill`` times the mean of written blocks goes to the next member."""

from __future__ import annotations

import pytest

from kvtier.replay.dry import block_key, run_dry
from kvtier.replay.routing import LocateSimulation
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import Request


def _row(ids: list[int]) -> Request:
    return Request(0.0, len(ids) * 512, 1, ids)


def _chain_owned_by(sim: Simulation, node: int, start: int) -> list[int]:
    """A two-block chain (shared block 0, then its own anchor) whose anchor's ring owner is
    ``node``."""
    for anchor in range(start, start + 10_000):
        if sim._member_index[sim.ring.primary(block_key(anchor))] == node:
            return [0, anchor]
    raise AssertionError("no anchor found")


def _sims(spill: float | None) -> LocateSimulation:
    return LocateSimulation("pooled", "owner", "lru", 2, [10_000], placement="anchor:1",
                            spill=spill)


@pytest.mark.parametrize("spill", [None, 0.1])
def test_a_new_chain_spills_past_an_overloaded_owner(spill: float | None) -> None:
    sim = _sims(spill)
    long_chain = [0, *range(1000, 1100)]
    run_dry([_row(long_chain)], [sim], block_bytes=1)
    busy = sim.owner(block_key(1000))
    assert sim.shard_writes[busy] == 101 and sim.shard_writes[1 - busy] == 0
    other = [*_chain_owned_by(sim, busy, 5000), 6000, 6001]
    run_dry([_row(other), _row(other)], [sim], block_bytes=1)
    placed = sim.owner(block_key(other[1]))
    if spill is None:
        # On the busy owner, which already holds block 0 (one more hit); the load bound
        # sends the requests elsewhere, so the hits are remote.
        assert placed == busy and sim.spilled == 0
        assert sim.hit_blocks == len(other) + 1 and sim.remote_hits > 0
    else:
        # Over the bound, so the chain goes to the other member and stays there: owner
        # routing sends both requests to it and the second hits its whole chain locally.
        assert placed == 1 - busy and sim.spilled == 1
        assert sim.node_requests[1 - busy] == 2
        assert sim.hit_blocks == len(other) and sim.remote_hits == 0


def test_spill_keeps_the_written_blocks_within_the_bound() -> None:
    # 200 chains on 4 members, every tenth one 300 blocks long, the others 5: where the ring
    # puts the long ones decides the shards' sizes, unless placement is load-bounded.
    requests = [_row([0, *range(1000 * c, 1000 * c + (300 if c % 10 == 0 else 5))])
                for c in range(1, 201)]
    plain = LocateSimulation("pooled", "owner", "lru", 4, [100_000], placement="anchor:1")
    spilled = LocateSimulation("pooled", "owner", "lru", 4, [100_000], placement="anchor:1",
                               spill=0.1)
    run_dry(requests, [plain, spilled], block_bytes=1)

    def imbalance(sim: Simulation) -> float:
        return max(sim.shard_writes) / (sum(sim.shard_writes) / 4)

    assert imbalance(plain) > 1.3
    # Within the bound, give or take the one long chain that can land after a check.
    assert imbalance(spilled) <= 1.1 + 301 / (sum(spilled.shard_writes) / 4)
    assert imbalance(spilled) < imbalance(plain) - 0.15
    assert spilled.spilled > 0 and spilled.result(1)["spilled_chains"] == spilled.spilled
    assert spilled.result(1)["shard_write_imbalance"] == pytest.approx(imbalance(spilled))
    assert max(spilled.hit_blocks, plain.hit_blocks) < 200  # only the shared block 0 hits


def test_spill_needs_a_pooled_chain_placement() -> None:
    with pytest.raises(ValueError, match="spill"):
        Simulation("pooled", "rr", "lru", 2, [10], spill=0.1)  # block placement
    with pytest.raises(ValueError, match="spill"):
        Simulation("per-node", "rr", "lru", 2, [10], placement="anchor:1", spill=0.1)
    with pytest.raises(ValueError, match="spill"):
        Simulation("pooled", "rr", "lru", 2, [10], placement="anchor:1", spill=-1.0)
