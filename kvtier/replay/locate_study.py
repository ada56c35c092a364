"""The routing study behind ``docs/pooling-results.md`` ("Routing by where a prefix lives"):
for each trace and node count, one pass feeds per-node caches, the block pool and the local
pool under round-robin, session, locate, locate-live and owner routing (load as requests
routed so far: the counting model).

Run ``python -m kvtier.replay.locate_study --out routing.json TRACE...``; prints
Markdown tables (hit rate, remote blocks moved and read per request, load max/mean).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvtier.replay.routing import make_simulation, routing_metrics
from kvtier.replay.sim import Simulation
from kvtier.replay.study import collect_rows, read_rows, run_trace

__all__ = ["CONFIGS", "main", "markdown", "study"]

# (column name, mode, routing, placement); every configuration gets the same capacity.
CONFIGS: tuple[tuple[str, str, str, str], ...] = (
    ("per-node rr", "per-node", "rr", "block"),
    ("per-node session", "per-node", "session", "block"),
    ("per-node locate", "per-node", "locate", "block"),
    ("per-node locate-b", "per-node", "locate-bounded", "block"),
    ("pooled rr", "pooled", "rr", "block"),
    ("pooled locate", "pooled", "locate", "block"),
    ("pooled locate-b", "pooled", "locate-bounded", "block"),
    ("per-node locate-live", "per-node", "locate-live", "block"),
    ("local locate-b", "local", "locate-bounded", "local"),
    ("local locate-live", "local", "locate-live", "local"),
    ("local owner", "local", "owner", "local"),
)


def study(trace: str, nodes: int, capacities: list[int], progress: bool = True
          ) -> list[dict[str, Any]]:
    """Rows for one trace and node count (block counts: ``block_bytes`` is 1)."""
    sims: list[tuple[str, Simulation]] = []
    for cap in capacities:
        for name, mode, routing, _placement in CONFIGS:
            sims.append((name, make_simulation(mode, routing, "lru", nodes, [cap])))
    results = run_trace(trace, nodes, [s for _, s in sims], progress)
    rows = []
    for row, (name, sim) in zip(results, sims, strict=True):
        row.update(routing_metrics(sim, 1), trace=Path(trace).name, config=name)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """Tables keyed by (trace, N, C): hit %, remote blocks moved and read per request, load
    max/mean."""
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
    args = parser.parse_args(argv)
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
