"""An engine with in-process tiers (``dram://`` + ``peers://`` in the worker) that shuts
down with a save stuck behind a peer that hangs: a real `kvtier serve` stopped (SIGSTOP).
The engine is a child process (vLLM's metadata faked), killed the way vLLM 0.32 ends its
processes: the connector's ``shutdown``, then SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.peer_helpers import REPO, pool_url, serve_processes
from tests.helpers.vllm_fakes import BLOCK

PROMPT = [(13 * i + 7) % 997 + 1 for i in range(8 * BLOCK + 1)]

_WRITER = r"""
import json, os, signal, sys
from tests.helpers.vllm_fakes import FakeEngine, Request
prompt, extra, peer_pid = json.loads(sys.argv[1])
engine = FakeEngine(extra)
os.kill(peer_pid, signal.SIGSTOP)
engine.prefill(Request("w-0", prompt), list(range(9)))  # the save starts, and hangs
worker = engine.worker._worker
saves = [f for fs in worker._req_saves.values() for f in fs]
engine.worker.shutdown()
engine.scheduler.shutdown()
# Unfinished: still running, or cancelled by the store's bounded close.
print(json.dumps({"unfinished": sum(not f.done() or f.cancelled() for f in saves)}),
      flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_shutdown_with_a_save_stuck_behind_a_hung_peer_returns_and_says_so(
        tmp_path: Path) -> None:
    """The save's write-through to the stopped peer waits for its 30 s timeout; shutdown
    waits its bounded grace only, then logs the save it leaves behind. (Before, it waited
    for every save: it returned after the peer's timeout, with 'unfinished': 0.)"""
    with serve_processes(tmp_path, 1, ["--tier", "dram://?capacity=16MiB"]) as (peer,):
        extra = {"tiers": ["dram://?capacity=1MiB", pool_url([peer.member], timeout=30)],
                 "scheduler_tiers": [], "model": "tiny-test"}
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, json.dumps([PROMPT, extra, peer.pid])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            out, log = child.communicate(timeout=120)
        finally:
            peer.signal(signal.SIGCONT)
    assert child.returncode == -signal.SIGKILL, log[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, log[-3000:]
    assert json.loads(lines[-1]) == {"unfinished": 1}, log[-3000:]
    assert "shutting down with 1 save(s) of 8 block(s) unfinished" in log, log[-3000:]
    assert "requests w-0" in log, log[-3000:]
