"""Core hot paths: DRAM tier and TieredStore get/put against numpy copyto of the same size.

Run ``python -m benchmarks.bench_core [--quick] [--json FILE]``. Every row's ratio is its
throughput over ``numpy.copyto`` of the same block size, measured in the same run (for a
zero-copy ``get`` the ratio says how many memcpys one get is worth, not a bandwidth).

Targets: a top-tier ``store.get`` hit at 64 KiB has p50 <= 5 us; ``store.put`` of 1 MiB
reaches >= 0.8x memcpy bandwidth. The two ``evicts`` store rows show what a KV-event
subscriber adds to a put (``store.events()``; without one nothing is emitted).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools

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


def _block(nbytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).view(np.uint16)


def _copyto(size: str, nbytes: int, min_ops: int, min_time: float) -> Result:
    src, dst = _block(nbytes), np.empty(nbytes // 2, np.uint16)
    lat, wall = time_sync(lambda: np.copyto(dst, src), min_ops=min_ops, min_time=min_time)
    return Result("core", "numpy.copyto (baseline)", size, lat, nbytes, wall)


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
    # New keys into a full tier: every put evicts the least recent block (the steady state
    # of a cache), so the copy lands in memory that is not in the CPU cache.
    keys = (i.to_bytes(16, "big") for i in itertools.count(1))
    await cell("dram tier put (new key, evicts)", lambda: tier.put(next(keys), value))

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
    """Measure every cell; each row carries its ratio against ``numpy.copyto``.

    Parameters
    ----------
    quick
        Short runs (about 0.15 s per cell, one repeat) instead of 0.5 s x 3 repeats.
    """
    min_ops, min_time, repeats = (200, 0.15, 1) if quick else (1000, 0.5, 3)
    out: list[Result] = []
    for size, nbytes in SIZES.items():
        base = median_of([_copyto(size, nbytes, min_ops, min_time) for _ in range(repeats)])
        floor = median_of([_alloc_copy(size, nbytes, min_ops, min_time)
                           for _ in range(repeats)])
        runs = [asyncio.run(_cells(size, nbytes, min_ops, min_time)) for _ in range(repeats)]
        out.extend([base, with_ratio(floor, base)])
        for column in zip(*runs, strict=True):
            out.append(with_ratio(median_of(column), base))
    return out


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    results = run(args.quick)
    print_table(results, "core: DRAM tier and TieredStore vs numpy.copyto")
    return results, 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``)."""
    return main_for(_report, __doc__.splitlines()[0], argv, quick="short runs (CI smoke)")


if __name__ == "__main__":
    raise SystemExit(main())
