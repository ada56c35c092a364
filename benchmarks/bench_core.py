"""Core hot paths: DRAM tier and TieredStore get/put against numpy copies of the same size.

Run ``python -m benchmarks.bench_core [--quick] [--json FILE]``. Every row's ratio is its
throughput over a numpy copy of the same block size, measured in the same run (for a
zero-copy ``get`` the ratio says how many memcpys one get is worth, not a bandwidth).
``numpy copy into cold memory`` copies into freshly mapped pages (first-touch faults):
what a put of a new key costs on the heap.

The baseline of every row is ``numpy copy into warm memory``: copies into a ring of 64
destinations, all mapped beforehand, the footprint of a full 64-block tier (from 1 MiB up
not in the CPU cache). ``numpy copy into hot memory`` reuses one destination, which stays
in cache: no put into a tier larger than the cache can match it.

``fill`` rows put new keys into a tier until it is full, with a fresh tier per round; their
GB/s count the puts only (an arena's ``prefault`` is paid when the tier is opened: the
``dram open`` rows give that rate). ``full`` rows put new keys into a tier that is already
full, so every put evicts.

Targets: a top-tier ``store.get`` hit at 64 KiB has p50 <= 5 us; a DRAM put of new keys
while the tier fills, and when it is full, reach >= 0.8x the warm copy.
The two ``evicts`` store rows show what a KV-event subscriber adds to a put
(``store.events()``; without one nothing is emitted).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import mmap
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import (
    SIZES,
    Result,
    main_for,
    median_of,
    print_table,
    time_async,
    time_sync,
    with_ratio,
)
from kvtier.store import TieredStore
from kvtier.tiers.dram import DRAMTier

__all__ = ["run"]

KEY = b"k" * 16
#: Blocks of a full tier in the ``full`` rows and of the warm-copy baseline's ring.
RING = 64
#: Least ops of the cold-copy and fill cells (each then runs for ``min_time`` of puts).
FAULTING_MIN_OPS = 64


def _block(nbytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).view(np.uint16)


def _copyto(size: str, nbytes: int, min_ops: int, min_time: float) -> Result:
    """Copies into one destination, reused: it stays in the CPU cache (at 64 KiB - 1 MiB)."""
    src, dst = _block(nbytes), np.empty(nbytes // 2, np.uint16)
    lat, wall = time_sync(lambda: np.copyto(dst, src), min_ops=min_ops, min_time=min_time)
    return Result("core", "numpy copy into hot memory", size, lat, nbytes, wall)


def _warm_copy(size: str, nbytes: int, min_ops: int, min_time: float) -> Result:
    """Copies into a ring of 64 destinations touched beforehand: mapped pages, like a full
    tier's, but (from 1 MiB up) not in the CPU cache. The baseline of every put row."""
    src = _block(nbytes)
    ring = np.ones((RING, nbytes // 2), np.uint16)  # written once: every page is mapped
    slots = itertools.cycle(range(RING))
    lat, wall = time_sync(lambda: np.copyto(ring[next(slots)], src), min_ops=min_ops,
                          min_time=min_time)
    return Result("core", "numpy copy into warm memory", size, lat, nbytes, wall)


def _cold_copy(size: str, nbytes: int, min_ops: int, min_time: float) -> Result:
    """Copies into pages never touched before (a fresh mapping of 32 blocks at a time)."""
    src = _block(nbytes)
    ring = 32
    state: dict[str, object] = {"i": ring, "dst": None}

    def op() -> None:
        if state["i"] == ring:
            region = mmap.mmap(-1, ring * nbytes)
            state["dst"], state["i"] = np.frombuffer(region, np.uint16), 0
        i = state["i"]
        dst = state["dst"]
        assert isinstance(i, int) and isinstance(dst, np.ndarray)
        half = nbytes // 2
        np.copyto(dst[i * half:(i + 1) * half], src)
        state["i"] = i + 1

    lat, wall = time_sync(op, min_ops=min_ops, min_time=min_time)
    return Result("core", "numpy copy into cold memory", size, lat, nbytes, wall)


async def _fill(case: str, size: str, nbytes: int, make: Callable[[int], DRAMTier],
                min_ops: int, min_time: float) -> list[Result]:
    """Puts of new keys into fresh tiers of 32 blocks until each is full (GB/s of the puts
    alone), plus the rate at which the tiers were opened."""
    value = _block(nbytes)
    lat: list[float] = []
    opened: list[float] = []
    capacity = 32 * nbytes
    start = time.perf_counter()
    # Bounded by wall time: opening (prefault) and closing tiers count against the budget.
    while len(lat) < min_ops or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        tier = make(capacity)
        opened.append(time.perf_counter() - t0)
        for i in range(32):
            t0 = time.perf_counter()
            await tier.put(i.to_bytes(16, "big"), value)
            lat.append(time.perf_counter() - t0)
        await tier.aclose()
        del tier  # the last reference to its arena: unmapped here
    return [Result("core", f"dram put fill ({case})", size, lat, nbytes, sum(lat)),
            Result("core", f"dram open ({case})", size, opened, capacity, sum(opened))]


async def _full(case: str, size: str, nbytes: int, tier: DRAMTier, min_ops: int,
                min_time: float) -> Result:
    """Puts of new keys into a full tier: each evicts the least recent block."""
    value = _block(nbytes)
    keys = (i.to_bytes(16, "big") for i in itertools.count(1))
    while tier.used + nbytes <= (tier.capacity or 0):
        await tier.put(next(keys), value)
    lat, wall = await time_async(lambda: tier.put(next(keys), value), min_ops=min_ops,
                                 min_time=min_time)
    await tier.aclose()
    return Result("core", f"dram put full ({case})", size, lat, nbytes, wall)


async def _fills(size: str, nbytes: int, min_ops: int, min_time: float) -> list[Result]:
    out: list[Result] = []
    variants: dict[str, Callable[[int], DRAMTier]] = {
        "heap": lambda c: DRAMTier(capacity=c, arena=False),
        "arena, 4K pages": lambda c: DRAMTier(capacity=c, hugepages=False),
        "arena": lambda c: DRAMTier(capacity=c),
        "arena, 4K pages, prefault": lambda c: DRAMTier(capacity=c, prefault=True,
                                                        hugepages=False),
        "arena, prefault": lambda c: DRAMTier(capacity=c, prefault=True),
    }
    for case, make in variants.items():
        out.extend(await _fill(case, size, nbytes, make, min_ops, min_time))
    out.append(await _full("heap", size, nbytes,
                           DRAMTier(capacity=RING * nbytes, arena=False), min_ops, min_time))
    out.append(await _full("arena, 4K pages", size, nbytes,
                           DRAMTier(capacity=RING * nbytes, hugepages=False), min_ops, min_time))
    out.append(await _full("arena", size, nbytes, DRAMTier(capacity=RING * nbytes),
                           min_ops, min_time))
    return out


def _alloc_copy(size: str, nbytes: int, min_ops: int, min_time: float) -> Result:
    """A fresh copy per op (``np.array(src)``): what a put costs when it cannot reuse the
    memory of a dropped block (``DRAMTier.put`` reuses it once no reader holds it)."""
    src = _block(nbytes)
    keep: list[np.ndarray] = [src]

    def op() -> None:
        keep[0] = np.array(src, copy=True)  # the previous copy is freed, as on overwrite

    lat, wall = time_sync(op, min_ops=min_ops, min_time=min_time)
    return Result("core", "numpy alloc+copy (put floor)", size, lat, nbytes, wall)


async def _cells(size: str, nbytes: int, min_ops: int, min_time: float) -> list[Result]:
    value = _block(nbytes)
    results: list[Result] = []

    async def cell(case: str, fn: object) -> None:
        gc.collect()
        lat, wall = await time_async(fn, min_ops=min_ops, min_time=min_time)  # type: ignore[arg-type]
        results.append(Result("core", case, size, lat, nbytes, wall))

    tier = DRAMTier(capacity=64 * nbytes)
    await tier.put(KEY, value)
    await cell("dram tier get (hit, zero copy)", lambda: tier.get(KEY))
    await cell("dram tier put (overwrite)", lambda: tier.put(KEY, value))
    await tier.aclose()

    store = TieredStore([DRAMTier(capacity=64 * nbytes), DRAMTier(capacity=256 * nbytes)])
    await store.put(KEY, value)
    await cell("store get (top hit, zero copy)", lambda: store.get(KEY))
    await cell("store put (write_back)", lambda: store.put(KEY, value))
    await store.aclose()

    # KV events: a put of a new key into a full tier (BlockStored + BlockRemoved per put),
    # without and with a subscriber that reads nothing (its bounded buffer drops the oldest).
    events = TieredStore([DRAMTier(capacity=64 * nbytes)])
    fresh = (i.to_bytes(16, "big") for i in itertools.count(1))
    await cell("store put (new key, evicts)", lambda: events.put(next(fresh), value))
    sub = events.events(buffer=1024)
    await cell("store put (evicts, subscribed)", lambda: events.put(next(fresh), value))
    sub.close()
    await events.aclose()

    # A hit in the second tier without promotion: the cost of walking one tier further.
    walk = TieredStore([DRAMTier(capacity=64 * nbytes), DRAMTier(capacity=256 * nbytes)],
                       promote=1 << 30)
    await walk.tiers[1].put(KEY, value)
    await cell("store get (tier-2 hit, no promote)", lambda: walk.get(KEY))
    await walk.aclose()
    return results


def run(quick: bool) -> list[Result]:
    """Measure every cell; each row carries its ratio against the warm numpy copy.

    Parameters
    ----------
    quick
        Short runs (about 0.15 s per cell, one repeat) instead of 0.5 s x 3 repeats.
    """
    min_ops, min_time, repeats = (200, 0.15, 1) if quick else (1000, 0.5, 3)
    out: list[Result] = []
    for size, nbytes in SIZES.items():
        # Interleaved repeats: each round measures the baseline and every cell once.
        bases, hots, colds, floors, runs = [], [], [], [], []
        for _ in range(repeats):
            bases.append(_warm_copy(size, nbytes, min_ops, min_time))
            hots.append(_copyto(size, nbytes, min_ops, min_time))
            # Page-faulting cells are slow per op: a time budget, not an op count, bounds them.
            colds.append(_cold_copy(size, nbytes, FAULTING_MIN_OPS, min_time))
            floors.append(_alloc_copy(size, nbytes, min_ops, min_time))
            runs.append(asyncio.run(_fills(size, nbytes, FAULTING_MIN_OPS, min_time))
                        + asyncio.run(_cells(size, nbytes, min_ops, min_time)))
        base = median_of(bases)
        out.extend([base, with_ratio(median_of(hots), base), with_ratio(median_of(colds), base),
                    with_ratio(median_of(floors), base)])
        for column in zip(*runs, strict=True):
            result = median_of(column)
            out.append(result if result.case.startswith("dram open")
                       else with_ratio(result, base))
    return out


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    results = run(args.quick)
    print_table(results, "core: DRAM tier and TieredStore vs numpy copy into warm memory")
    return results, 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``)."""
    return main_for(_report, __doc__.splitlines()[0], argv, quick="short runs (CI smoke)")


if __name__ == "__main__":
    raise SystemExit(main())
