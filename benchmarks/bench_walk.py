"""The read walk's cost on the miss path: gets of keys no member holds, with the walk past
"not here" (``read_walk=1``, the default) against stopping at the owners (``read_walk=0``,
the old behaviour), same pool, same run.

    python -m benchmarks.bench_walk [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from benchmarks.common import Result, main_for, print_table, time_async, with_ratio
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.tiers.dram import DRAMTier

TOKEN = "bench-walk"


async def _run(quick: bool) -> list[Result]:
    servers = [PeerServer(DRAMTier(), token=TOKEN, close_segment=True) for _ in range(4)]
    for s in servers:
        await s.start()
    members = ",".join(s.member_id for s in servers)
    results: list[Result] = []
    counter = iter(range(1 << 62))  # every key asked once: all misses
    seconds = 1.0 if quick else 4.0
    try:
        for walk in (0, 1):
            url = f"peers://{members}?token={TOKEN}&replicas=2&read_walk={walk}&timeout=5"
            async with PeerTier.from_url(url) as tier:
                async def one_miss(tier: PeerTier = tier) -> None:
                    await tier.get(next(counter).to_bytes(16, "big"))

                async def batch_miss(tier: PeerTier = tier) -> None:
                    await tier.get_many([next(counter).to_bytes(16, "big") for _ in range(32)])

                for case, fn, conc in (("get miss", one_miss, 8),
                                       ("get_many(32) miss", batch_miss, 4)):
                    lat, wall = await time_async(fn, min_ops=50, min_time=seconds,
                                                 concurrency=conc)
                    results.append(Result("walk", f"{case}, read_walk={walk}", "-", lat, 0,
                                          wall, conc))
    finally:
        for s in servers:
            await s.stop()
    for base, walked in ((results[0], results[2]), (results[1], results[3])):
        with_ratio(walked, base)
        # No bytes move on a miss: compare operations per second instead of GB/s.
        walked.ratio = walked.ops_per_s / base.ops_per_s if base.ops_per_s else None
    return results


def run(quick: bool = False) -> list[Result]:
    """Miss-path throughput with and without the walk (ratio: walked / owners only)."""
    return asyncio.run(_run(quick))


def _report(args: argparse.Namespace) -> tuple[Sequence[Result], int]:
    results = run(quick=args.quick)
    print_table(results, "read walk: misses, replicas=2 over 4 members")
    return results, 0


def main(argv: list[str] | None = None) -> int:
    return main_for(_report, __doc__ or "", argv)


if __name__ == "__main__":
    raise SystemExit(main())
