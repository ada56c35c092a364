"""The vLLM connector's worker on the host daemon, timed hook by hook (``bench_local``).

Drives :class:`~kvtier.integrations.vllm.KVTierConnector` (scheduler and worker sides, with
``tiers: ["local://NAME"]``) the way vLLM's scheduler and model runner call it, with vLLM's
config objects stood in by plain namespaces (vLLM is not needed) and the issue's large model's
pages: 16 layers of ``(2, blocks, 16, 8, 64)`` float32, 1 MiB per block across the layers, as
an 8B model in bf16 keeps 64 KiB per token. Times, interleaved over ``repeats``:

- a hit's load: ``start_load_kv`` of a plan for the whole hit (keys, lease, one copy per
  block into the pages, release), what the forward pass waits for;
- a save: ``wait_for_save`` (what the step waits for) and its commit (until
  ``get_finished`` reports the request: when its blocks are readable by other engines);
- the worker's keying of a plan (what a plan carrying its keys would save it).
"""

from __future__ import annotations

import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvtier.integrations.vllm import KVTierConnector

__all__ = ["worker_rows"]

BLOCK_TOKENS = 16
LAYERS = 16
_PAGE = (BLOCK_TOKENS, 8, 64)  # tokens x KV heads x head size, per K or V plane
_BLOCK_BYTES = LAYERS * 2 * int(np.prod(_PAGE)) * 4


def _configs(name: str, num_blocks: int) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
            "tiers": [f"local://{name}?timeout=30"], "model": "bench-local-worker",
            "thread_cpus": "inherit"}),
        model_config=SimpleNamespace(model="bench", served_model_name="bench", dtype="float32",
                                     max_model_len=num_blocks * BLOCK_TOKENS),
        cache_config=SimpleNamespace(block_size=BLOCK_TOKENS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
    spec = SimpleNamespace(num_kv_heads=8, head_size=64, block_size=BLOCK_TOKENS,
                           page_size_bytes=_BLOCK_BYTES // LAYERS)
    kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(
        layer_names=[f"layers.{i}.attn" for i in range(LAYERS)], kv_cache_spec=spec)])
    return vllm_config, kv_cache_config


def _step(req_id: str, block_ids: list[int], computed: int, scheduled: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(block_ids,),
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req_id: scheduled})


class _Engine:
    """A scheduler-side and a worker-side connector over numpy pages."""

    def __init__(self, name: str, num_blocks: int) -> None:
        vllm_config, kv_cache_config = _configs(name, num_blocks)
        roles = SimpleNamespace(SCHEDULER=SimpleNamespace(name="SCHEDULER"),
                                WORKER=SimpleNamespace(name="WORKER"))
        self.scheduler = KVTierConnector(vllm_config, roles.SCHEDULER, kv_cache_config)
        self.worker = KVTierConnector(vllm_config, roles.WORKER, kv_cache_config)
        self.kv = {f"layers.{i}.attn": np.ones((2, num_blocks, *_PAGE), np.float32)
                   for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)

    def schedule(self, req_id: str, prompt: list[int], block_ids: list[int]) -> tuple[Any, int]:
        request = SimpleNamespace(request_id=req_id, prompt_token_ids=prompt,
                                  output_token_ids=[], all_token_ids=prompt, cache_salt=None,
                                  lora_request=None, mm_features=[], block_hashes=[])
        ext, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(
            request, SimpleNamespace(get_block_ids=lambda: (block_ids,)), ext)
        meta = self.scheduler.build_connector_meta(
            _step(req_id, block_ids, ext, len(prompt) - ext))
        self.worker.bind_connector_metadata(meta)
        return request, ext

    def end_step(self) -> None:
        self.worker.get_finished(set())
        self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()

    def finish(self, request: Any) -> None:
        delay, _ = self.scheduler.request_finished(request, [])
        deadline = time.monotonic() + 60
        while delay and not self.worker.get_finished({request.request_id})[0]:
            if time.monotonic() > deadline:
                raise RuntimeError("a save never finished")
            time.sleep(0.0002)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _prompt(seed: int, blocks: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 30_000, blocks * BLOCK_TOKENS + 1)]


def worker_rows(name: str, repeats: int, sizes: dict[str, int]
                ) -> list[tuple[str, float, float]]:
    """``(label, median seconds, 0)`` rows of loads, saves and keying on daemon ``name``."""
    rows: list[tuple[str, float, float]] = []
    for label, total in sizes.items():
        blocks = total // _BLOCK_BYTES
        writer, reader = _Engine(name, blocks + 1), _Engine(name, blocks + 1)
        # As in an engine, which maps the arena when it starts: the background fill of this
        # process's page tables for it is over before the first request.
        for thread in threading.enumerate():
            if thread.name == "kvtier-local-map-in":
                thread.join()
        try:
            ids = list(range(blocks + 1))
            hit_prompt = _prompt(0, blocks)
            request, _ = writer.schedule("w-hit", hit_prompt, ids)
            writer.worker.start_load_kv(None)
            writer.worker.wait_for_save()
            writer.end_step()
            writer.finish(request)
            load, save, commit, keying = [], [], [], []
            for r in range(repeats):  # interleaved, so load drifts hit every row alike
                request, ext = reader.schedule(f"r-{r}", hit_prompt, ids)
                if ext != blocks * BLOCK_TOKENS:
                    raise RuntimeError(f"{label}: the reader was promised {ext} tokens")
                t0 = time.perf_counter()
                reader.worker.start_load_kv(None)
                load.append(time.perf_counter() - t0)
                errors = reader.worker.get_block_ids_with_load_errors()
                if errors:
                    raise RuntimeError(f"{label}: {len(errors)} blocks failed to load")
                plan = reader.worker._get_connector_metadata().loads[0]
                keys = reader.worker._worker.keys
                t0 = time.perf_counter()
                keys.keys(plan.tokens, plan.salt, plan.first + len(plan.block_ids))
                keying.append(time.perf_counter() - t0)
                reader.end_step()
                reader.finish(request)
                request, _ = writer.schedule(f"w-{r}", _prompt(1 + r, blocks), ids)
                writer.worker.start_load_kv(None)
                t0 = time.perf_counter()
                writer.worker.wait_for_save()
                save.append(time.perf_counter() - t0)
                writer.end_step()
                writer.finish(request)
                commit.append(time.perf_counter() - t0)
        finally:
            reader.close()
            writer.close()
        n = f"{blocks} x {_BLOCK_BYTES >> 20} MiB"
        rows += [(f"{label} vLLM worker load: start_load_kv ({n})",
                  statistics.median(load), 0.0),
                 (f"{label} vLLM worker save: wait_for_save", statistics.median(save), 0.0),
                 (f"{label} vLLM worker save: until committed", statistics.median(commit), 0.0),
                 (f"{label} vLLM worker: keying the plan's {blocks} blocks",
                  statistics.median(keying), 0.0)]
    return rows
