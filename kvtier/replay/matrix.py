"""The hit-rate matrix of issue 15 (``docs/pooling-results.md``): for each trace and node count,
one pass over the trace feeds the baselines (per-node caches with sticky session routing under
each policy, the ideal global cache) and the pooled candidates, at every capacity.

A pooled candidate is written ``POLICY[+cascade][+notail][@hybrid:P:ROUTING]``: a shard policy
name (see :data:`kvtier.replay.sim.POLICIES`), ``+cascade`` drops a leaving block's chained
successors, ``+notail`` never admits a request's trailing partial block (a real engine hashes
full blocks only, so that block is never extended and never read again), and
``@hybrid:P:ROUTING`` gives each node a private LRU tier of P % of C above the pool (requests
routed ``rr`` or ``session``). Every block of the pool is placed by its own key. Every row has
the same total memory: N x C blocks.

Run ``python -m kvtier.replay.matrix --out m.json TRACE...`` (``--jobs 2`` runs two (trace, N)
passes at once); ``--table m.json`` prints the tables again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.replay.dry import run_dry
from kvtier.replay.hybrid import HybridSimulation
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import BLOCK_TOKENS, Request, iter_trace

__all__ = ["DEFAULT_CANDIDATES", "cell_table", "main", "parse_candidate", "rank_candidates",
           "rows_of_replay", "run_matrix"]

DEFAULT_CANDIDATES = ("lru", "s3fifo", "arc", "lru+cascade", "s3fifo+cascade", "arc+cascade")
SESSION_POLICIES = ("lru", "s3fifo", "arc")
# How far under the target a candidate may be and still meet the goal (points).
SLACK = 0.5


def parse_candidate(spec: str) -> dict[str, Any]:
    """``POLICY[+cascade][+notail][@hybrid:P:ROUTING]`` as keyword arguments for
    :class:`Simulation` plus ``notail`` and ``placement`` (``block`` or the hybrid spec)."""
    body, _, placement = spec.partition("@")
    policy, *flags = body.split("+")
    unknown = set(flags) - {"cascade", "notail"}
    hybrid = placement.split(":")
    if unknown or not policy or (placement and (len(hybrid) != 3 or hybrid[0] != "hybrid"
                                                or not hybrid[1].isdigit())):
        raise ValueError("candidate: expected POLICY[+cascade][+notail][@hybrid:P:ROUTING], "
                         f"got {spec!r}")
    return {"policy": policy, "cascade": "cascade" in flags, "notail": "notail" in flags,
            "placement": placement or "block"}


class _NoTail:
    """Feeds a simulation each request without its trailing partial block; the block still
    counts as a (missed) reference, so rates stay comparable with the baselines."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def feed(self, req: Request, keys: Sequence[bytes]) -> None:
        if keys and req.input_length % BLOCK_TOKENS:
            self.sim.feed(req, keys[:-1])
            self.sim.blocks += 1
        else:
            self.sim.feed(req, keys)

    def result(self, block_bytes: int) -> dict[str, Any]:
        return self.sim.result(block_bytes)


def _pass(trace: str, nodes: int, capacities: Sequence[int], candidates: Sequence[str],
          limit: int | None, baselines: bool) -> list[dict[str, Any]]:
    sims: list[Any] = []
    names: list[str] = []
    for cap in capacities:
        for policy in SESSION_POLICIES if baselines else ():
            sims.append(Simulation("per-node", "session", policy, nodes, [cap]))
            names.append(f"session {policy}")
        for policy in SESSION_POLICIES if baselines else ():
            sims.append(Simulation("ideal", "none", policy, nodes, [cap]))
            names.append(f"ideal {policy}")
        for spec in candidates:
            kw = parse_candidate(spec)
            if kw["placement"].startswith("hybrid:"):
                _, share, routing = kw["placement"].split(":")
                private = max(1, cap * int(share) // 100)
                sims.append(HybridSimulation(routing, kw["policy"], nodes, private, cap - private))
                names.append(f"pooled {spec}")
                continue
            sim = Simulation("pooled", "rr", kw["policy"], nodes, [cap], cascade=kw["cascade"])
            sims.append(_NoTail(sim) if kw["notail"] else sim)
            names.append(f"pooled {spec}")
    out = run_dry(_limited(iter_trace(trace), limit), sims, block_bytes=1)
    rows = []
    for name, row in zip(names, out["results"], strict=True):
        row["trace"] = Path(trace).name
        row["config"] = name
        row["elapsed_s"] = out["elapsed_s"]
        rows.append(row)
    return rows


def _limited(requests: Iterable[Request], limit: int | None) -> Iterable[Request]:
    for i, req in enumerate(requests):
        if limit is not None and i >= limit:
            return
        yield req


def run_matrix(traces: Sequence[str], nodes: Sequence[int], capacities: Sequence[int],
               candidates: Sequence[str], *, jobs: int = 1, limit: int | None = None,
               baselines: bool = True) -> list[dict[str, Any]]:
    """Rows for every (trace, N, C, configuration); ``jobs`` passes run in parallel.
    ``baselines=False`` runs the candidates only (merge with an earlier run's rows)."""
    for spec in candidates:
        parse_candidate(spec)
    work = [(t, n) for t in traces for n in nodes]
    if jobs <= 1:
        parts = [_pass(t, n, capacities, candidates, limit, baselines) for t, n in work]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(_pass, t, n, capacities, candidates, limit, baselines)
                       for t, n in work]
            parts = [f.result() for f in futures]
    return [row for part in parts for row in part]


def rows_of_replay(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Matrix rows from a ``kvtier replay --dry --json`` report (per-node session, ideal and
    pooled rows; the baselines of :func:`run_matrix`)."""
    rows = []
    for r in report["results"]:
        kind = {"per-node": "session", "ideal": "ideal", "pooled": "pooled"}[r["mode"]]
        if kind == "session" and r["routing"] != "session":
            continue
        rows.append({**r, "trace": Path(report["trace"]).name, "config": f"{kind} {r['policy']}"})
    return rows


def _load(path: str) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return rows_of_replay(data) if isinstance(data, dict) else list(data)


def cell_table(rows: Sequence[dict[str, Any]], default: str,
               candidates: Sequence[str] | None = None) -> str:
    """One Markdown table per trace: baselines, the best pooled candidate, ``default``, the
    target (best of per-node session with its best policy and ideal LRU) and whether
    ``default`` reaches the target minus :data:`SLACK` points."""
    cells: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["nodes"], r["capacity_blocks"]), {})[r["config"]] = (
            100 * r["prefix_hit_rate_blocks"])
    out: list[str] = []
    for trace in sorted({k[0] for k in cells}):
        out += [f"\n{trace}\n",
                "| N | C/node | session best | ideal lru | ideal best | pooled best | "
                f"`{default}` | target | `{default}` - target | goal |",
                "|---:|---:|---|---:|---|---|---:|---:|---:|---|"]
        met = total = 0
        for (t, n, c), v in sorted(cells.items()):
            if t != trace:
                continue
            sess = max((v[f"session {p}"], p) for p in SESSION_POLICIES)
            ideal = max((v[f"ideal {p}"], p) for p in SESSION_POLICIES)
            pooled = [(x, k[7:]) for k, x in v.items() if k.startswith("pooled ")
                      and (candidates is None or k[7:] in candidates)]
            best = max(pooled)
            mine = v.get(f"pooled {default}", float("nan"))
            target = max(sess[0], v["ideal lru"])
            ok = mine >= target - SLACK
            met += ok
            total += 1
            out.append(f"| {n} | {c} | {sess[0]:.2f} ({sess[1]}) | {v['ideal lru']:.2f} | "
                       f"{ideal[0]:.2f} ({ideal[1]}) | {best[0]:.2f} ({best[1]}) | {mine:.2f} | "
                       f"{target:.2f} | {mine - target:+.2f} | {'yes' if ok else 'no'} |")
        out.append(f"\ngoal met in {met} of {total} cells")
    return "\n".join(out)


def rank_candidates(rows: Sequence[dict[str, Any]]) -> str:
    """Every pooled configuration measured in all cells of ``rows``: in how many cells it
    reaches the target minus :data:`SLACK`, and its worst and summed shortfall (points)."""
    cells: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["nodes"], r["capacity_blocks"]), {})[r["config"]] = (
            100 * r["prefix_hit_rate_blocks"])
    targets = {k: max(max(v[f"session {p}"] for p in SESSION_POLICIES), v["ideal lru"])
               for k, v in cells.items()}
    configs = {c[7:] for v in cells.values() for c in v if c.startswith("pooled ")}
    ranked = []
    for c in configs:
        gaps = [v[f"pooled {c}"] - targets[k] for k, v in cells.items() if f"pooled {c}" in v]
        if len(gaps) == len(cells):
            ranked.append((sum(g >= -SLACK for g in gaps), sum(min(g, 0.0) for g in gaps),
                           min(gaps), c))
    lines = [f"| pooled configuration | cells meeting the goal (of {len(cells)}) | worst gap | "
             "summed shortfall |", "|---|---:|---:|---:|"]
    for met, short, worst, c in sorted(ranked, key=lambda t: (-t[0], -t[1])):
        lines.append(f"| `{c}` | {met} | {worst:+.2f} | {short:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--nodes", default="4,8")
    parser.add_argument("--capacity-blocks", default="1000,2500,10000")
    parser.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES),
                        help="pooled configurations, comma-separated")
    parser.add_argument("--default", default="lru", help="the configuration the goal column "
                        "judges")
    parser.add_argument("--jobs", type=int, default=1, help="(trace, N) passes run at once")
    parser.add_argument("--limit", type=int, default=None, help="replay only N requests")
    parser.add_argument("--out", help="write the rows to this JSON file")
    parser.add_argument("--no-baselines", action="store_true",
                        help="run the candidates only (merge baselines with --table)")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the tables of earlier --out files (merged) and exit")
    args = parser.parse_args(argv)
    if args.table:
        rows = [row for path in args.table for row in _load(path)]
        print(cell_table(rows, args.default))
        print()
        print(rank_candidates(rows))
        return 0
    if not args.traces:
        parser.error("give TRACE files (or --table)")
    rows = run_matrix(args.traces, [int(x) for x in args.nodes.split(",")],
                      [int(c) for c in args.capacity_blocks.split(",")],
                      args.candidates.split(","), jobs=args.jobs, limit=args.limit,
                      baselines=not args.no_baselines)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if not args.no_baselines:
        print(cell_table(rows, args.default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
