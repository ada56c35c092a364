"""Embed kvtier in an inference server's request loop.

Each request's prompt is hashed into one key per full block of tokens; the server asks the
store how long a prefix it already has, fetches those KV blocks, "computes" the rest (here a
deterministic numpy stand-in for the model's prefill) and stores the new blocks. Prompts share
system prompts, so later requests find long cached prefixes.

Run: ``python examples/embed_in_server.py`` (with kvtier installed, or ``PYTHONPATH=.`` in a
checkout).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

import kvtier

BLOCK_TOKENS = 16
LAYERS, HEADS, HEAD_DIM = 2, 4, 32  # one block: 2 x 2 x 4 x 16 x 32 float16 = 16 KiB
NAMESPACE = kvtier.KeyNamespace(model="toy-llm-1b", dtype="f16", layout="demo-lkhtd")


def prefill_block(tokens: np.ndarray, position: int) -> np.ndarray:
    """Stand-in for the model: a KV block that depends on the block's tokens and position.

    (A real engine's block depends on the whole prefix; the chained keys encode that.)
    """
    phase = (tokens.astype(np.float32)[:, None] * 0.001 + position)
    grid = np.sin(phase + np.arange(HEAD_DIM, dtype=np.float32)[None, :])  # (tokens, dim)
    kv = np.broadcast_to(grid, (LAYERS, 2, HEADS, BLOCK_TOKENS, HEAD_DIM))
    return np.ascontiguousarray(kv, dtype=np.float16)


def make_requests(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Prompts = one of a few long system prompts + a short per-user suffix."""
    systems = [rng.integers(0, 32_000, size=int(rng.integers(8, 24)) * BLOCK_TOKENS)
               for _ in range(4)]
    out = []
    for _ in range(n):
        system = systems[int(rng.integers(0, len(systems)))]
        suffix = rng.integers(0, 32_000, size=int(rng.integers(1, 6)) * BLOCK_TOKENS + 5)
        out.append(np.concatenate([system, suffix]))
    return out


async def serve(requests: list[np.ndarray]) -> tuple[int, int]:
    """Handle each request like a server would; return (blocks needed, blocks from cache)."""
    store = await kvtier.open_store(
        ["dram://?capacity=1MiB&name=hot", "dram://?capacity=8MiB&name=warm"],
        # A deadline on every call: a tier slower than this is a miss, not a stall. 0.5 s,
        # not a scheduler's tighter budget, so a loaded box (the test suite's) misses nothing.
        promote="all", timeout=0.5)
    needed = cached = 0
    async with store:
        for tokens in requests:
            keys = kvtier.prefix_keys(tokens, block_tokens=BLOCK_TOKENS, namespace=NAMESPACE)
            hit = await store.lookup_prefix(keys)
            blocks = await store.get_many(keys[:hit])
            # A block can go between lookup and get (eviction by another request): the usable
            # prefix ends at the first one missing.
            usable = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
            for i in range(usable):  # check the cache against a fresh "prefill"
                expected = prefill_block(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS], i)
                got = blocks[i]
                assert got is not None and np.array_equal(got, expected), "corrupt cache"
            new = [prefill_block(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS], i)
                   for i in range(usable, len(keys))]
            await store.put_many(zip(keys[usable:], new, strict=True))
            needed += len(keys)
            cached += usable
        stats = store.stats()
    for tier in stats["tiers"]:
        print(f"tier {tier['name']:<5} hits={tier['hits']:<5} misses={tier['misses']:<5} "
              f"promotions={tier['promotions']:<4} demotions={tier['demotions']:<4} "
              f"evictions={tier['evictions']:<4} used={tier['used'] / 2**20:.2f} MiB "
              f"of {tier['capacity'] / 2**20:.0f} MiB")
    print(f"block get hit rate: {stats['hit_rate']:.1%} over {stats['gets']} block gets")
    return needed, cached


def main() -> int:
    rng = np.random.default_rng(2024)
    requests = make_requests(rng, 120)
    start = time.perf_counter()
    needed, cached = asyncio.run(serve(requests))
    elapsed = time.perf_counter() - start
    print(f"requests: {len(requests)}, KV blocks needed: {needed}, served from cache: {cached}")
    print(f"prefix hit rate: {cached / needed:.1%} (prefill skipped for those blocks)")
    print(f"all cached blocks verified against recomputation in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
