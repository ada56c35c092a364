"""The pooling study behind ``docs/pooling-results.md``: for each trace and node count, one
pass feeds per-node (round-robin, session), pooled (each policy) and ideal-LRU simulations.

Run ``python -m kvtier.replay.study --out results.json TRACE...``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.progress import Progress
from kvtier.replay.dry import run_dry
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import iter_trace, trace_size

__all__ = ["collect_rows", "main", "markdown", "read_rows", "run_trace", "study"]


def _pooled(policy: str, nodes: int, cap: int) -> Simulation:
    # "lru+cascade": the policy, plus dropping a block's chained successors when it leaves.
    name, _, extra = policy.partition("+")
    return Simulation("pooled", "rr", name, nodes, [cap], cascade=extra == "cascade")


def study(trace: str, nodes: int, capacities: list[int], policies: list[str],
          progress: bool = True, baselines: bool = True) -> list[dict[str, Any]]:
    """Rows for one trace and node count."""
    sims: list[Simulation] = []
    for cap in capacities:
        if baselines:
            sims.append(Simulation("per-node", "rr", "lru", nodes, [cap]))
            sims.append(Simulation("per-node", "session", "lru", nodes, [cap]))
        sims += [_pooled(p, nodes, cap) for p in policies]
        if baselines:
            sims.append(Simulation("ideal", "none", "lru", nodes, [cap]))
    results = run_trace(trace, nodes, sims, progress)
    for row, sim in zip(results, sims, strict=True):
        row["trace"] = Path(trace).name
        if sim.cascade:
            row["policy"] += "+cascade"
    return results


def run_trace(trace: str, nodes: int, sims: Sequence[Simulation], progress: bool = True
              ) -> list[dict[str, Any]]:
    """One dry pass of ``trace`` through ``sims`` (block counts: ``block_bytes`` is 1), with a
    progress bar; one result row per simulation, in order."""
    bar = Progress(trace_size(trace), f"{Path(trace).name} N={nodes}",
                   enabled=None if progress else False)
    with bar:
        out = run_dry(iter_trace(trace, on_progress=lambda pos: bar.update(to=pos)), sims,
                      block_bytes=1)
    return list(out["results"])


def read_rows(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of earlier ``--out`` files, merged in order."""
    return [row for path in paths for row in json.loads(Path(path).read_text())]


def collect_rows(traces: Sequence[str], nodes: str, out: str | None,
                 rows_of: Callable[[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``rows_of(trace, n)`` for every trace and node count of ``nodes`` (comma-separated),
    after the rows already in ``out``; ``out`` is rewritten after each, so a long study
    interrupted keeps what it finished."""
    rows: list[dict[str, Any]] = []
    if out and Path(out).exists():
        rows = json.loads(Path(out).read_text())
    for trace in traces:
        for n in (int(x) for x in nodes.split(",")):
            rows += rows_of(trace, n)
            if out:
                Path(out).write_text(json.dumps(rows, indent=1))
    return rows


def markdown(rows: list[dict[str, Any]], policies: list[str]) -> str:
    """One table line per (trace, N, C): hit rates in percent, and whether the goal holds
    (best kvtier pooled policy >= ideal LRU - 1 point and >= per-node session)."""
    cells: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in rows:
        name = r["mode"] if r["mode"] != "per-node" else f"per-node {r['routing']}"
        if r["mode"] == "pooled":
            name = f"pooled {r['policy']}"
        key = (r["trace"], r["nodes"], r["capacity_blocks"])
        cells.setdefault(key, {})[name] = r["prefix_hit_rate_blocks"] * 100
    cols = ["per-node rr", "per-node session", *[f"pooled {p}" for p in policies], "ideal"]
    nan = float("nan")
    lines = ["| trace | N | C/node | " + " | ".join(cols) + " | best pooled - ideal | goal |",
             "|---|---:|---:|" + "---:|" * len(cols) + "---:|---|"]
    for (trace, n, c), vals in sorted(cells.items()):
        best = max(vals.get(f"pooled {p}", nan) for p in policies)
        ideal, session = vals.get("ideal", nan), vals.get("per-node session", nan)
        ok = best >= ideal - 1 and best >= session
        lines.append(f"| {trace} | {n} | {c} | "
                     + " | ".join(f"{vals.get(k, nan):.2f}" for k in cols)
                     + f" | {best - ideal:+.2f} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the table of earlier --out files (merged) and exit")
    parser.add_argument("--nodes", default="4,8")
    parser.add_argument("--capacity-blocks", default="1000,2500,10000")
    parser.add_argument("--policy", default="lru,s3fifo,arc")
    parser.add_argument("--out", help="append rows to this JSON file")
    parser.add_argument("--pooled-only", action="store_true",
                        help="skip the per-node and ideal baselines (add policies to a study)")
    args = parser.parse_args(argv)
    policies = args.policy.split(",")
    if args.table:
        print(markdown(read_rows(args.table), policies))
        return 0
    caps = [int(c) for c in args.capacity_blocks.split(",")]
    rows = collect_rows(args.traces, args.nodes, args.out,
                        lambda trace, n: study(trace, n, caps, policies,
                                               baselines=not args.pooled_only))
    print(markdown(rows, policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
