"""A hit through the host daemon (``local://``) against one ``np.copyto`` of its bytes.

Starts ``kvtier serve --shm NAME`` (a subprocess, stopped at the end), waits for its arena's
prefault (and this process's page tables for it), saves a hit of each size as blocks of
``--block`` bytes, then times, interleaved, ``store.get_many_into`` of the
whole hit into preallocated buffers and a numpy memcpy of the same bytes between two warm
buffers of this process (the floor: what one copy costs here). Also times a save, and
presence of 16 and 128 keys read from the daemon's shared index against the same question
as a call on its socket (aiohttp, and ``http.client`` as the vLLM scheduler used to), and the
vLLM connector's worker on the daemon hook by hook (:mod:`benchmarks.local_worker`: a hit's
``start_load_kv``, a save's ``wait_for_save`` and commit, the keying of a plan).

Run ``python -m benchmarks.bench_local [--repeats 9] [--block 4MiB] [--lookups-only]
[--worker-only]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvtier
from benchmarks.local_worker import worker_rows
from kvtier.integrations.vllm_local import LocalLookups
from kvtier.shm.sync_client import SyncLocalClient
from kvtier.tiers.local import LocalTier
from kvtier.urls import parse_size

REPO = Path(__file__).resolve().parents[1]
SIZES = {"16MiB": 16 << 20, "256MiB": 256 << 20}


def _start_daemon(name: str, capacity: str) -> subprocess.Popen[str]:
    log = Path(tempfile.gettempdir()) / f"bench-local-{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "serve", "--listen", "127.0.0.1:0",
             "--insecure-no-auth", "--tier", f"dram://?capacity={capacity}", "--shm", name],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "listening" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("daemon did not start:\n" + log.read_text())
        time.sleep(0.05)
    return proc


def _median_of(repeats: int, call: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _amedian_of(repeats: int, call: Callable[[], Awaitable[object]]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _lookups(store: kvtier.TieredStore, tier: LocalTier, name: str, repeats: int
                   ) -> list[tuple[str, float, float]]:
    """Presence of 16 and 128 stored keys: the shared index against a socket call, each
    through the async tier and through the vLLM scheduler's synchronous path."""
    rows: list[tuple[str, float, float]] = []
    lookups = LocalLookups(f"local://{name}?timeout=30")
    sync = SyncLocalClient(name, timeout=30)
    for n in (16, 128):
        keys = [secrets.token_bytes(16) for _ in range(n)]
        await store.put_many((k, np.zeros(4096, np.uint8)) for k in keys)
        hexed = [k.hex() for k in keys]
        if await tier.contains_many(keys) != [True] * n or lookups.lookup_prefix(keys) != n:
            raise RuntimeError("the index does not show the keys just saved")
        def index_async(k: list[bytes] = keys) -> Awaitable[list[bool]]:
            return tier.contains_many(k)

        def socket_async(h: list[str] = hexed) -> Awaitable[dict[str, Any]]:
            return tier._client.call("/v1/contains", {"keys": h})

        def index_sync(k: list[bytes] = keys) -> int:
            return lookups.lookup_prefix(k)

        def socket_sync(h: list[str] = hexed) -> dict[str, Any]:
            return sync.call("/v1/lookup", {"keys": h})

        rows += [
            (f"contains_many({n} keys): shared index, async tier",
             await _amedian_of(repeats, index_async), 0.0),
            (f"contains_many({n} keys): socket call, aiohttp client",
             await _amedian_of(repeats, socket_async), 0.0),
            (f"lookup_prefix({n} keys): shared index, vLLM scheduler's",
             _median_of(repeats, index_sync), 0.0),
            (f"lookup_prefix({n} keys): /v1/lookup, http.client (vLLM's)",
             _median_of(repeats, socket_sync), 0.0)]
        await store.delete_many(keys)
    lookups.close()
    sync.close()
    return rows


async def _run(name: str, repeats: int, block: int, lookups_only: bool, worker_only: bool
               ) -> list[tuple[str, float, float]]:
    rows = []
    async with await kvtier.open_store([f"local://{name}?timeout=30"]) as store:
        tier = store.tiers[0]
        if not isinstance(tier, LocalTier):
            raise TypeError("expected the local:// tier")
        # The daemon's arena prefault, then this process's page tables for it, finish first
        # (the daemon only reports its state: there is nothing to wait on but its answer).
        for _ in range(1200):
            if (await tier.daemon_stats())["prefaulted"]:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        if worker_only:
            return await asyncio.to_thread(worker_rows, name, repeats, SIZES)
        for label, total in ({} if lookups_only else SIZES).items():
            n = total // block
            src = [np.random.default_rng(i).integers(0, 255, block, np.uint8) for i in range(n)]
            keys = [secrets.token_bytes(16) for _ in range(n)]
            t0 = time.perf_counter()
            await store.put_many(zip(keys, src, strict=True))
            save = time.perf_counter() - t0
            outs = [np.ones(block, np.uint8) for _ in range(n)]
            floor_src = np.ones(total, np.uint8)
            floor_dst = np.zeros(total, np.uint8)
            hit, copy = [], []
            for _ in range(repeats):  # interleaved, so load drifts hit both alike
                t0 = time.perf_counter()
                got = await store.get_many_into(keys, outs)
                hit.append(time.perf_counter() - t0)
                if not all(got):
                    raise RuntimeError(f"{label}: {got.count(False)} blocks missed")
                t0 = time.perf_counter()
                np.copyto(floor_dst, floor_src)
                copy.append(time.perf_counter() - t0)
            if any(o.tobytes() != s.tobytes() for o, s in zip(outs, src, strict=True)):
                raise RuntimeError(f"{label}: wrong bytes")
            base = statistics.median(copy)
            rows.append((f"{label} hit: local:// get_many_into ({n} x {block >> 20} MiB)",
                         statistics.median(hit), statistics.median(hit) / base))
            rows.append((f"{label}: np.copyto of the same bytes (floor)", base, 1.0))
            rows.append((f"{label} save: local:// put_many (first, once)", save, save / base))
            await store.delete_many(keys)
        rows += await _lookups(store, tier, name, max(repeats, 200))
    if not lookups_only:
        rows += await asyncio.to_thread(worker_rows, name, repeats, SIZES)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--block", default="4MiB", help="block size (default 4MiB)")
    parser.add_argument("--lookups-only", action="store_true",
                        help="time presence lookups only (no hits or saves)")
    parser.add_argument("--worker-only", action="store_true",
                        help="time the vLLM connector's worker on the daemon only")
    args = parser.parse_args(argv)
    name = f"bench-{secrets.token_hex(4)}"
    proc = _start_daemon(name, "768MiB")
    try:
        rows = asyncio.run(_run(name, args.repeats, parse_size(args.block, "--block"),
                                args.lookups_only, args.worker_only))
    finally:
        proc.terminate()
        proc.wait(30)
    load = os.getloadavg()[0]
    print(f"local:// vs np.copyto, medians of {args.repeats} interleaved repeats, "
          f"load average {load:.2f}, {os.cpu_count()} CPUs")
    print(f"| {'case':<58} | {'median (ms)':>11} | {'x copyto':>8} |")
    print(f"|{'-' * 60}|{'-' * 13}|{'-' * 10}|")
    for label, seconds, ratio in rows:
        ratio_text = f"{ratio:.2f}" if ratio else ""
        print(f"| {label:<58} | {seconds * 1e3:>11.4f} | {ratio_text:>8} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
