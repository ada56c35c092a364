"""Filling a DRAM tier right after open, per prefault mode, against numpy memcpy.

``python -m benchmarks.bench_fill_after_open [--capacity-mib 256] [--block-mib 1]
[--rounds 5] [--delay 2]``: each round opens a fresh ``dram://`` store per case, puts
``capacity / block`` distinct blocks at once (no pause after open, so a background prefault
is still running) and times the fill; then times a refill (the same keys again: copies into
slots already faulted in, the steady state) and a read-back (``get`` and a copy out into
warm memory). Cases: the default (``prefault=background``), ``prefault=0``,
``prefault=1``, the default with ``hugepages=0``, and the default with the puts starting
``--delay`` seconds after open (the prefault done by then). Baselines in the same round:
``np.copyto`` of the same blocks into warm memory (``memcpy``), and the kernel zeroing a
fresh huge-page mapping of the capacity (``madvise(MADV_POPULATE_WRITE)``), the work any
put into fresh memory waits for. The last row is a fill's bound when no other core is free
to zero pages while the puts copy: the zeroing plus the default case's refill. Cases run in
a rotated order each round (the memory one case frees is what the next one maps). Prints
medians over the rounds, in MiB/s and as a ratio to memcpy (higher is better), and
``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import statistics
import subprocess
import time

import numpy as np

from kvtier import open_store
from kvtier.tiers.dram_arena import populate

MiB = 1 << 20
CASES = {"prefault=background (default)": "", "prefault=0": "&prefault=0",
         "prefault=1": "&prefault=1", "hugepages=0 (default 1)": "&hugepages=0",
         "default, puts {delay:g} s after open": "&delay"}


async def _fill(query: str, capacity: int, blocks: list[np.ndarray],
                delay: float) -> tuple[float, float, float]:
    """(fill, refill, read-back) seconds for one store."""
    wait = query.endswith("&delay")
    query = query.removesuffix("&delay")
    store = await open_store([f"dram://?capacity={capacity}{query}"])
    try:
        if wait:
            await asyncio.sleep(delay)
        keys = [i.to_bytes(8, "big") for i in range(len(blocks))]
        start = time.perf_counter()
        for key, block in zip(keys, blocks, strict=True):
            await store.put(key, block)
        fill = time.perf_counter() - start
        start = time.perf_counter()
        for key, block in zip(keys, blocks, strict=True):
            await store.put(key, block)
        refill = time.perf_counter() - start
        out = np.empty(blocks[0].nbytes, np.uint8)
        out[:] = 1
        start = time.perf_counter()
        for key in keys:
            got = await store.get(key)
            assert got is not None
            np.copyto(out, got)
        return fill, refill, time.perf_counter() - start
    finally:
        await store.aclose()


def _memcpy(blocks: list[np.ndarray]) -> float:
    warm = np.empty((len(blocks), blocks[0].nbytes), np.uint8)
    warm[:] = 1  # faulted in and warm before timing
    start = time.perf_counter()
    for i, block in enumerate(blocks):
        np.copyto(warm[i], block)
    return time.perf_counter() - start


def _zeroing(capacity: int) -> float:
    """Seconds the kernel takes to fault in (zero) ``capacity`` bytes of fresh memory on
    transparent huge pages, in one ``madvise`` call."""
    mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = np.frombuffer(mapping, np.uint8)
    start = time.perf_counter()
    if not populate(buffer):
        buffer[::mmap.PAGESIZE] = 0
    took = time.perf_counter() - start
    del buffer
    mapping.close()
    return took


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-mib", type=int, default=256)
    parser.add_argument("--block-mib", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay", type=float, default=2.0)
    args = parser.parse_args()
    print(_uptime())
    capacity = args.capacity_mib * MiB
    count = capacity // (args.block_mib * MiB)
    blocks = [np.full(args.block_mib * MiB, i % 251, np.uint8) for i in range(count)]
    cases = [name.format(delay=args.delay) for name in CASES]
    queries = dict(zip(cases, CASES.values(), strict=True))
    times: dict[str, list[tuple[float, float, float]]] = {c: [] for c in cases}
    memcpy: list[float] = []
    zeroing: list[float] = []
    for r in range(args.rounds):
        memcpy.append(_memcpy(blocks))
        zeroing.append(_zeroing(capacity))
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            times[case].append(await _fill(queries[case], capacity, blocks, args.delay))
    base = statistics.median(memcpy)
    total = count * args.block_mib
    print(f"{count} puts of {args.block_mib} MiB right after opening a "
          f"{args.capacity_mib} MiB dram:// store, medians of {args.rounds} rounds")
    print(f"{'case':<34}{'fill MiB/s':>11}{'x memcpy':>9}{'refill x':>9}{'get x':>7}")
    print(f"{'memcpy into warm memory':<34}{total / base:>11.0f}{1:>9.2f}")
    zero = statistics.median(zeroing)
    print(f"{'kernel zeroing (fresh huge pages)':<34}{total / zero:>11.0f}{base / zero:>9.2f}")
    for case, samples in times.items():
        fill, refill, read = (statistics.median(s[i] for s in samples) for i in range(3))
        print(f"{case:<34}{total / fill:>11.0f}{base / fill:>9.2f}{base / refill:>9.2f}"
              f"{base / read:>7.2f}")
    # A fill with no free core to zero pages on: each put waits for the kernel to zero its
    # pages, then copies at the steady-state (refill) rate of the default case.
    serial = zero + statistics.median(s[1] for s in times[cases[0]])
    print(f"{'bound, no free core: zero + refill':<34}{total / serial:>11.0f}"
          f"{base / serial:>9.2f}")
    # The two fills of one round ran within seconds of each other, so their ratio cancels
    # most of the box's drift between rounds.
    paired = sorted(off[0] / default[0] for default, off in
                    zip(times[cases[0]], times[cases[1]], strict=True))
    print(f"default fill / prefault=0 fill, paired per round: median "
          f"{statistics.median(paired):.2f} (min {paired[0]:.2f}, max {paired[-1]:.2f})")
    print(_uptime())


if __name__ == "__main__":
    asyncio.run(main())
