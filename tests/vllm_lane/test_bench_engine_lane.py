"""The real-vLLM lane runs ``benchmarks/bench_engine.py`` on its smallest setting.

One configuration (``KVTierConnector`` over ``dram + file://``), one repeat, a 256-token
prompt: a writer process prefills it, a new reader process asks for it, asks again, and asks for
a prompt nothing stored. The JSON rows must show the reader loading the prompt's full blocks
from the tier, with the writer's tokens, and the miss computing everything. No timing is
asserted (the lane runs on shared machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("KVTIER_VLLM_LANE") == "1":
    import vllm  # noqa: F401  (the lane itself: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="the real-vLLM lane needs vLLM (tox -e vllm)")

pytestmark = pytest.mark.timeout(1800)  # two vLLM starts, 20-90 s each on a loaded machine

ROOT = Path(__file__).resolve().parents[2]
PROMPT = 256
BLOCK = 32


def test_smallest_bench_engine_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_engine", "--smallest", "--vllm-python",
         sys.executable, "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False)
    print(proc.stdout, proc.stderr[-2000:], sep="\n", flush=True)
    assert proc.returncode == 0, proc.stderr[-8000:]
    rows = {r["request"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"writer", "hit", "local", "miss"}
    assert {r["config"] for r in rows.values()} == {"file"}
    # The 256-token prompt is 8 full blocks: all load, claimed but for the last token (vLLM
    # must compute one). After vLLM's own prefix cache (7 blocks) less than a block is left
    # to claim (31 tokens), so the connector asks the pool nothing (vllm#42623) and vLLM
    # computes them.
    claimed = PROMPT - 1
    assert PROMPT % BLOCK == 0
    assert rows["writer"]["cached_tokens"] == 0
    assert rows["hit"]["cached_tokens"] == claimed
    assert rows["hit"]["prefilled_tokens"] == 1
    assert rows["local"]["cached_tokens"] == PROMPT - BLOCK
    assert rows["miss"]["cached_tokens"] == 0
    for request in ("hit", "local"):
        assert rows[request]["identical"] is True
        assert rows[request]["output"] == rows["writer"]["output"]
        assert len(rows[request]["output"]) == 8
    assert all(r["ttft_s"] > 0 and r["ttft_source"] == "metrics" for r in rows.values())
    # The engine's threads were timed inside the connector: the hit's synchronous load, the
    # miss's save (its gather) and lookup.
    assert rows["hit"]["hooks_ms"]["start_load_kv"] > 0
    assert {"get_num_new_matched_tokens", "wait_for_save"} <= set(rows["miss"]["hooks_ms"])
    assert rows["miss"]["connector_ms"] == pytest.approx(sum(rows["miss"]["hooks_ms"].values()),
                                                         abs=0.01)
    assert "kvtier dram+file://" in proc.stdout
