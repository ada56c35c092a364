"""A load or a save of the vLLM connector that fails with *any* exception, not only a
:class:`~kvtier.errors.TierError`, fails those blocks alone: a load's blocks become vLLM load
errors (recomputed), a save is reported failed, and no exception leaves the connector's hooks
(vLLM would take the engine down with it).

Each test runs the connector's worker side (vLLM's metadata faked, vLLM being absent here)
against a real tier, in a child process whose memory the test then takes away with
``RLIMIT_AS``: the fault is an honest ``MemoryError`` out of the load's or save's own
allocations (the host ran out of memory mid-transfer), not a patched method. The tier is a real
directory for ``file://`` (its loads stage through a fresh host buffer: they fail, alone) and
a real `kvtier serve --shm NAME` daemon for ``local://`` (it allocates nothing per transfer:
its loads and saves go through).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.peer_helpers import REPO
from tests.helpers.shm_helpers import running_daemon

# The child: a writer engine saves PROMPT, a reader engine asks for it, then the reader's
# address space is capped at what it maps now plus 2 MiB and it runs the load and a save of
# another prompt. A block is 1 MiB here (two layers of 512 KiB), so a load or save of 4 blocks
# that allocates its transfer buffer needs 4 MiB, which the cap refuses (MALLOC_MMAP_THRESHOLD_
# keeps every such buffer a fresh mapping: glibc would otherwise raise its threshold and serve
# it from a heap that may or may not have room, a fault by chance).
_CHILD = r"""
import json, resource, sys, threading, time
from types import SimpleNamespace
import numpy as np
from kvtier.integrations.vllm import KVTierConnector
from tests.helpers.vllm_fakes import (
    BLOCK, Blocks, Role, Request, empty_step, new_step, vllm_config)

LAYER = (16, 512, 2, 128)  # num_blocks first; 512 KiB of float32 per block
BLOCK_BYTES = 2 * 512 * 2 * 128 * 4
PROMPT = [(13 * i + 7) % 997 + 1 for i in range(4 * BLOCK + 2)]  # 4 full blocks
OTHER = [(17 * i + 3) % 991 + 1 for i in range(4 * BLOCK + 2)]

def kv_cache_config():
    spec = SimpleNamespace(num_kv_heads=2, head_size=128, block_size=BLOCK,
                           page_size_bytes=BLOCK_BYTES // 2)
    return SimpleNamespace(num_blocks=16, kv_cache_groups=[SimpleNamespace(
        layer_names=["layers.0.attn", "layers.1.attn"], kv_cache_spec=spec)])

def block_of(tokens, index):
    return np.full(LAYER[1:], float(sum(tokens[:(index + 1) * BLOCK]) % 1000), np.float32)

class Engine:
    def __init__(self, extra):
        cfg = vllm_config(extra)
        self.scheduler = KVTierConnector(cfg, Role.SCHEDULER, kv_cache_config())
        self.worker = KVTierConnector(cfg, Role.WORKER, kv_cache_config())
        self.kv = {name: np.zeros(LAYER, np.float32) for name in ("layers.0.attn", "layers.1.attn")}
        self.worker.register_kv_caches(self.kv)
        self.failed_saves = 0  # as the workers' reports to the scheduler count them

    def report(self):
        report = self.worker.build_connector_worker_meta()
        self.failed_saves += len(report.failed) if report else 0
        return report

    def step(self, output, req=None, ids=(), ext=0):
        # One step as vLLM's scheduler and model runner call the connector's hooks; every
        # exception out of a hook is what this test is about, so none is caught here.
        self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(output))
        self.worker.start_load_kv(None)
        for name in self.kv:
            self.worker.wait_for_layer_load(name)
        if req is not None:
            for b in range(ext // BLOCK, len(req.prompt_token_ids) // BLOCK):
                for layer in self.kv.values():
                    layer[ids[b]] = block_of(req.prompt_token_ids, b)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        self.scheduler.update_connector_output(SimpleNamespace(
            invalid_block_ids=errors, finished_recving=recving, finished_sending=sending,
            kv_connector_worker_meta=self.report()))
        self.worker.clear_connector_metadata()
        return errors, recving or set()

    def prefill(self, req, ids):
        # Ask, wait for an asynchronous load as vLLM does (empty steps until the worker
        # reports it), then run the request's step.
        ext, load_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        self.scheduler.update_state_after_alloc(req, Blocks(ids), ext)
        errors = set()
        for _ in range(1000 if load_async else 0):
            more, recving = self.step(empty_step())
            errors |= more
            if req.request_id in recving:
                break
            time.sleep(0.005)
        else:
            assert not load_async, "the asynchronous load never finished"
        more, _ = self.step(new_step(req, ids, ext, len(req.prompt_token_ids) - ext),
                            req, ids, ext)
        return ext, load_async, errors | more

    def finish(self, req):
        delay, _ = self.scheduler.request_finished(req, [])
        deadline = time.monotonic() + 30
        while delay and time.monotonic() < deadline:
            sending, _ = self.worker.get_finished({req.request_id})
            self.report()
            if sending:
                return sorted(sending)
            time.sleep(0.005)
        return []

def mapped():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")

extra = {"tiers": [sys.argv[1]], "model": "tiny-test", "staging_bytes": 0,
         "async_load": sys.argv[2]}
writer = Engine(extra)
writer.prefill(Request("w-1", PROMPT), [0, 1, 2, 3, 4])
assert writer.finish(Request("w-1", PROMPT)) == ["w-1"]
reader = Engine(extra)
reader.prefill(Request("r-0", [5] * 9), [10, 11, 12])  # the reader's save thread runs
reader.finish(Request("r-0", [5] * 9))
for thread in threading.enumerate():  # the arena's page-table fill ends (its stack is freed)
    if thread.name == "kvtier-local-map-in":
        thread.join()
out = {}
resource.setrlimit(resource.RLIMIT_AS, (mapped() + (2 << 20), resource.RLIM_INFINITY))
try:
    ext, out["async"], errors = reader.prefill(Request("r-1", PROMPT), [5, 6, 7, 8, 9])
    out["promised"], out["errors"] = ext // BLOCK, sorted(errors)
    reader.prefill(Request("r-2", OTHER), [12, 13, 14, 15, 0])
    out["save"] = {"finished": reader.finish(Request("r-2", OTHER)),
                   "failed": reader.failed_saves}
except BaseException as exc:
    out["raised"] = f"{type(exc).__name__}: {exc}"
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
ids = [5, 6, 7, 8, 9]  # a block not reported failed holds its KV
out["wrong"] = [i for i in range(4) if ids[i] not in out.get("errors", ids) and not all(
    np.array_equal(layer[ids[i]], block_of(PROMPT, i)) for layer in reader.kv.values())]
print(json.dumps(out), flush=True)
"""


def _run_child(tier: str, async_load: str) -> dict[str, Any]:
    # One malloc arena, and every buffer of 128 KiB or more a mapping of its own: a transfer
    # buffer then needs new address space, which the cap refuses (with more arenas glibc
    # retries in another thread's reserved heap, and the fault comes by chance).
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(128 << 10),
           "MALLOC_ARENA_MAX": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, tier, async_load], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    result["log"] = proc.stderr[-2000:]
    return result


def _check(result: dict[str, Any], async_load: str, *, fails: bool) -> None:
    assert "raised" not in result, f"a hook raised {result['raised']}\n{result['log']}"
    assert result["promised"] == 4 and result["async"] == (async_load == "always")
    assert result["wrong"] == [], "a block not reported failed holds wrong bytes"
    if not fails:
        assert result["errors"] == [], result["log"]
        assert result["save"] == {"finished": ["r-2"], "failed": 0}, result["log"]
        return
    # The cap refuses the load's staging buffer: every promised block is a load error (vLLM
    # recomputes it; an asynchronous load is still reported finished).
    assert result["errors"] == [5, 6, 7, 8], result["log"]
    # The save of the other prompt fails alone: reported failed, and its request finishes.
    assert result["save"] == {"finished": ["r-2"], "failed": 1}, result["log"]


@pytest.mark.parametrize("async_load", ["never", "always"])
def test_a_load_on_the_daemon_allocates_nothing_and_survives_the_cap(tmp_path: Path,
                                                                      async_load: str) -> None:
    """The daemon path moves blocks through bounce buffers made at register, on threads
    started then: under the cap its load and save go through. (Before they were, each
    transfer allocated its 4 MiB bounce buffer, and this test failed with 'a hook raised
    MemoryError: Unable to allocate 4.00 MiB for an array with shape (4, 1048576) and data
    type uint8' out of start_load_kv; then, with loads failing alone, with load errors.)"""
    with running_daemon(tmp_path) as proc:
        _check(_run_child(f"local://{proc.shm_name}?timeout=5", async_load), async_load,
               fails=False)


@pytest.mark.parametrize("async_load", ["never", "always"])
def test_a_load_out_of_memory_on_a_file_tier_is_load_errors(tmp_path: Path,
                                                           async_load: str) -> None:
    _check(_run_child(f"file://{tmp_path / 'pool'}", async_load), async_load, fails=True)
