"""Dry replay: trace reading, the README's reference hit rates, modes, routing, the CLI."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.replay.dry import run_dry
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import Request, iter_trace

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def _row(ids: list[int], session: str | None = None) -> Request:
    return Request(0.0, len(ids) * 512, 1, ids, session)


def _write(path: Path, rows: list[Request]) -> Path:
    text = "".join(json.dumps(r.to_json()) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_reads_plain_and_gzip_identically(tmp_path: Path) -> None:
    rows = [_row([1, 2, 3], "a"), _row([1, 2, 4]), _row([9])]
    plain = list(iter_trace(_write(tmp_path / "t.jsonl", rows)))
    zipped = list(iter_trace(_write(tmp_path / "t.jsonl.gz", rows)))
    assert plain == zipped == rows
    assert list(iter_trace(tmp_path / "t.jsonl", limit=2)) == rows[:2]


def test_malformed_row_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        list(iter_trace(path))
    with pytest.raises(ConfigError, match="cannot open"):
        list(iter_trace(tmp_path / "missing.jsonl"))


def test_lru_convention_evicts_chain_tails_first() -> None:
    sim = Simulation("ideal", "none", "lru", 1, [3])
    requests = [_row([1, 2, 3]), _row([4]), _row([1, 2, 3])]
    out = run_dry(requests, [sim], block_bytes=1)
    # Inserting 4 evicts block 3 (the oldest: tail refreshed first), so the third request
    # hits blocks 1 and 2 only.
    assert out["results"][0]["hit_blocks"] == 2
    assert out["block_refs"] == 7


def test_pooled_equals_per_node_with_one_node_and_remote_share() -> None:
    reqs = [_row([1, 2, 3]), _row([1, 2, 5]), _row([1, 7]), _row([1, 2, 3])] * 3
    one = [Simulation(m, "rr", "lru", 1, [4]) for m in ("per-node", "pooled", "ideal")]
    rates = [r["prefix_hit_rate_blocks"] for r in run_dry(reqs, one, block_bytes=1)["results"]]
    assert rates[0] == rates[1] == rates[2] > 0
    four = Simulation("pooled", "rr", "lru", 4, [4])
    row = run_dry(reqs, [four], block_bytes=10)["results"][0]
    assert 0 < row["remote_share"] < 1
    assert row["bytes_moved"] > 0 and row["bytes_moved"] % 10 == 0


def test_session_routing_beats_round_robin_for_sessions() -> None:
    reqs = []
    for turn in range(6):
        for s in range(3):  # 3 sessions on 4 nodes: round-robin scatters them
            reqs.append(_row([100 * s + i for i in range(turn + 2)], session=f"s{s}"))
    sims = [Simulation("per-node", r, "lru", 4, [20]) for r in ("rr", "session")]
    rr, sess = (r["prefix_hit_rate_blocks"] for r in run_dry(reqs, sims, block_bytes=1)
                ["results"])
    assert sess > rr


def test_two_tier_chain_demotes_and_hits_lower_tier() -> None:
    sim = Simulation("per-node", "rr", "lru", 1, [2, 10])
    row = run_dry([_row([1, 2, 3, 4]), _row([1, 2, 3, 4])], [sim], block_bytes=1)["results"][0]
    assert row["hit_blocks"] == 4
    assert row["demotions"] >= 2 and row["tier_hit_share"][1] > 0


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match="mode"):
        Simulation("global", "rr", "lru", 1, [1])
    with pytest.raises(ValueError, match="policy"):
        Simulation("ideal", "none", "fifo", 1, [1])
    with pytest.raises(ValueError, match="capacity"):
        Simulation("ideal", "none", "lru", 1, [0])


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces absent")
@pytest.mark.parametrize(("name", "expected"), [
    ("mooncake_conversation_trace.jsonl", (4.5, 21.2, 36.4)),
    ("mooncake_synthetic_trace.jsonl", (8.4, 42.4, 64.0)),
])
def test_reference_hit_rates(name: str, expected: tuple[float, float, float]) -> None:
    sims = [Simulation("ideal", "none", "lru", 1, [c]) for c in (1000, 10000, 100000)]
    out = run_dry(iter_trace(TRACES / name), sims, block_bytes=1)
    got = [r["prefix_hit_rate_blocks"] * 100 for r in out["results"]]
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 0.1 + 0.05, (name, got)  # README rounds to 0.1 points


def test_cli_json_schema(tmp_path: Path) -> None:
    reqs = [_row([1, 2, 3], "a"), _row([1, 2, 4], "b"), _row([1, 2, 3], "a")] * 5
    trace = _write(tmp_path / "t.jsonl.gz", reqs)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "replay", str(trace), "--nodes", "2",
         "--capacity-blocks", "2,8", "--routing", "rr,session", "--policy", "lru,s3fifo",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pooled" in proc.stdout and "hit(blk)" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["requests"] == 15 and doc["block_refs"] == 45 and doc["nodes"] == 2
    assert doc["capacity_blocks"] == 2
    # per-node and pooled: 2 routings x 2 policies; ideal: 2 policies; x 2 capacities
    assert len(doc["results"]) == (4 + 4 + 2) * 2
    for row in doc["results"]:
        assert row["mode"] in ("per-node", "pooled", "ideal")
        assert 0 <= row["prefix_hit_rate_blocks"] <= 1
        assert 0 <= row["prefix_hit_rate_tokens"] <= 1
        assert (row["remote_share"] is None) == (row["mode"] != "pooled")


@pytest.mark.slow
def test_cli_bad_arguments(tmp_path: Path) -> None:
    trace = _write(tmp_path / "t.jsonl", [_row([1])])
    for extra, needle in ((["--routing", "sticky"], "--routing"), (["--nodes", "0"], "--nodes"),
                          (["--capacity-blocks", "x"], "--capacity-blocks")):
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "replay", str(trace), *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
def test_cascade_leaves_no_orphans_in_the_pool(policy: str) -> None:
    from kvtier.workload import WorkloadConfig, generate

    reqs = list(generate(WorkloadConfig(sessions=12, concurrency=4)))
    plain = Simulation("pooled", "rr", policy, 4, [15])
    cascade = Simulation("pooled", "rr", policy, 4, [15], cascade=True)
    out = run_dry(reqs, [plain, cascade], block_bytes=1)["results"]
    parent: dict[int, int] = {}
    for r in reqs:
        parent.update(zip(r.hash_ids[1:], r.hash_ids[:-1], strict=True))

    def orphans(sim: Simulation) -> int:
        present = {k for chain in sim.chains for k in chain.tiers[0].lru_order()}  # type: ignore[attr-defined]
        ids = {int.from_bytes(k, "little", signed=True) for k in present}
        return sum(1 for b in ids if b in parent and parent[b] not in ids)

    assert orphans(plain) > 0  # sharded eviction strands chain tails...
    assert orphans(cascade) == 0  # ...which cascade drops
    assert out[1]["orphans_dropped"] > 0
