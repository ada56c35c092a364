"""GPU check of the HBM tier with the torch backend: copy speed and the tier chain.

1. put / get / get_into of 1 MiB and 16 MiB blocks through ``HBMTier`` (torch backend),
   as GB/s, each with a ratio against torch's raw ``copy_`` measured in the same run
   (pinned host memory, ``non_blocking=True`` then a sync; device-to-device for get_into
   into a device tensor). Target: >= 0.8x for the pinned rows.
2. The chain ``hbm:// -> dram:// -> lmdb://`` end to end: blocks put at the top are demoted
   down to LMDB by eviction, then read back (get and get_into a device tensor) and compared
   byte for byte.

Run ``python benchmarks/gpu_check.py`` (about a minute). Without CUDA it says so and exits
0; ``--allow-cpu`` runs the same code paths on CPU tensors as a smoke test. Exits 1 if a
block read back differs from what was written.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.common import (
    Result,
    main_for,
    median_of,
    print_table,
    time_async,
    time_sync,
    with_ratio,
)
from kvtier.store import TieredStore
from kvtier.testing.conformance import key_of
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.hbm import HBMTier
from kvtier.tiers.lmdb import LMDBTier

SIZES = {"1MiB": 1 << 20, "16MiB": 16 << 20}
TARGET = 0.8
REPEATS = 3


def _sync(torch: Any, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


async def _cell(case: str, label: str, nbytes: int, fn: Any, *, is_async: bool,
                min_time: float) -> Result:
    runs = []
    for _ in range(REPEATS):
        if is_async:
            lat, wall = await time_async(fn, min_ops=5, min_time=min_time)
        else:
            lat, wall = time_sync(fn, min_ops=5, min_time=min_time)
        runs.append(Result("gpu_check", case, label, lat, nbytes, wall))
    return median_of(runs)


async def copy_speed(torch: Any, device: str, min_time: float) -> tuple[list[Result], bool]:
    """Throughput rows for every size and whether every read-back matched."""
    results: list[Result] = []
    ok = True
    for label, nbytes in SIZES.items():
        rows, size_ok = await _size_rows(torch, device, label, nbytes, min_time)
        results += rows
        ok &= size_ok
    return results, ok


async def _size_rows(torch: Any, device: str, label: str, nbytes: int,
                     min_time: float) -> tuple[list[Result], bool]:
    cuda = device.startswith("cuda")
    tier = HBMTier(4 * nbytes, block_bytes=nbytes, backend="torch", device=device)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    pinned_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned = pinned_t.numpy()
    pinned[:] = data
    pinned_out_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned_out = pinned_out_t.numpy()
    pageable_out = np.empty(nbytes, np.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    key = key_of(1)

    def raw_h2d() -> None:
        dev.copy_(pinned_t, non_blocking=True)
        _sync(torch, cuda)

    def raw_d2h() -> None:
        pinned_out_t.copy_(dev, non_blocking=True)
        _sync(torch, cuda)

    def raw_d2d() -> None:
        dev_out.copy_(dev, non_blocking=True)
        _sync(torch, cuda)

    async def put_pinned() -> None:
        await tier.put(key, pinned)

    async def put_pageable() -> None:
        await tier.put(key, data)

    async def get() -> None:
        await tier.get(key)

    async def get_into_pinned() -> None:
        await tier.get_into(key, pinned_out)

    async def get_into_pageable() -> None:
        await tier.get_into(key, pageable_out)

    async def get_into_device() -> None:
        await tier.get_into(key, dev_out)

    base_h2d = await _cell("raw copy_ H2D (pinned)", label, nbytes, raw_h2d,
                           is_async=False, min_time=min_time)
    base_d2h = await _cell("raw copy_ D2H (pinned)", label, nbytes, raw_d2h,
                           is_async=False, min_time=min_time)
    base_d2d = await _cell("raw copy_ D2D", label, nbytes, raw_d2d,
                           is_async=False, min_time=min_time)
    results = [base_h2d, base_d2h, base_d2d]
    for case, fn, base in [
        ("kvtier put, pinned src", put_pinned, base_h2d),
        ("kvtier put, pageable src", put_pageable, base_h2d),
        ("kvtier get (-> new pinned array)", get, base_d2h),
        ("kvtier get_into pinned numpy", get_into_pinned, base_d2h),
        ("kvtier get_into pageable numpy", get_into_pageable, base_d2h),
        ("kvtier get_into device tensor", get_into_device, base_d2d),
    ]:
        results.append(with_ratio(await _cell(case, label, nbytes, fn, is_async=True,
                                              min_time=min_time), base))
    got = await tier.get(key)
    ok = got is not None and got.tobytes() == data.tobytes()
    ok &= pinned_out.tobytes() == data.tobytes() and pageable_out.tobytes() == data.tobytes()
    ok &= dev_out.cpu().numpy().tobytes() == data.tobytes()
    await tier.aclose()
    return results, ok


async def chain(torch: Any, device: str, workdir: str) -> tuple[list[str], bool]:
    """HBM (4 slots) -> DRAM (8 blocks) -> LMDB: 32 blocks of 1 MiB, demoted and read back."""
    nbytes, count = 1 << 20, 32
    hbm = HBMTier(4 * nbytes, block_bytes=nbytes, backend="torch", device=device)
    dram = DRAMTier(capacity=8 * nbytes)
    lmdb = LMDBTier.from_url(f"lmdb://{workdir}/chain?capacity=256MiB")
    blocks = {key_of(i): np.random.default_rng(i).standard_normal((2, 256, 1024))
              .astype(np.float16) for i in range(count)}
    ok = True
    lines = []
    async with TieredStore([hbm, dram, lmdb], promote="top") as store:
        start = time.perf_counter()
        for key, block in blocks.items():
            await store.put(key, block)
        put_s = time.perf_counter() - start
        where = [
            sum(await tier.contains_many(list(blocks))) for tier in (hbm, dram, lmdb)
        ]
        lines.append(f"after {count} puts of 1 MiB: hbm={where[0]} dram={where[1]} "
                     f"lmdb={where[2]} blocks ({put_s * 1e3:.1f} ms)")
        ok &= where[2] > 0 and sum(where) >= count
        out = torch.empty((2, 256, 1024), dtype=torch.float16, device=device)
        start = time.perf_counter()
        mismatches = 0
        for key, block in blocks.items():
            got = await store.get(key)
            if got is None or got.dtype != block.dtype or got.shape != block.shape \
                    or got.tobytes() != block.tobytes():
                mismatches += 1
            if not await store.get_into(key, out) or \
                    out.cpu().numpy().tobytes() != block.tobytes():
                mismatches += 1
        read_s = time.perf_counter() - start
        stats = store.stats()["tiers"]
        lines.append(f"read back {count} blocks (get + get_into device tensor): "
                     f"{mismatches} mismatches ({read_s * 1e3:.1f} ms)")
        lines.append("per tier: " + ", ".join(
            f"{t['scheme']} hits={t['hits']} promotions={t['promotions']} "
            f"demotions={t['demotions']} evictions={t['evictions']}" for t in stats))
        ok &= mismatches == 0
    return lines, ok


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed (pip install 'kvtier[torch]'); nothing to do")
        return [], 0
    if torch.cuda.is_available():
        device = "cuda:0"
        print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    elif args.allow_cpu:
        device = "cpu"
        torch.set_num_threads(1)  # the intra-op pool only adds wake-up latency to memcpy
        print(f"gpu_check: torch {torch.__version__}, no CUDA: CPU smoke run (--allow-cpu); "
              f"ratios say nothing about a GPU")
    else:
        print("gpu_check: no CUDA device; nothing to check (--allow-cpu for a CPU smoke run)")
        return [], 0
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-") as workdir:
        results, copies_ok = asyncio.run(copy_speed(torch, device, args.min_time))
        lines, chain_ok = asyncio.run(chain(torch, device, workdir))
    print_table(results, f"HBM tier (torch backend, {device}) vs raw torch copy_")
    pinned_rows = [r for r in results if r.ratio is not None and "pageable" not in r.case]
    misses = [f"{r.case} {r.size} {r.ratio:.2f}x" for r in pinned_rows
              if r.ratio is not None and r.ratio < TARGET]
    print(f"\ntarget >= {TARGET}x on pinned/device rows: "
          + ("met" if not misses else "missed by " + "; ".join(misses)))
    print("\n## chain hbm -> dram -> lmdb")
    for line in lines:
        print(line)
    print(f"\nbyte-identical: copies {'yes' if copies_ok else 'NO'}, "
          f"chain {'yes' if chain_ok else 'NO'}")
    return results, 0 if copies_ok and chain_ok else 1


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on CPU tensors when there is no CUDA device (smoke test)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds per measurement (each cell is the median of 3)")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--allow-cpu``, ``--min-time S``, ``--json FILE``)."""
    return main_for(_report, __doc__.splitlines()[0], argv, quick=None, options=_options)


if __name__ == "__main__":
    sys.exit(main())
