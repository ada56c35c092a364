"""A toy inference engine that wires its paged KV buffer into kvtier.

The engine owns one KV buffer of ``NUM_SLOTS`` pages (numpy here, standing in for a CUDA
tensor; the code is the same with ``torch`` and ``backend="torch"``). kvtier attaches to it
as its top tier (``HBMTier.attach``) with a DRAM tier below. For every request the engine:

1. hashes the prompt into block keys and asks kvtier how long a prefix is cached
   (``lookup_prefix``);
2. uses prefix blocks already in an HBM slot in place, pinning them (``pin``) so kvtier does
   not evict or reuse those slots while the request runs;
3. allocates its other pages through kvtier (``acquire_slots``: free slots first, else slots
   of cold cached blocks, which are demoted to DRAM first), so kvtier never writes them;
4. loads the rest of the cached prefix into its pages (``get_many_into``; a host-to-device
   copy from DRAM), computes the remaining pages and offers each completed block (``put``);
5. releases its pages and pins when the request ends (``release_slots``, ``unpin``).

Run ``python examples/engine_paged_kv.py``; it checks that every loaded block equals a
recomputation and exits 1 otherwise.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import numpy.typing as npt

from kvtier import KeyNamespace, TieredStore, prefix_keys
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.hbm import HBMTier

BLOCK_TOKENS = 16
LAYERS, HEAD_DIMS = 2, 64
PAGE_SHAPE = (2, LAYERS, BLOCK_TOKENS, HEAD_DIMS)  # K and V for one page, float16
NUM_SLOTS = 12
NAMESPACE = KeyNamespace(model="toy-llm", dtype="fp16", layout="example-paged")


def compute_kv(key: bytes) -> npt.NDArray[np.float16]:
    """Stand-in for the forward pass: a page's KV depends only on its prefix (its key)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.standard_normal(PAGE_SHAPE).astype(np.float16)


class ToyEngine:
    """Owns the paged KV buffer; kvtier sits on top of it and allocates its pages."""

    def __init__(self) -> None:
        self.kv = np.zeros((NUM_SLOTS, *PAGE_SHAPE), dtype=np.float16)
        self.hbm = HBMTier.attach(self.kv)  # block_bytes = one page; backend from the buffer
        self.store = TieredStore([self.hbm, DRAMTier(capacity=64 * self.hbm.block_bytes)],
                                 promote="top")
        self.reused = self.loaded = self.computed = 0

    async def serve(self, tokens: list[int]) -> str:
        """Run one request; returns how each of its pages was obtained."""
        keys = prefix_keys(tokens, BLOCK_TOKENS, NAMESPACE)
        hit = await self.store.lookup_prefix(keys)
        # Prefix blocks already in an HBM slot are used in place: pin them so kvtier neither
        # evicts them nor gives their slots away while this request reads them.
        resident = [k for k in keys[:hit] if self.hbm.slot_of(k) is not None]
        await self.hbm.pin(resident)
        own: list[int] = []
        try:
            own = await self.hbm.acquire_slots(len(keys) - len(resident))
            pages = iter(own)
            table = [self.hbm.slot_of(k) if k in resident else next(pages) for k in keys]
            # The rest of the cached prefix (in DRAM or below) is copied into our pages.
            wanted = [(k, p) for k, p in zip(keys[:hit], table[:hit], strict=True)
                      if k not in resident]
            got = await self.store.get_many_into([k for k, _ in wanted],
                                                 [self.kv[p] for _, p in wanted])
            loaded = {k for (k, _), ok in zip(wanted, got, strict=True) if ok}
            for key, page in zip(keys, table, strict=True):
                assert page is not None
                if key in resident or key in loaded:
                    if not np.array_equal(self.kv[page], compute_kv(key)):
                        raise AssertionError(f"page of {key.hex()} differs from recomputation")
                    continue
                self.kv[page] = compute_kv(key)              # "prefill" writes the page
                await self.store.put(key, self.kv[page])     # block complete: offer it
            self.reused += len(resident)
            self.loaded += len(loaded)
            self.computed += len(keys) - len(resident) - len(loaded)
            return (f"in place={len(resident)} loaded={len(loaded)} "
                    f"computed={len(keys) - len(resident) - len(loaded)}")
        finally:
            self.hbm.release_slots(own)
            await self.hbm.unpin(resident)


async def main() -> int:
    engine = ToyEngine()
    rng = np.random.default_rng(0)
    system_prompt = rng.integers(0, 32000, 3 * BLOCK_TOKENS).tolist()
    async with engine.store:
        first = system_prompt + rng.integers(0, 32000, BLOCK_TOKENS).tolist()
        print("request 1 (cold):          ", await engine.serve(first))
        second = system_prompt + rng.integers(0, 32000, 2 * BLOCK_TOKENS).tolist()
        print("request 2 (shared prefix): ", await engine.serve(second))
        for _ in range(6):  # unrelated traffic pushes the first blocks down to DRAM
            await engine.serve(rng.integers(0, 32000, 4 * BLOCK_TOKENS).tolist())
        print("request 1 again:           ", await engine.serve(first))
        stats = engine.store.stats()
        for tier in stats["tiers"]:
            print(f"  {tier['scheme']:5} hits={tier['hits']:3} used={tier['used']:7} "
                  f"evictions={tier['evictions']:3} promotions={tier['promotions']:3} "
                  f"demotions={tier['demotions']:3}")
        print(f"pages: in place={engine.reused} loaded={engine.loaded} "
              f"computed={engine.computed}; every reused page matched its recomputation")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
