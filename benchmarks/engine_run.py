"""One vLLM engine process for ``bench_engine``: a random-weight Llama, one KV connector.

Run as ``python benchmarks/engine_run.py SPEC_JSON`` with the Python of a vLLM venv. ``SPEC_JSON``
holds ``model_dir``, ``model`` (the :func:`build_model` shape), ``max_model_len`` and
``connector`` (``None`` or ``{"kind": "kvtier" | "example" | "lmcache", ...}``) and optionally
``hook_log`` (a path: time the connector's hooks, see ``engine_hooks``). The process
starts ``vllm.LLM``, prints ``@@engine {"ready": ..., "startup_s": ...}``, then serves one request
per stdin line (``{"label", "tokens", "max_tokens"}``), one ``generate()`` at a time, and
answers each with ``@@engine {"label", "ttft_s", "generate_s", "num_cached_tokens",
"prompt_tokens", "output", "connector_ms", "hooks_ms"}``. End of input closes the engine
(connectors flush at shutdown).

vLLM and its engine process write logs to the same stdout; only lines starting with
``@@engine`` belong to this protocol.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MARK = "@@engine "
BLOCK = 32  # the CPU backend needs block_size to be a multiple of 32

# The benchmark's model: a cold 2,048-token prefill takes about a second on 2 CPU cores.
BENCH_MODEL = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 64, "max_position_embeddings": 8192}
# The lane's model (tests/vllm_lane/run_llm.py): starts and prefills in no time.
TINY_MODEL = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32, "max_position_embeddings": 1024}


# vLLM's CPU platform starts its engine and worker processes with "spawn": each imports this
# module again (as __mp_main__), so the hook timing (see serve) is installed here too.
if os.environ.get("KVTIER_BENCH_HOOK_LOG") and __name__ != "__main__":
    from benchmarks.engine_hooks import instrument

    instrument(os.environ["KVTIER_BENCH_HOOK_LOG"])


def build_model(path: Path, shape: dict[str, int]) -> None:
    """Save a seeded random-weight fp32 Llama of ``shape`` at ``path`` (no hub access)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    config = LlamaConfig(**shape, torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def kvtier_transfer_config(tiers: list[str], extra: dict[str, Any] | None = None,
                           kv_role: str = "kv_both") -> Any:
    """vLLM's ``KVTransferConfig`` loading ``KVTierConnector`` over ``tiers`` (``kv_role``
    ``kv_consumer``: loads only).

    The lookup bound is generous: shared CI machines are slow, and the default (0.1 s) would
    turn a slow ``file://`` listing into a miss.
    """
    from vllm.config import KVTransferConfig

    config = {"tiers": tiers, "model": "tiny-llama-lane", "lookup_timeout_s": 5.0,
              **(extra or {})}
    return KVTransferConfig(kv_connector="KVTierConnector",
                            kv_connector_module_path="kvtier.integrations.vllm",
                            kv_role=kv_role, kv_connector_extra_config=config)


def transfer_config(connector: dict[str, Any] | None) -> Any:
    """The ``KVTransferConfig`` for a connector spec, or ``None`` for no connector."""
    from vllm.config import KVTransferConfig

    if connector is None:
        return None
    kind = connector["kind"]
    if kind == "kvtier":
        return kvtier_transfer_config(connector["tiers"], connector.get("extra"),
                                      connector.get("kv_role", "kv_both"))
    if kind == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={
                                    "shared_storage_path": connector["path"]})
    if kind == "lmcache":
        # Both sides' defaults hang the worker on CPU ("No available shared memory broadcast
        # block found"); the server's --supported-transfer-mode auto pairs with this mode.
        return KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                                kv_connector_extra_config={
                                    "lmcache.mp.host": "tcp://127.0.0.1",
                                    "lmcache.mp.port": connector["port"],
                                    "lmcache.mp.mp_transfer_mode": "lmcache_driven"})
    raise ValueError(f"unknown connector kind {kind!r}")


def reply(payload: dict[str, Any]) -> None:
    """Write one protocol line."""
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def serve(spec: dict[str, Any]) -> None:
    """Start the engine of ``spec`` and answer requests from stdin until end of input."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = Path(spec["model_dir"])
    build_model(model_dir, spec["model"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    hooks = None
    if spec.get("hook_log"):
        from benchmarks.engine_hooks import HOOK_LOG_ENV, HookLog, instrument

        os.environ[HOOK_LOG_ENV] = spec["hook_log"]  # for vLLM's spawned processes
        instrument(spec["hook_log"])
        hooks = HookLog(spec["hook_log"])
    started = time.perf_counter()
    kwargs: dict[str, Any] = {}
    config = transfer_config(spec.get("connector"))
    if config is not None:
        kwargs["kv_transfer_config"] = config
    # disable_log_stats=False: RequestOutput.metrics then carries the engine's own
    # first-token latency (arrival to first token), free of generate()'s own overheads.
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
              block_size=BLOCK, max_model_len=spec["max_model_len"], dtype="float32", seed=0,
              enable_prefix_caching=True, disable_log_stats=False, **kwargs)
    reply({"ready": True, "startup_s": time.perf_counter() - started, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                                detokenize=False)
        t0, wall0 = time.perf_counter(), time.time()
        out = llm.generate([TokensPrompt(prompt_token_ids=request["tokens"])], params,
                           use_tqdm=False)[0]
        generate_s = time.perf_counter() - t0
        hooks_ms = {} if hooks is None else hooks.window(wall0, time.time())
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
        reply({"label": request["label"], "ttft_s": ttft or generate_s,
               "ttft_source": "metrics" if ttft else "generate", "generate_s": generate_s,
               "num_cached_tokens": out.num_cached_tokens or 0,
               "prompt_tokens": len(request["tokens"]),
               "output": list(out.outputs[0].token_ids),
               "connector_ms": round(sum(hooks_ms.values()), 3)
               if hooks and spec.get("connector") else None,
               "hooks_ms": {name: round(ms, 3) for name, ms in sorted(hooks_ms.items())}})
    del llm


def main() -> int:
    """Entry point: ``engine_run.py SPEC_JSON``."""
    serve(json.loads(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
