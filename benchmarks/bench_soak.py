"""`kvtier bench --only soak`: the peer pool's chaos soak (see benchmarks/soak.py).

Quick: 25 s with a fault every 6 s; ``--full``: 180 s with a fault every 15 s. Prints the
soak table and returns put/get latency rows (no same-run baseline: the soak's figures are
counts of failures, which must be 0).
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.common import Result
from benchmarks.soak import options, soak, table


def run(quick: bool = False) -> list[Result]:
    """Run the soak; raise if it lost, corrupted or raised anything it should not have."""
    parser = argparse.ArgumentParser()
    options(parser)
    args = parser.parse_args(["--duration", "25", "--chaos-interval", "6"] if quick else [])
    result = asyncio.run(soak(args))
    print(table(result), flush=True)
    tally = result["tally"]
    wall = float(result["wall"])  # type: ignore[arg-type]
    rows = [Result("soak", "put under chaos (ack=all, R=2)", f"{args.block_bytes >> 10}KiB",
                   tally.put_lat, args.block_bytes, wall, args.concurrency),  # type: ignore[attr-defined]
            Result("soak", "get under chaos", f"{args.block_bytes >> 10}KiB",
                   tally.get_lat, args.block_bytes, wall, args.concurrency)]  # type: ignore[attr-defined]
    lost = (int(result["unreadable"]) - int(result["excused"])  # type: ignore[call-overload]
            - int(result["budget"]))  # type: ignore[call-overload]
    behind = int(result["behind"])  # type: ignore[call-overload]
    bad = lost + int(result["wrong"]) + behind + tally.put_errors + tally.get_errors  # type: ignore[attr-defined, call-overload]
    if bad:
        raise RuntimeError(f"soak: {lost} avoidable losses, {result['wrong']} wrong blocks, "
                           f"{behind} keys long-lived clients missed, "
                           f"{tally.put_errors + tally.get_errors} exceptions")  # type: ignore[attr-defined]
    return rows
