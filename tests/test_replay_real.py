"""``--real`` replay: real bytes through real tiers and real peer servers on loopback; plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.replay.real import RealConfig, replay_real
from kvtier.replay.report import make_report, write_plot
from kvtier.workload import WorkloadConfig, generate

REPO = Path(__file__).resolve().parents[1]


async def test_pool_beats_per_node_with_real_bytes(tmp_path: Path) -> None:
    reqs = list(generate(WorkloadConfig(sessions=10, concurrency=5)))
    rows = {}
    for mode in ("per-node", "pooled", "ideal"):
        cfg = RealConfig(mode=mode, nodes=3, block_bytes=4096, dram_blocks=12, lmdb_blocks=12,
                         time_limit=60)
        workdir = tmp_path / mode
        workdir.mkdir()
        rows[mode] = await replay_real(reqs, cfg, workdir=workdir)
    for row in rows.values():
        assert row["requests"] == len(reqs)  # every payload read back was verified
        assert row["p99_ms"] >= row["p50_ms"] > 0 and row["requests_per_s"] > 0
    assert rows["pooled"]["prefix_hit_rate_blocks"] > rows["per-node"]["prefix_hit_rate_blocks"]
    assert 0.3 < rows["pooled"]["remote_share"] < 1  # most owners are other nodes
    assert rows["per-node"]["remote_share"] is None
    assert "lmdb" in rows["per-node"]["tier_names"] and rows["per-node"]["demotions"] > 0
    assert rows["pooled"]["tier_names"][0].startswith("pool-")
    assert rows["pooled"]["bytes_moved"] > 0


def test_real_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="mode"):
        RealConfig(mode="global")
    with pytest.raises(ConfigError, match="routing"):
        RealConfig(mode="pooled", routing="prefix-affinity")
    with pytest.raises(ConfigError, match="dram_blocks"):
        RealConfig(mode="pooled", dram_blocks=0)


def test_cli_real_json(tmp_path: Path) -> None:
    out = tmp_path / "real.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "replay", "builtin:agentic", "--real", "--limit",
         "60", "--nodes", "2", "--capacity-blocks", "20", "--block-bytes", "2048",
         "--routing", "session", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["engine"] == "real" and doc["requests"] == 60
    assert [r["mode"] for r in doc["results"]] == ["pooled", "per-node", "ideal"]
    assert all(r["requests"] == 60 and "p99_ms" in r for r in doc["results"])
    assert "p50 ms" in proc.stdout


def _report() -> dict[str, object]:
    rows = [{"mode": m, "routing": "rr", "policy": "lru", "capacity_blocks": c,
             "prefix_hit_rate_blocks": h} for m, c, h in
            (("pooled", 10, 0.2), ("pooled", 100, 0.5), ("ideal", 10, 0.25), ("ideal", 100, 0.5))]
    return make_report("t.jsonl", 1, 1, 2, [10, 100], rows)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "hit.png"
    write_plot(_report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"kvtier\[plot\]"):
        write_plot(_report(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


async def test_per_node_locate_routes_to_the_node_holding_the_prefix(tmp_path: Path) -> None:
    reqs = list(generate(WorkloadConfig(sessions=10, concurrency=5)))
    rows = {}
    for routing in ("rr", "locate"):
        cfg = RealConfig(mode="per-node", routing=routing, nodes=3, block_bytes=4096,
                         dram_blocks=200, time_limit=60)
        workdir = tmp_path / routing
        workdir.mkdir()
        rows[routing] = await replay_real(reqs, cfg, workdir=workdir)
    assert rows["locate"]["requests"] == len(reqs)
    assert (rows["locate"]["prefix_hit_rate_blocks"]
            > rows["rr"]["prefix_hit_rate_blocks"] + 0.1)
    assert rows["locate"]["network_bytes"] == 0 and rows["locate"]["load_imbalance"] <= 1.3


def test_real_config_owner_needs_the_pool() -> None:
    with pytest.raises(ConfigError, match="owner"):
        RealConfig(mode="per-node", routing="owner")
    with pytest.raises(ConfigError, match="locate"):
        RealConfig(mode="ideal", routing="locate")
    assert RealConfig(mode="pooled", routing="owner").routing == "owner"


@pytest.mark.slow
def test_cli_real_runs_owner_and_locate_bounded_routing(tmp_path: Path) -> None:
    out = tmp_path / "real.json"
    base = [sys.executable, "-m", "kvtier.cli", "replay", "builtin:agentic", "--real",
            "--limit", "40", "--nodes", "2", "--capacity-blocks", "50", "--block-bytes", "2048"]
    proc = subprocess.run([*base, "--mode", "pooled", "--routing", "rr,owner,locate-bounded",
                           "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["routing"], r["placement"]) for r in rows] == [
        ("rr", "block"), ("owner", "block"), ("locate", "block")]
    assert all(r["requests"] == 40 for r in rows)
    # The local pool and locate-live are dry models: --real refuses them.
    for extra in (["--mode", "local"], ["--routing", "locate-live"]):
        proc = subprocess.run([*base, *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and "--dry only" in proc.stderr
