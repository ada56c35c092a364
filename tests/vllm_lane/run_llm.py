"""One vLLM run for the real-vLLM lane: tiny random Llama, optional KVTierConnector (the model
and the connector config come from ``benchmarks/engine_run.py``, shared with ``bench_engine``).

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

from benchmarks.engine_run import BLOCK, TINY_MODEL, build_model, kvtier_transfer_config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--tiers", nargs="*", default=None)
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--kv-events", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    build_model(args.model_dir, TINY_MODEL)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if args.tiers is not None:
        kwargs["kv_transfer_config"] = kvtier_transfer_config(args.tiers, json.loads(args.extra))
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
