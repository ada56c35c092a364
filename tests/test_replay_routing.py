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


def test_pooled_locate_finds_the_first_blocks_owner_run() -> None:
    # One long shared prefix re-read many times: per-block placement scatters it, so the
    # local run of the first block's owner ends where the next block lives elsewhere.
    prefix = list(range(8))
    requests = [_row([*prefix, 100 + i]) for i in range(200)]
    per_block = LocateSimulation("pooled", "locate", "lru", 4, [10_000])
    run_dry(requests, [per_block], block_bytes=1)
    keys = [block_key(i) for i in prefix]
    runs = per_block.local_prefix(keys)
    first = per_block.owner(keys[0])
    expected = next((i for i, k in enumerate(keys) if per_block.owner(k) != first), 8)
    assert runs[first] == expected and sum(runs) == expected
    assert per_block.hit_blocks == 199 * 8 and per_block.remote_hits > 0


def test_locate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        LocateSimulation("ideal", "locate", "lru", 2, [10])
    with pytest.raises(ValueError, match="routing"):
        LocateSimulation("pooled", "nearest", "lru", 2, [10])


def test_cli_prints_routing_columns_and_refuses_real(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "kvtier.cli", "replay", "builtin:agentic", "--limit", "60",
            "--no-progress"]
    proc = subprocess.run([*base, "--routing", "rr,locate-bounded,locate-live,owner", "--mode",
                           "per-node,pooled,local"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "load max/mean" in proc.stdout and "locate-bounded" in proc.stdout
    assert "owner" in proc.stdout and "locate-live" in proc.stdout
    assert "local     owner" in proc.stdout
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


def test_owner_routing_on_the_local_pool_follows_the_holders() -> None:
    # Conversations that share a system-prompt block 0 and grow turn by turn: on the local
    # pool a conversation's blocks stay on the node that computed them, and owner routing
    # (the holder directory's longest run) sends each later turn there.
    requests = [_row([0, *range(1000 * c, 1000 * c + turn + 1)])
                for turn in range(6) for c in range(1, 41)]
    owner = LocateSimulation("local", "owner", "lru", 4, [10_000])
    fixed = LocateSimulation("local", "owner", "lru", 4, [10_000], hot_reads=0)
    pooled = LocateSimulation("pooled", "locate-bounded", "lru", 4, [10_000])
    run_dry(requests, [owner, fixed, pooled], block_bytes=1)
    # Room for everything: every block but the first sight of each is a hit in all three.
    assert owner.hit_blocks == fixed.hit_blocks == pooled.hit_blocks
    # With blocks fixed where computed, block 0 lives on one node: its run pulls every
    # request there and the load bound sends most elsewhere, to read remotely. Hot blocks
    # fix that: block 0, read by every node, is copied; a conversation whose turns run
    # elsewhere takes its blocks along.
    assert owner.local is not None and owner.local.hot_copies > 0
    assert owner.local.hot_moves > 0
    assert owner.remote_hits * 3 < pooled.remote_hits < fixed.remote_hits
    assert routing_metrics(owner, 1)["load_imbalance"] <= LOAD_BOUND + 0.01
    assert routing_metrics(owner, 1)["remote_write_bytes_per_request"] == 0  # nothing forwarded
