"""Filling a DRAM tier right after open, per prefault mode, against numpy memcpy.

``python -m benchmarks.bench_fill_after_open [--capacity-mib 256] [--block-mib 1]
[--rounds 5]``: each round opens a fresh ``dram://`` store per mode (``background``, the
default; ``0``; ``1``), puts ``capacity / block`` distinct blocks at once (no pause after
open, so the background prefault is still running), and times the fill. The baseline is
``np.copyto`` of the same blocks into warm memory in the same round. Prints medians over
the rounds and the ratio to memcpy (higher is better).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from kvtier import open_store

MiB = 1 << 20


async def _fill(mode: str, capacity: int, blocks: list[np.ndarray]) -> float:
    store = await open_store([f"dram://?capacity={capacity}&prefault={mode}"])
    try:
        start = time.perf_counter()
        for i, block in enumerate(blocks):
            await store.put(i.to_bytes(8, "big"), block)
        return time.perf_counter() - start
    finally:
        await store.aclose()


def _memcpy(blocks: list[np.ndarray]) -> float:
    warm = np.empty((len(blocks), blocks[0].nbytes), np.uint8)
    warm[:] = 1  # faulted in and warm before timing
    start = time.perf_counter()
    for i, block in enumerate(blocks):
        np.copyto(warm[i], block)
    return time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-mib", type=int, default=256)
    parser.add_argument("--block-mib", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    capacity = args.capacity_mib * MiB
    count = capacity // (args.block_mib * MiB)
    blocks = [np.full(args.block_mib * MiB, i % 251, np.uint8) for i in range(count)]
    modes = ("background", "0", "1")
    times: dict[str, list[float]] = {m: [] for m in ("memcpy", *modes)}
    for _ in range(args.rounds):
        times["memcpy"].append(_memcpy(blocks))
        for mode in modes:
            times[mode].append(await _fill(mode, capacity, blocks))
    base = statistics.median(times["memcpy"])
    total = count * args.block_mib
    print(f"{count} puts of {args.block_mib} MiB right after opening a "
          f"{args.capacity_mib} MiB dram:// store, medians of {args.rounds} rounds")
    print(f"{'case':<22}{'median s':>10}{'MiB/s':>10}{'x memcpy':>10}")
    for case, samples in times.items():
        median = statistics.median(samples)
        label = case if case == "memcpy" else f"prefault={case}"
        print(f"{label:<22}{median:>10.4f}{total / median:>10.0f}{base / median:>10.2f}")


if __name__ == "__main__":
    asyncio.run(main())
