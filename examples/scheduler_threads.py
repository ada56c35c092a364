"""Call kvtier from plain threads: a synchronous scheduler loop over ``kvtier.BlockingStore``.

Engine schedulers and many servers are synchronous. ``BlockingStore`` runs the store on its own
event-loop thread; here four scheduler threads look up prompt prefixes, fetch the blocks they
find and store the ones they computed, all through one facade, with per-call timeouts.

Run: ``python examples/scheduler_threads.py`` (with kvtier installed, or ``PYTHONPATH=.`` in a
checkout).
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import kvtier

BLOCK_TOKENS = 16
NAMESPACE = kvtier.KeyNamespace(model="toy-llm-1b", dtype="f16", layout="demo-flat")
SYSTEM_PROMPTS = [list(range(1000 + 64 * i, 1000 + 64 * i + 64)) for i in range(3)]


def kv_for(keys: list[bytes]) -> list[np.ndarray]:
    """Stand-in for prefill: one 4 KiB block per key, derived from the key (f16 bits as uint16)."""
    return [np.frombuffer(k * 256, dtype=np.uint16).copy() for k in keys]


def serve(store: kvtier.BlockingStore, worker: int) -> tuple[int, int]:
    """One scheduler thread: 20 requests sharing system prompts; returns (blocks, hits)."""
    rng = np.random.default_rng(worker)
    blocks = hits = 0
    for _ in range(20):
        prompt = SYSTEM_PROMPTS[int(rng.integers(3))] + rng.integers(0, 999, 40).tolist()
        keys = kvtier.prefix_keys(prompt, BLOCK_TOKENS, NAMESPACE)
        hit = store.lookup_prefix(keys, timeout=0.5)  # a slow tier counts as a miss
        outs = [np.empty(2048, np.uint16) for _ in range(hit)]
        found = store.get_many_into(keys[:hit], outs)
        hit = found.index(False) if False in found else hit  # vanished since lookup: compute
        expected = kv_for(keys[:hit])
        assert all(np.array_equal(o, kv) for o, kv in zip(outs[:hit], expected, strict=True))
        store.put_many(zip(keys[hit:], kv_for(keys[hit:]), strict=True), timeout=5)
        blocks += len(keys)
        hits += hit
    return blocks, hits


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, kvtier.BlockingStore(
            ["dram://?capacity=256KiB", f"file://{tmp}"], timeout=10) as store:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda w: serve(store, w), range(4)))
        blocks = sum(b for b, _ in results)
        hits = sum(h for _, h in results)
        stats = store.stats()
        print(f"4 threads, {blocks} prompt blocks, {hits} served from kvtier "
              f"({100 * hits / blocks:.1f}%)")
        for tier in stats["tiers"]:
            print(f"tier {tier['scheme']:<5} hits={tier['hits']} used={tier['used']}")
    print("closed: queued writes flushed, loop thread joined")


if __name__ == "__main__":
    main()
