"""The real-vLLM lane: ``KVTierConnector`` loaded by vLLM's own factory inside ``vllm.LLM``.

Skipped unless vLLM imports (the default suite skips it; ``tox -e vllm`` and ``.ci/run``'s
second venv with the CPU build run it). Each run is a separate process
(``tests/vllm_lane/run_llm.py``) on a tiny random-weight Llama generated at test time:

1. a baseline run without any connector;
2. two runs over a shared ``file://`` tier: the second must report the prompts' full blocks
   as cached (``RequestOutput.num_cached_tokens``) and produce exactly the baseline's tokens;
3. the same two runs over a pool: a ``kvtier serve`` process and ``peers://``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_VLLM_LANE") == "1":
    import vllm  # noqa: F401  (the lane itself: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="the real-vLLM lane needs vLLM (tox -e vllm)")

# Each vLLM start takes 20-90 s on a loaded machine; a test runs two or three of them.
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "vllm_lane" / "run_llm.py"
BLOCK = 32
PROMPT_LENGTHS = (100, 64)
# The prompt's full blocks, never its last token: 100 tokens -> 96; 64 (two full blocks) -> 63.
EXPECTED_CACHED = [min(n // BLOCK * BLOCK, n - 1) for n in PROMPT_LENGTHS]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _run(model: Path, label: str, tiers: list[str] | None = None,
         kv_events: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, str(RUN), str(model)]
    if tiers is not None:
        cmd += ["--tiers", *tiers]
    if kv_events:
        cmd.append("--kv-events")
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"outputs"')]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{label}: vLLM run failed (rc={proc.returncode})\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    print(f"[vllm lane] {label:<28} {time.monotonic() - started:5.1f}s "
          f"num_cached_tokens={result['num_cached_tokens']} outputs={result['outputs']}",
          flush=True)
    return result


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-llama") / "model"


@pytest.fixture(scope="module")
def baseline(model: Path) -> dict[str, Any]:
    result = _run(model, "baseline (no connector)")
    assert result["num_cached_tokens"] == [0, 0]
    return result


def _check_pair(model: Path, baseline: dict[str, Any], tiers: list[str], label: str,
                media: list[list[str]] | None = None) -> None:
    first = _run(model, f"{label}: run 1 (saves)", tiers, kv_events=media is not None)
    assert first["num_cached_tokens"] == [0, 0]
    assert first["outputs"] == baseline["outputs"]
    if media is not None:
        # take_events(): vLLM published the connector's saves (3 + 2 full blocks) once per
        # medium, under its own identity, with the hashes of its own GPU events.
        stored = [e for e in first["events"] if e[0] == "BlockStored" and e[1] != "GPU"]
        gpu = {h for e in first["events"] if e[0] == "BlockStored" and e[1] == "GPU"
               for h in e[3]}
        print(f"[vllm lane] {label}: connector events published by vLLM: "
              f"{[(e[1], e[2], len(e[3])) for e in stored]}", flush=True)
        assert sorted({tuple(e[1:3]) for e in stored}) == sorted(tuple(m) for m in media)
        for medium in media:
            hashes = [h for e in stored if e[1:3] == medium for h in e[3]]
            assert len(hashes) == 5 and set(hashes) <= gpu
    second = _run(model, f"{label}: run 2 (new process)", tiers)
    assert second["num_cached_tokens"] == EXPECTED_CACHED
    assert second["outputs"] == baseline["outputs"]
    print(f"[vllm lane] {label}: run 2 cached {second['num_cached_tokens']} of prompt lengths "
          f"{list(PROMPT_LENGTHS)} (expected {EXPECTED_CACHED}); outputs identical to the "
          f"baseline: {second['outputs'] == baseline['outputs']}", flush=True)


def test_two_runs_share_a_file_tier(model: Path, baseline: dict[str, Any],
                                    tmp_path: Path) -> None:
    _check_pair(model, baseline, ["dram://?capacity=64MiB", f"file://{tmp_path / 'kv'}"],
                "file:// tier", media=[["CPU", "LOCAL"], ["STORAGE", "LOCAL"]])


def test_two_runs_share_a_peer_pool(model: Path, baseline: dict[str, Any],
                                    tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("lane-secret-token-0123456789")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--listen", "127.0.0.1:0",
         "--tier", "dram://?capacity=256MiB", "--token-file", str(token)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        match = re.search(r"listening on (\S+)", line)
        assert match, f"kvtier serve did not start: {line}"
        peers = f"peers://{match.group(1)}?token=file:{token}&timeout=5"
        _check_pair(model, baseline, ["dram://?capacity=64MiB", peers], "kvtier serve + peers://")
    finally:
        server.terminate()
        server.wait(30)
        if server.stdout is not None:
            server.stdout.close()


def test_two_runs_share_a_host_daemon(model: Path, baseline: dict[str, Any],
                                      tmp_path: Path) -> None:
    """A writer and a new reader on one `kvtier serve --shm` daemon: the reader's prompts
    are cached and its outputs are the baseline's (docs/host-daemon.md)."""
    token = tmp_path / "token"
    token.write_text("lane-secret-token-0123456789")
    name = f"lane-{os.getpid()}"
    server = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--listen", "127.0.0.1:0", "--shm", name,
         "--tier", "dram://?capacity=256MiB", "--token-file", str(token)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        seen = []
        for line in server.stdout:  # the shm line, then the listening line
            seen.append(line)
            if "listening on" in line:
                break
        assert any("listening on" in line for line in seen), f"daemon did not start: {seen}"
        _check_pair(model, baseline, [f"local://{name}?timeout=5"], "kvtier serve --shm + local://")
    finally:
        server.terminate()
        server.wait(30)
        if server.stdout is not None:
            server.stdout.close()
