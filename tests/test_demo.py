"""``kvtier demo``: six rows at equal memory under the timed load model."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.commands import demo
from kvtier.replay.trace import Request

REPO = Path(__file__).resolve().parents[1]
LABELS = ("per-node rr", "per-node session", "per-node locate-live", "block pool",
          "local pool", "ideal global LRU")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rows_share_memory_and_cost_model_and_differ_in_layout_and_routing() -> None:
    assert [label for label, *_ in demo.ROWS] == list(LABELS)
    # Two conversations, each re-sent with one more block: every row sees the same stream.
    reqs = [Request(t * 1000.0, (turn + 2) * 512, 10, [0, *range(100 * c, 100 * c + turn + 1)],
                    session=f"s{c}") for t, (turn, c) in enumerate(
                        (turn, c) for turn in range(4) for c in (1, 2))]
    rows = dict(demo.replay_rows(reqs, _args("--capacity-blocks", "50", "--nodes", "2")))
    assert {r["capacity_blocks"] for r in rows.values()} == {50}
    assert {r["block_refs"] for r in rows.values()} == {sum(len(r.hash_ids) for r in reqs)}
    assert len({str(r["cost_model"]) for r in rows.values()}) == 1
    assert rows["per-node session"]["remote_bytes_per_request"] == 0
    # Room for everything: the pools and the ideal LRU hit every block seen before.
    ideal = rows["ideal global LRU"]["hit_blocks"]
    assert rows["block pool"]["hit_blocks"] == rows["local pool"]["hit_blocks"] == ideal
    # The block pool reads blocks from their ring owners; the local pool from where they
    # were computed, which locate-live routing mostly is.
    assert (rows["local pool"]["remote_bytes_per_request"]
            < rows["block pool"]["remote_bytes_per_request"])
    for row in rows.values():
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"]


def test_demo_quick_prints_the_table_and_the_legend() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    hits, moved = {}, {}
    for label in LABELS:
        line = next(ln for ln in out.splitlines() if ln.startswith(label + " "))
        hits[label] = float(re.findall(r"(\d+\.\d+)%", line)[0])
        moved[label] = float(line.split()[-4])
    for name in ("rr", "session", "locate-bounded", "locate-live", "owner"):
        assert re.search(rf"^  {name} +\S", out, re.M), name  # the legend says what it means
    assert "Modelled, not measured" in out and "TTFT" in out
    assert re.search(r"local pool vs block pool: [+-]\d+\.\d points, moving \d+% of its "
                     r"bytes per request", out)
    assert "python -m kvtier.replay.pool_matrix" in out
    # Round-robin per-node caches split every session over 4 nodes: every pool beats them.
    assert hits["block pool"] > hits["per-node rr"] and hits["local pool"] > hits["per-node rr"]
    assert hits["ideal global LRU"] >= max(hits.values()) - 0.05
    assert moved["per-node session"] == moved["per-node locate-live"] == 0
    assert 0 < moved["local pool"] < moved["block pool"]


@pytest.mark.slow
def test_demo_rejects_bad_sizes() -> None:
    for flag in ("--capacity-blocks", "--nodes", "--kv-bytes-per-token"):
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick", flag,
                               "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and flag in proc.stderr
