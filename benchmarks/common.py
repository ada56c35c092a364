"""Shared timing, statistics and table printing for kvtier benchmarks.

Every benchmark prints medians (this machine is noisy) and a ratio against a baseline
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}


@dataclass
class Result:
    """One benchmark cell: ``nbytes`` moved per op, latencies of ``ops`` operations."""

    bench: str
    case: str
    size: str
    latencies_s: list[float] = field(repr=False)
    nbytes: int
    wall_s: float
    concurrency: int = 1
    baseline: str | None = None
    ratio: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ops(self) -> int:
        return len(self.latencies_s)

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.wall_s if self.wall_s else 0.0

    @property
    def gbps(self) -> float:
        return self.ops * self.nbytes / self.wall_s / 1e9 if self.wall_s else 0.0

    def pct(self, q: float) -> float:
        lat = sorted(self.latencies_s)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

    def row(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "latencies_s"}
        out.update(ops=self.ops, ops_per_s=round(self.ops_per_s, 1), gbps=round(self.gbps, 3),
                   p50_us=round(self.pct(0.5) * 1e6, 1), p99_us=round(self.pct(0.99) * 1e6, 1))
        return out


def time_sync(
    fn: Callable[[], object], *, min_ops: int, min_time: float
) -> tuple[list[float], float]:
    """Run ``fn`` until both ``min_ops`` and ``min_time`` are reached; per-op latencies + wall."""
    lat: list[float] = []
    start = time.perf_counter()
    while len(lat) < min_ops or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return lat, time.perf_counter() - start


async def time_async(fn: Callable[[], Awaitable[object]], *, min_ops: int, min_time: float,
                     concurrency: int = 1) -> tuple[list[float], float]:
    """Like :func:`time_sync` for a coroutine function, with ``concurrency`` workers."""
    import asyncio

    lat: list[float] = []
    start = time.perf_counter()

    async def worker() -> None:
        while len(lat) < min_ops or time.perf_counter() - start < min_time:
            t0 = time.perf_counter()
            await fn()
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, time.perf_counter() - start


async def time_op_pool(make_op: Callable[[int], Callable[[], Awaitable[object]]],
                       concurrency: int, min_time: float) -> tuple[list[float], float]:
    """Time ``concurrency`` workers that each hold one op (``make_op(worker)``) at a time,
    after one warm-up call of each (connections open, caches hot): an op wrapping a raw
    connection serves one request at a time."""
    ops = [make_op(w) for w in range(concurrency)]
    for op in ops:
        await op()
    free = list(ops)

    async def run() -> None:
        op = free.pop()
        try:
            await op()
        finally:
            free.append(op)

    return await time_async(run, min_ops=max(5, concurrency * 2), min_time=min_time,
                            concurrency=concurrency)


def median_of(runs: Sequence[Result]) -> Result:
    """The run with the median throughput (repeat cells, quote the median)."""
    ordered = sorted(runs, key=lambda r: r.gbps)
    return ordered[len(ordered) // 2]


def with_ratio(result: Result, baseline: Result) -> Result:
    """Attach the throughput ratio against ``baseline`` (same run)."""
    result.baseline = f"{baseline.case}"
    result.ratio = result.gbps / baseline.gbps if baseline.gbps else None
    return result


def with_second_ratio(result: Result, baseline: Result) -> Result:
    """Also record the ratio against a second same-run baseline (printed after the first)."""
    if baseline.gbps:
        result.extra["also"] = f"{result.gbps / baseline.gbps:.2f}x {baseline.case}"
    return result


def print_table(results: Sequence[Result], title: str) -> None:
    """Print a fixed-width table of results."""
    print(f"\n## {title}")
    header = (f"{'case':<34} {'size':>6} {'conc':>4} {'ops/s':>10} {'GB/s':>8} "
              f"{'p50 us':>9} {'p99 us':>9} {'ratio':>7}  baseline")
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        print(f"{r.case:<34} {r.size:>6} {r.concurrency:>4} {r.ops_per_s:>10.0f} "
              f"{r.gbps:>8.2f} {r.pct(0.5) * 1e6:>9.1f} {r.pct(0.99) * 1e6:>9.1f} {ratio:>7}  "
              f"{r.baseline or ''}{'; ' + r.extra['also'] if 'also' in r.extra else ''}")


def dump_json(results: Sequence[Result], path: str) -> None:
    """Write results as a JSON list of rows."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([r.row() for r in results], fh, indent=1)


def main_for(report: Callable[[argparse.Namespace], tuple[Sequence[Result], int]],
             description: str, argv: Sequence[str] | None = None, *,
             quick: str | None = "short cells (smoke run)",
             options: Callable[[argparse.ArgumentParser], object] | None = None) -> int:
    """Command-line entry point of a benchmark: parse ``--quick`` and ``--json FILE`` (plus
    the benchmark's own ``options``), call ``report(args)``, which runs, prints and returns
    ``(results, exit status)``, then write the results as JSON if asked.

    ``quick`` is the help of ``--quick``, or ``None`` for a benchmark without one. A report
    that measured nothing (no device, say) writes no JSON file.
    """
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", metavar="FILE", help="also write the result rows as JSON")
    if options is not None:
        options(parser)
    args = parser.parse_args(argv)
    results, status = report(args)
    if args.json and results:
        dump_json(results, args.json)
    return status


def median(values: Sequence[float]) -> float:
    """Median of ``values``."""
    return statistics.median(values)
