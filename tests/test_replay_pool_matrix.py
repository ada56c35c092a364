"""The issue-29 goal study: baselines at their best router and policy, pooled candidates
judged on hit rate, bytes moved and load under the timed model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.replay import pool_matrix
from kvtier.replay.trace import Request

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def _row(family: str, policy: str, hit: float, moved: float = 0.0, load: float = 1.0,
         mode: str = "per-node") -> dict[str, Any]:
    return {"family": family, "policy": policy, "prefix_hit_rate_blocks": hit / 100,
            "remote_bytes_per_request": moved, "load_imbalance": load, "mode": mode,
            "trace": "t.jsonl", "nodes": 4, "capacity_blocks": 100,
            "config": f"{family} [{policy}]", "ttft_p50_s": 0.1, "ttft_p90_s": 0.2}


def _cell(*rows: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in rows}


def test_goal_needs_hit_bytes_and_load() -> None:
    cell = _cell(_row("per-node session", "lru", 40.0), _row("per-node session", "arc", 44.0),
                 _row("per-node locate-live", "lru", 47.0), _row("ideal", "lru", 45.0),
                 _row("block pool", "arc", 43.0, moved=300.0, mode="pooled"),
                 _row("a", "lru", 46.6, moved=100.0, load=1.25, mode="local"),
                 _row("b", "lru", 46.4, moved=10.0, mode="local"),
                 _row("c", "lru", 48.0, moved=100.1, mode="local"),
                 _row("d", "lru", 50.0, moved=1.0, load=1.3, mode="local"))
    lines = {name: verdict for name, _, verdict in pool_matrix.cell_rows(cell)}
    # The best per-node row first (any router, any policy), the block pool and ideal; then
    # each other router once, at its best policy.
    assert list(lines)[:4] == ["per-node locate-live (lru)", "block pool (arc)",
                               "ideal (lru)", "per-node session (arc)"]
    assert lines["a (lru)"] == "yes"  # 47 - 0.5, a third of the pool's bytes, 1.25x
    assert lines["b (lru)"] == "no (hit)"
    assert lines["c (lru)"] == "no (moved)"
    assert lines["d (lru)"] == "no (load)"


def _trace(path: Path) -> Path:
    # Eight sessions of growing prompts after a shared block 0, interleaved, 1 s apart.
    rows = [Request(1000.0 * (8 * turn + s), (turn + 2) * 512, 1,
                    [0, *range(100 * s, 100 * s + turn + 1)], session=f"s{s}")
            for turn in range(8) for s in range(1, 9)]
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))
    return path


def test_cli_writes_rows_and_prints_the_goal_table(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "tiny.jsonl")
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.replay.pool_matrix", "--nodes", "2",
                           "--capacity-blocks", "20,200", "--out", str(out), str(trace)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(pool_matrix.configs())
    assert "| 2 | 200 | per-node locate-live (" in proc.stdout
    assert "| 2 | 200 | local pool locate-live (lru) |" in proc.stdout
    assert "| pooled candidate | cells meeting the goal |" in proc.stdout
    by = {(r["capacity_blocks"], r["config"]): r for r in rows}
    # With room for everything the local pool hits what ideal LRU hits, and keeps its
    # reads far below the block pool's (each session's blocks stay where it runs).
    local = by[(200, "local pool locate-live [lru]")]
    assert local["prefix_hit_rate_blocks"] == by[(200, "ideal [lru]")]["prefix_hit_rate_blocks"]
    assert local["remote_bytes_per_request"] < by[(200, "block pool [arc]")][
        "remote_bytes_per_request"] / 3
    assert all(r["load_model"] == "inflight" and r["ttft_p90_s"] >= r["ttft_p50_s"] > 0
               for r in rows)
    again = subprocess.run([sys.executable, "-m", "kvtier.replay.pool_matrix", "--table",
                            str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == proc.stdout


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces absent")
def test_runs_on_the_first_requests_of_a_shared_trace() -> None:
    rows = pool_matrix.run_pass(str(TRACES / "mooncake_synthetic_trace.jsonl"), 4, [1000],
                                pool_matrix.configs(("lru",)), limit=200)
    assert len({r["block_refs"] for r in rows}) == 1 and {r["limit"] for r in rows} == {200}
    table = pool_matrix.markdown(rows)
    assert "### `mooncake_synthetic_trace.jsonl`" in table and "(first 200 requests" in table


def test_only_runs_the_named_rows_and_judges_nothing_without_baselines(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "tiny.jsonl")
    proc = subprocess.run([sys.executable, "-m", "kvtier.replay.pool_matrix", "--nodes", "2",
                           "--capacity-blocks", "20", "--only", "local pool locate-live",
                           str(trace)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 | 20 |")]
    assert len(lines) == 1 and "local pool locate-live (lru)" in lines[0]
    assert lines[0].endswith("| ? |")
    bad = subprocess.run([sys.executable, "-m", "kvtier.replay.pool_matrix", "--only", "nope",
                          str(trace)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--only" in bad.stderr
