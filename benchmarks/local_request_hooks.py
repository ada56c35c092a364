"""Connector hook time per request on the host daemon, as bench_engine's one-prompt rows see it.

Drives the vLLM connector's scheduler and worker sides (``tiers: ["local://NAME"]``, vLLM's
config objects stood in as in :mod:`benchmarks.local_worker`, its large model's 1 MiB blocks)
through whole requests the way vLLM calls the hooks: one prefill step, then ``--decode``
decode steps, each after ``--forward-ms`` standing in for the forward pass. A writer engine
stores a block-aligned prompt; the reader engine then asks for it (``hit``), asks again with
vLLM's own prefix cache holding all but its last block (``local``), and asks for a prompt
nothing stored (``miss``). Prints, per request kind, the median over repeats of the time
spent inside all hooks (what ``benchmarks.engine_hooks`` sums in a real engine), and the
``local`` request's per-hook medians. vLLM's block hashes are made as its ``Request`` makes
them (sha256 chained), outside the timed hooks.

Run ``python -m benchmarks.local_request_hooks [--blocks 256] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from benchmarks import local_worker as lw
from benchmarks.bench_local import _start_daemon

T = lw.BLOCK_TOKENS


def _block_hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for start in range(0, len(tokens) - T + 1, T):
        h = hashlib.sha256(out[-1] if out else b"root")
        h.update(repr(tokens[start:start + T]).encode())
        out.append(h.digest())
    return out


def _cached_step(req_id: str, computed: int) -> Any:
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
        num_computed_tokens=[computed]), num_scheduled_tokens={req_id: 1})


def _request(engine: Any, req_id: str, prompt: list[int], ids: list[int], local: int,
             decode: int, forward_s: float) -> dict[str, float]:
    """One request through every hook; milliseconds per hook."""
    spent: dict[str, float] = {}

    def timed(name: str, call: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = call(*args)
        spent[name] = spent.get(name, 0.0) + (time.perf_counter_ns() - t0) / 1e6
        return out

    req = SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, output_token_ids=[],
                          all_token_ids=list(prompt), cache_salt=None, lora_request=None,
                          mm_features=[], block_hashes=_block_hashes(prompt))
    sched, worker = engine.scheduler, engine.worker
    ext, _ = timed("get_num_new_matched_tokens", sched.get_num_new_matched_tokens, req, local)
    timed("update_state_after_alloc", sched.update_state_after_alloc, req,
          SimpleNamespace(get_block_ids=lambda: (ids,)), ext)
    output = lw._step(req_id, ids, local + ext, len(prompt) - local - ext)
    for step in range(1 + decode):
        worker.bind_connector_metadata(timed("build_connector_meta", sched.build_connector_meta,
                                             output))
        timed("start_load_kv", worker.start_load_kv, None)
        time.sleep(forward_s)  # the forward pass
        timed("wait_for_save", worker.wait_for_save)
        timed("get_finished", worker.get_finished, set())
        errors = timed("get_block_ids_with_load_errors", worker.get_block_ids_with_load_errors)
        report = timed("build_connector_worker_meta", worker.build_connector_worker_meta)
        timed("update_connector_output", sched.update_connector_output, SimpleNamespace(
            invalid_block_ids=errors, finished_recving=None, finished_sending=None,
            kv_connector_worker_meta=report))
        worker.clear_connector_metadata()
        req.all_token_ids.append(7)
        req.output_token_ids.append(7)
        output = _cached_step(req_id, len(prompt) + step)
    timed("request_finished", sched.request_finished, req, [])
    spent["loaded tokens"] = ext
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks per prompt (1 MiB each)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", type=int, default=7, help="decode steps per request")
    parser.add_argument("--forward-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    blocks, forward_s = args.blocks, args.forward_ms / 1e3
    name = f"hooks-{secrets.token_hex(3)}"
    daemon = _start_daemon(name, f"{max(512, 8 * blocks)}MiB")
    try:
        writer, reader = lw._Engine(name, blocks + 2), lw._Engine(name, 2 * blocks + 4)
        for thread in threading.enumerate():  # as an engine that attached before its requests
            if thread.name == "kvtier-local-map-in":
                thread.join()
        totals: dict[str, list[float]] = {"hit": [], "local": [], "miss": []}
        local_hooks: list[dict[str, float]] = []
        first, second = list(range(blocks)), list(range(blocks, 2 * blocks))
        try:
            for r in range(args.repeats):
                prompt = lw._prompt(100 + r, blocks)[:blocks * T]  # on a block boundary
                _request(writer, f"w{r}", prompt, first, 0, args.decode, forward_s)
                writer.finish(SimpleNamespace(request_id=f"w{r}"))
                time.sleep(0.3)
                asks = {"hit": (prompt, first, 0),
                        "local": (prompt, [*first[:-1], 2 * blocks], (blocks - 1) * T),
                        "miss": (lw._prompt(1000 + r, blocks)[:blocks * T], second, 0)}
                for kind, (tokens, ids, local) in asks.items():
                    spent = _request(reader, f"{kind}{r}", tokens, ids, local, args.decode,
                                     forward_s)
                    loaded = spent.pop("loaded tokens")
                    totals[kind].append(sum(spent.values()))
                    if kind == "local":
                        local_hooks.append({**spent, "loaded tokens": loaded})
                time.sleep(0.3)
        finally:
            reader.close()
            writer.close()
    finally:
        daemon.terminate()
        daemon.wait()
    for kind, values in totals.items():
        print(f"{kind:<6} hook ms: median {statistics.median(values):.3f}  "
              f"all {[round(v, 2) for v in values]}")
    print("local, per hook (median ms):", {k: round(statistics.median(h[k] for h in local_hooks),
                                                     3) for k in local_hooks[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
