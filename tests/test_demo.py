"""``kvtier demo``: five rows at equal tiers and capacity, on a real 4-node pool on loopback."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.commands import demo

REPO = Path(__file__).resolve().parents[1]
LABELS = ("per-node rr", "per-node session", "per-node locate-b", "pooled rr")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rows_differ_only_in_what_each_row_is_about() -> None:
    for argv in ((), ("--quick",), ("--dram-blocks", "7", "--lmdb-blocks", "3")):
        rows = demo.row_configs(_args(*argv))
        assert [label for label, _ in rows] == list(LABELS)
        assert [(c.mode, c.routing, c.placement) for _, c in rows] == [
            ("per-node", "rr", "block"), ("per-node", "session", "block"),
            ("per-node", "locate", "block"), ("pooled", "rr", "block")]
        base = rows[0][1]
        assert not base.shared_file  # no row gets a tier the others lack
        for _, config in rows[1:]:
            assert dataclasses.replace(config, mode=base.mode, routing=base.routing,
                                       placement=base.placement) == base


@pytest.mark.slow
def test_demo_quick_prints_the_honest_table() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick",
                           "--no-progress"], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    hits, moved = {}, {}
    for label in LABELS:
        line = next(ln for ln in out.splitlines() if ln.startswith(label + " "))
        hits[label] = float(re.findall(r"(\d+\.\d+)%", line)[0])
        moved[label] = float(line.split()[-6])  # MB/req
    assert "legend:" in out and "10,000 tokens/s" in out and "Prefill compute is not" in out
    assert re.search(r"pooled vs per-node session affinity at equal capacity: [+-]\d+\.\d "
                     r"points, \d+\.\d\d MB moved per request", out)
    # Round-robin per-node caches split every session over 4 nodes: the pool must beat them,
    # and so must routing by where a prefix lives.
    assert hits["pooled rr"] > hits["per-node rr"]
    assert hits["per-node locate-b"] > hits["per-node rr"]
    # Per-node caches move nothing; the pool moves its remote hits and writes.
    assert moved["per-node locate-b"] == moved["per-node session"] == 0 < moved["pooled rr"]


def test_demo_rejects_bad_sizes() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick",
                           "--dram-blocks", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--dram-blocks" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick",
                           "--prefill-rate", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--prefill-rate" in proc.stderr
