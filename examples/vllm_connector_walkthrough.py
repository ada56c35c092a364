"""What vLLM does with ``KVTierConnector``, step by step, without vLLM installed.

vLLM builds the connector twice from ``--kv-transfer-config`` (scheduler side and worker side,
usually in two processes). This walkthrough passes the same objects vLLM would (config
namespaces, a request, the scheduler's output) to both sides of two "engines" sharing a
``file://`` tier: engine A computes and saves a prompt's blocks; engine B, with an empty cache
and different block ids, finds them and loads them byte for byte. The real thing runs inside
``vllm.LLM`` in ``tests/vllm_lane`` (``tox -e vllm``).

Run: ``python examples/vllm_connector_walkthrough.py`` (kvtier installed or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import enum
import tempfile
import time
from types import SimpleNamespace as NS

import numpy as np

from kvtier.integrations.vllm import KVTierConnector

BLOCK, NUM_BLOCKS = 16, 64


class Role(enum.Enum):  # vLLM's KVConnectorRole
    SCHEDULER = 0
    WORKER = 1


def engine(tiers: list[str]) -> tuple[KVTierConnector, KVTierConnector, dict[str, np.ndarray]]:
    """Both sides of one engine, as vLLM's factory constructs them, plus its paged KV."""
    config = NS(kv_transfer_config=NS(kv_connector_extra_config={"tiers": tiers,
                                                                 "model": "toy-llama"}),
                model_config=NS(model="toy-llama", served_model_name="toy-llama",
                                dtype="float16"),
                cache_config=NS(block_size=BLOCK, cache_dtype="auto"),
                parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
                device_config=NS(device_type="cpu"))
    kv_cache_config = NS(num_blocks=NUM_BLOCKS, kv_cache_groups=[NS(
        layer_names=["l0", "l1"], kv_cache_spec=NS(num_kv_heads=2, head_size=8,
                                                   block_size=BLOCK))])
    scheduler = KVTierConnector(config, Role.SCHEDULER, kv_cache_config)
    worker = KVTierConnector(config, Role.WORKER, kv_cache_config)
    kv = {name: np.zeros((NUM_BLOCKS, BLOCK, 2, 2, 8), np.float16) for name in ("l0", "l1")}
    worker.register_kv_caches(kv)  # vLLM passes its per-layer paged tensors
    return scheduler, worker, kv


def step(scheduler: KVTierConnector, worker: KVTierConnector, req: NS, block_ids: list[int],
         computed: int, kv: dict[str, np.ndarray] | None = None) -> None:
    """One engine step for a newly scheduled request: plan, load, (forward), save."""
    output = NS(scheduled_new_reqs=[NS(req_id=req.request_id, block_ids=(block_ids,),
                                       num_computed_tokens=computed)],
                scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                         num_computed_tokens=[]),
                num_scheduled_tokens={req.request_id: len(req.prompt_token_ids) - computed})
    worker.bind_connector_metadata(scheduler.build_connector_meta(output))
    worker.start_load_kv(None)
    if kv is not None:  # the forward pass writes KV for the blocks it computed
        rng = np.random.default_rng(0)
        for b in block_ids[computed // BLOCK:]:
            for layer in kv.values():
                layer[b] = rng.standard_normal(layer[b].shape)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def main() -> None:
    prompt = list(range(100, 170))  # 70 tokens: 4 full blocks of 16, plus 6
    with tempfile.TemporaryDirectory() as tmp:
        tiers = ["dram://?capacity=64MiB", f"file://{tmp}"]
        sched_a, worker_a, kv_a = engine(tiers)
        req = NS(request_id="a", prompt_token_ids=prompt, all_token_ids=prompt, cache_salt=None,
                 lora_request=None, mm_features=[])
        print("A: external hit", sched_a.get_num_new_matched_tokens(req, 0))
        sched_a.update_state_after_alloc(req, NS(get_block_ids=lambda: ([0, 1, 2, 3, 4],)), 0)
        step(sched_a, worker_a, req, [0, 1, 2, 3, 4], 0, kv_a)
        delay, _ = sched_a.request_finished(req, [0, 1, 2, 3, 4])
        while delay and not worker_a.get_finished({"a"})[0]:
            time.sleep(0.001)  # vLLM frees A's blocks once its saves reached every tier
        print(f"A: saved 4 blocks, request finished (delayed free: {delay})")

        sched_b, worker_b, kv_b = engine(tiers)
        req_b = NS(**{**vars(req), "request_id": "b"})
        tokens, load_async = sched_b.get_num_new_matched_tokens(req_b, 0)
        print(f"B: external hit {tokens} tokens, asynchronous load: {load_async}")
        ids_b = [40, 41, 42, 43, 44]
        sched_b.update_state_after_alloc(req_b, NS(get_block_ids=lambda: (ids_b,)), tokens)
        step(sched_b, worker_b, req_b, [], 0)  # the step that carries the load
        # Nothing else runs in B, so the load was synchronous (done before the forward
        # pass). An asynchronous one (with other requests running) ends in a later step.
        while load_async and "b" not in (worker_b.get_finished(set())[1] or set()):
            time.sleep(0.001)
        same = all(np.array_equal(kv_a[n][a], kv_b[n][b]) for n in kv_a
                   for a, b in zip([0, 1, 2, 3], ids_b[:4], strict=True))
        print(f"B: loaded blocks {ids_b[:4]}; bytes equal to A's blocks [0, 1, 2, 3]: {same}")
        for side in (worker_a, sched_a, worker_b, sched_b):
            side.shutdown()


if __name__ == "__main__":
    main()
