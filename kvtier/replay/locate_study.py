"""The routing study behind ``docs/pooling-results.md`` ("Routing by where a prefix lives"):
for each trace and node count, one pass feeds per-node and pooled simulations under
round-robin, session, locate and owner routing, with per-block, chunk and anchor placement.

Run ``python -m kvtier.replay.locate_study --out routing.json TRACE...``; prints
Markdown tables (hit rate, remote blocks moved and read per request, load max/mean, shard
balance).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.peer.ring import HashRing
from kvtier.replay.chainplace import ChainPlacement
from kvtier.replay.dry import block_key
from kvtier.replay.routing import make_simulation, routing_metrics
from kvtier.replay.sim import DEFAULT_POOL_VNODES, Simulation
from kvtier.replay.study import collect_rows, read_rows, run_trace
from kvtier.replay.trace import iter_trace

__all__ = ["CONFIGS", "main", "markdown", "shard_balance", "study"]

# (column name, mode, routing, placement); every configuration gets the same capacity.
CONFIGS: tuple[tuple[str, str, str, str], ...] = (
    ("per-node rr", "per-node", "rr", "block"),
    ("per-node session", "per-node", "session", "block"),
    ("per-node locate", "per-node", "locate", "block"),
    ("per-node locate-b", "per-node", "locate-bounded", "block"),
    ("pooled rr", "pooled", "rr", "block"),
    ("pooled locate", "pooled", "locate", "block"),
    ("pooled locate-b", "pooled", "locate-bounded", "block"),
    ("chunk:16 rr", "pooled", "rr", "chunk:16"),
    ("chunk:16 locate-b", "pooled", "locate-bounded", "chunk:16"),
    ("chunk:64 locate-b", "pooled", "locate-bounded", "chunk:64"),
    ("anchor:1 locate-b", "pooled", "locate-bounded", "anchor:1"),
    ("anchor:1 owner", "pooled", "owner", "anchor:1"),
    ("anchor:1:64 owner", "pooled", "owner", "anchor:1:64"),
    ("anchor:1:256 owner", "pooled", "owner", "anchor:1:256"),
)


def study(trace: str, nodes: int, capacities: list[int], progress: bool = True
          ) -> list[dict[str, Any]]:
    """Rows for one trace and node count (block counts: ``block_bytes`` is 1)."""
    sims: list[tuple[str, Simulation]] = []
    for cap in capacities:
        for name, mode, routing, placement in CONFIGS:
            sims.append((name, make_simulation(mode, routing, "lru", nodes, [cap],
                                               placement=placement)))
    results = run_trace(trace, nodes, [s for _, s in sims], progress)
    rows = []
    for row, (name, sim) in zip(results, sims, strict=True):
        row.update(routing_metrics(sim, 1), trace=Path(trace).name, config=name)
        rows.append(row)
    return rows


def shard_balance(trace: str, nodes: int,
                  placements: Sequence[str] = ("block", "chunk:16", "chunk:64"),
                  vnodes: int = DEFAULT_POOL_VNODES) -> dict[str, float]:
    """Per placement, the largest shard's distinct blocks over the mean: every request's
    blocks are counted once on each owner its placement puts them on (a head shared by
    chains anchored on different shards counts once per shard, as it is stored)."""
    ring = HashRing([f"node{i}" for i in range(nodes)], vnodes=vnodes)
    index = {m: i for i, m in enumerate(ring.members)}
    owner_of: dict[bytes, int] = {}
    chains = {p: ChainPlacement(p) for p in placements}
    held: dict[str, set[tuple[int, int]]] = {p: set() for p in placements}
    for req in iter_trace(trace):
        keys = [block_key(h) for h in req.hash_ids]
        for placement, chain in chains.items():
            seen = held[placement]
            for block, where in zip(req.hash_ids, chain.placement_keys(keys), strict=True):
                owner = owner_of.get(where)
                if owner is None:
                    owner = owner_of[where] = index[ring.primary(where)]
                seen.add((owner, block))
    out = {}
    for placement, pairs in held.items():
        counts = [0] * nodes
        for owner, _ in pairs:
            counts[owner] += 1
        out[placement] = max(counts) / (sum(counts) / nodes) if pairs else 0.0
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """Tables keyed by (trace, N, C): hit %, remote blocks moved and read per request, load
    max/mean; then shard balance per placement."""
    cells: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["nodes"], r["capacity_blocks"]), {})[r["config"]] = r
    cols = [c[0] for c in CONFIGS]
    out = []
    for title, field, scale, digits in (
            ("prefix hit rate (% of blocks)", "prefix_hit_rate_blocks", 100, 2),
            ("remote blocks moved per request (read + write)", "remote_bytes_per_request", 1, 1),
            ("of which remote blocks read per request (on the request's critical path)",
             "remote_read_bytes_per_request", 1, 1),
            ("load balance (max/mean requests per node)", "load_imbalance", 1, 2)):
        out += [f"**{title}**", "",
                "| trace | N | C/node | " + " | ".join(cols) + " |",
                "|---|---:|---:|" + "---:|" * len(cols)]
        for (trace, n, c), vals in sorted(cells.items()):
            out.append(f"| {trace} | {n} | {c} | "
                       + " | ".join(f"{vals[k][field] * scale:.{digits}f}" if k in vals else "-"
                                    for k in cols) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the tables of earlier --out files (merged) and exit")
    parser.add_argument("--nodes", default="4,8")
    parser.add_argument("--capacity-blocks", default="1000,2500")
    parser.add_argument("--out", help="append rows to this JSON file")
    parser.add_argument("--shards", action="store_true",
                        help="print the shard balance of each placement per trace and exit")
    parser.add_argument("--placements", default="block,chunk:16,chunk:64",
                        help="placements --shards compares")
    parser.add_argument("--vnodes", type=int, default=DEFAULT_POOL_VNODES,
                        help="virtual nodes per member for --shards")
    args = parser.parse_args(argv)
    if args.shards:
        placements = args.placements.split(",")
        print("| trace | N | " + " | ".join(placements) + " |\n|---|---:|"
              + "---:|" * len(placements))
        for trace in args.traces:
            for n in (int(x) for x in args.nodes.split(",")):
                bal = shard_balance(trace, n, placements, args.vnodes)
                print(f"| {Path(trace).name} | {n} | "
                      + " | ".join(f"{bal[p]:.3f}" for p in placements) + " |")
        return 0
    if args.table:
        print(markdown(read_rows(args.table)))
        return 0
    caps = [int(c) for c in args.capacity_blocks.split(",")]
    rows = collect_rows(args.traces, args.nodes, args.out,
                        lambda trace, n: study(trace, n, caps))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
