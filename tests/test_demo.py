"""``kvtier demo --quick``: a real 4-node pool on loopback, end to end, under 20 s."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_quick_prints_the_table() -> None:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "hit(blk)" in out and "p99 ms" in out
    rows = {}
    for label in ("per-node + shared file", "pooled (kvtier)"):
        line = next(ln for ln in out.splitlines() if ln.startswith(label))
        rows[label] = [float(x) for x in re.findall(r"(\d+\.\d+)%", line)[:2]]
        assert "dram" in line  # per-tier hit shares are listed
    # Pooling must win against per-node caches of the same total size (round-robin routing).
    assert rows["pooled (kvtier)"][0] > rows["per-node + shared file"][0]
    assert "pool-lmdb" in out and "file" in out
    assert elapsed < 90  # < 20 s on an idle 2-core box; slack for a loaded CI machine


def test_demo_rejects_bad_sizes() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick",
                           "--dram-blocks", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--dram-blocks" in proc.stderr
