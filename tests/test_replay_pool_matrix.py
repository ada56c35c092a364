"""The issue-23 matrix: baselines at their best policy, pooled candidates judged on hit rate,
bytes moved and load."""

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
            "config": f"{family} [{policy}]"}


def _cell(*rows: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in rows}


def test_goal_needs_hit_bytes_and_load() -> None:
    cell = _cell(_row("per-node session", "lru", 40.0), _row("per-node session", "arc", 44.0),
                 _row("per-node locate-b", "lru", 47.0), _row("ideal", "lru", 45.0),
                 _row("pooled rr", "arc", 43.0, moved=200.0, mode="pooled"),
                 _row("a", "arc", 46.6, moved=100.0, load=1.25, mode="pooled"),
                 _row("b", "arc", 46.4, moved=10.0, mode="pooled"),
                 _row("c", "arc", 48.0, moved=100.1, mode="pooled"),
                 _row("d", "arc", 50.0, moved=1.0, load=1.3, mode="pooled"))
    lines = {name: verdict for name, _, verdict in pool_matrix.cell_rows(cell)}
    # The per-node families appear once, at their best policy.
    assert list(lines)[:4] == ["per-node session (arc)", "per-node locate-b (lru)",
                               "ideal (lru)", "pooled rr (arc)"]
    assert lines["a (arc)"] == "yes"  # 47 - 0.5, half of rr's bytes, 1.25x: all at the limit
    assert lines["b (arc)"] == "no (hit)"
    assert lines["c (arc)"] == "no (moved)"
    assert lines["d (arc)"] == "no (load)"


def _trace(path: Path) -> Path:
    # Eight sessions of growing prompts after a shared block 0, interleaved.
    rows = [Request(0.0, (turn + 2) * 512, 1, [0, *range(100 * s, 100 * s + turn + 1)],
                    session=f"s{s}") for turn in range(8) for s in range(1, 9)]
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
    assert "| 2 | 200 | per-node locate-b (" in proc.stdout
    assert "anchor:1 owner spill 0.1 (arc)" in proc.stdout
    assert "| pooled candidate | cells meeting the goal |" in proc.stdout
    by = {(r["capacity_blocks"], r["config"]): r for r in rows}
    # With room for everything the anchored pool misses only block 0 once more (it is
    # stored once per anchor shard), and owner routing keeps its hits local.
    anchored = by[(200, "anchor:1 owner [arc]")]
    assert anchored["prefix_hit_rate_blocks"] == by[(200, "ideal [lru]")][
        "prefix_hit_rate_blocks"] - 1 / sum(r["block_refs"] for r in rows[:1])
    assert anchored["remote_read_bytes_per_request"] < by[(200, "pooled rr [arc]")][
        "remote_read_bytes_per_request"]
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
                           "--capacity-blocks", "20", "--only", "anchor:1 owner spill 0.1",
                           str(trace)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 | 20 |")]
    assert len(lines) == 1 and "anchor:1 owner spill 0.1 (arc)" in lines[0]
    assert lines[0].endswith("| ? |")
    bad = subprocess.run([sys.executable, "-m", "kvtier.replay.pool_matrix", "--only", "nope",
                          str(trace)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--only" in bad.stderr
