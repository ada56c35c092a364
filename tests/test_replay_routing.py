"""Locate routing in the dry replay: longest local prefix wins, ties and bounds by load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.replay.dry import block_key, run_dry
from kvtier.replay.routing import LOAD_BOUND, LocateSimulation, routing_metrics
from kvtier.replay.trace import Request

REPO = Path(__file__).resolve().parents[1]


def _row(ids: list[int]) -> Request:
    return Request(0.0, len(ids) * 512, 1, ids)


def test_per_node_locate_follows_the_prefix_and_breaks_ties_by_load() -> None:
    sim = LocateSimulation("per-node", "locate", "lru", 3, [100])
    # Three unrelated prompts: nobody holds anything, so they spread by load (0, 1, 2).
    run_dry([_row([1, 2]), _row([10, 11]), _row([20, 21])], [sim], block_bytes=1)
    assert sim.node_requests == [1, 1, 1]
    # A continuation of the second prompt goes to the node holding it (node 1), hitting both.
    run_dry([_row([10, 11, 12])], [sim], block_bytes=1)
    assert sim.node_requests == [1, 2, 1]
    assert sim.hit_blocks == 2 and sim.local_blocks == 2
    assert sim.local_prefix([block_key(i) for i in (10, 11, 12, 13)]) == [0, 3, 0]


def test_shared_first_block_pulls_everything_unless_bounded() -> None:
    # Every prompt starts with the same system-prompt block 0, then its own blocks.
    requests = [_row([0, 1000 + i]) for i in range(400)]
    free = LocateSimulation("per-node", "locate", "lru", 4, [10_000])
    bounded = LocateSimulation("per-node", "locate-bounded", "lru", 4, [10_000])
    run_dry(requests, [free, bounded], block_bytes=1)
    assert routing_metrics(free, 1)["load_imbalance"] == pytest.approx(4.0, abs=0.05)
    assert routing_metrics(bounded, 1)["load_imbalance"] <= LOAD_BOUND + 0.01


def test_pooled_locate_with_chunks_reads_the_first_chunk_locally() -> None:
    # One long shared prefix re-read many times: with chunk placement its first 8 blocks
    # live on one owner, and locate routing sends the request there.
    prefix = list(range(8))
    requests = [_row([*prefix, 100 + i]) for i in range(200)]
    chunked = LocateSimulation("pooled", "locate", "lru", 4, [10_000], placement="chunk:8")
    run_dry(requests, [chunked], block_bytes=1)
    owner = chunked.owner(block_key(0))
    # The first request finds nothing anywhere (a tie, by load); every later one is local.
    assert chunked.node_requests[owner] >= 199
    assert chunked.remote_hits == 0 and chunked.hit_blocks == 199 * 8
    per_block = LocateSimulation("pooled", "locate", "lru", 4, [10_000])
    run_dry(requests, [per_block], block_bytes=1)
    assert per_block.hit_blocks == chunked.hit_blocks
    assert per_block.remote_hits > 0  # per-block placement scatters the prefix


def test_locate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        LocateSimulation("ideal", "locate", "lru", 2, [10])
    with pytest.raises(ValueError, match="routing"):
        LocateSimulation("pooled", "nearest", "lru", 2, [10])


def test_cli_prints_routing_columns_and_refuses_real(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "kvtier.cli", "replay", "builtin:agentic", "--limit", "60",
            "--no-progress"]
    proc = subprocess.run([*base, "--routing", "rr,locate-bounded,owner", "--mode",
                           "per-node,pooled", "--placement", "anchor:1:64"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "load max/mean" in proc.stdout and "locate-bounded" in proc.stdout
    assert "owner" in proc.stdout and "anchor:1:64" in proc.stdout
    proc = subprocess.run([*base, "--real", "--routing", "locate"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dry only" in proc.stderr


def test_real_engine_locate_routing_needs_nodes_to_route_between() -> None:
    from kvtier.errors import ConfigError
    from kvtier.replay.real import RealConfig

    with pytest.raises(ConfigError, match="locate"):
        RealConfig(mode="ideal", routing="locate")
    assert RealConfig(mode="pooled", routing="locate").routing == "locate"
    assert RealConfig(mode="per-node", routing="locate").routing == "locate"


def test_owner_routing_with_anchor_placement_makes_pooled_hits_local() -> None:
    # Conversations that share a system-prompt block 0 and grow turn by turn: anchored on
    # block 1, each conversation lives on one owner and owner routing sends it there.
    requests = [_row([0, *range(1000 * c, 1000 * c + turn + 1)])
                for turn in range(6) for c in range(1, 41)]
    owner = LocateSimulation("pooled", "owner", "lru", 4, [10_000], placement="anchor:1")
    rr = LocateSimulation("pooled", "locate-bounded", "lru", 4, [10_000])
    run_dry(requests, [owner, rr], block_bytes=1)
    # Block 0 is stored once per anchor owner: its first read on each of the 3 other
    # owners is a miss block placement does not pay.
    assert owner.hit_blocks == rr.hit_blocks - 3
    # Remote only where the load bound spilled a turn off its owner (10 vs 608 blocks).
    assert owner.remote_hits * 20 < rr.remote_hits
    assert routing_metrics(owner, 1)["load_imbalance"] <= LOAD_BOUND + 0.01
    keys = [block_key(i) for i in (0, 1000, 1001)]
    runs = owner.owned_prefix(keys)
    assert sorted(runs) == [0, 0, 0, 3] and runs.index(3) == owner.owner(block_key(1000))
