"""One vLLM run for the real-vLLM lane: tiny random Llama, optional KVTierConnector.

Run as ``python tests/vllm_lane/run_llm.py MODEL_DIR [--tiers URL ...] [--extra JSON]
[--kv-events]``; prints one JSON line ``{"outputs": [[token ids], ...], "num_cached_tokens":
[...]}`` to stdout. With ``--kv-events`` vLLM publishes KV cache events on a loopback ZMQ
endpoint; a subscriber here decodes them with vLLM's own ``KVEventBatch`` and adds
``"events": [[type, medium, locality, block hashes], ...]`` to the line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

BLOCK = 32  # the CPU backend needs block_size to be a multiple of 32


def build_model(path: Path) -> None:
    """Save a seeded random-weight 2-layer Llama (no hub access needed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, max_position_embeddings=1024, torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--tiers", nargs="*", default=None)
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--kv-events", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    build_model(args.model_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if args.tiers is not None:
        # A generous lookup bound: CI machines are shared and slow; the default (0.1 s) would
        # turn a slow file:// listing into a miss and make the lane flaky.
        extra = {"tiers": args.tiers, "model": "tiny-llama-lane", "lookup_timeout_s": 5.0,
                 **json.loads(args.extra)}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    events: list[list[Any]] = []
    stop = threading.Event()
    if args.kv_events:
        import zmq
        from vllm.config import KVEventsConfig

        # vLLM's publisher connects to a tcp://host:port endpoint (it binds only wildcards):
        # the subscriber binds a free loopback port first.
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}")
        threading.Thread(target=_subscribe, args=(sub, events, stop), daemon=True).start()
    llm = LLM(model=str(args.model_dir), skip_tokenizer_init=True, enforce_eager=True,
              block_size=BLOCK, max_model_len=512, dtype="float32", seed=0,
              enable_prefix_caching=True, **kwargs)
    # Two prompts: 100 tokens (3 full blocks + 4) and 64 tokens (exactly 2 blocks).
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3) % 1000 + 1 for i in range(100)]),
               TokensPrompt(prompt_token_ids=[(11 * i + 5) % 1000 + 1 for i in range(64)])]
    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    outs = llm.generate(prompts, params)
    result: dict[str, Any] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                              "num_cached_tokens": [o.num_cached_tokens for o in outs]}
    if args.kv_events:
        deadline = time.monotonic() + 20  # saves end (and are published) a step or more later
        while time.monotonic() < deadline and not any(
                e[0] == "BlockStored" and e[1] not in (None, "GPU") for e in events):
            time.sleep(0.1)
        stop.set()
        result["events"] = list(events)
    print(json.dumps(result), flush=True)
    return 0


def _subscribe(sub: Any, events: list[list[Any]], stop: threading.Event) -> None:
    """Collect the events vLLM publishes until ``stop``."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    while not stop.is_set():
        if not sub.poll(100):
            continue
        _topic, _seq, payload = sub.recv_multipart()
        for event in decoder.decode(payload).events:
            hashes = [h.hex() if isinstance(h, bytes) else h
                      for h in getattr(event, "block_hashes", [])]
            events.append([type(event).__name__, getattr(event, "medium", None),
                           getattr(event, "locality", None), hashes])
    sub.close(0)


if __name__ == "__main__":
    sys.exit(main())
