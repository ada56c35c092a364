"""The goal study of issue 29 (``docs/pooling-results.md``, "The local pool against a live
router"): for each trace and node count, one timed pass (``--load inflight``, the GPU-class
cost model of :mod:`kvtier.replay.timed`) feeds per-node caches under every router (rr,
session, locate-bounded, locate-live) and policy, the block pool (every block on its ring
owner) routed round-robin, one ideal global LRU of N x C blocks, and the local pool (blocks
where they were computed, read from any holder, last copies forwarded by global age) routed
by locate-live.

Every row has the same total memory (N x C blocks). Per cell it reports the prefix hit rate,
the remote blocks moved per request (reads from another node plus writes to another node),
the busiest node's busy time over the mean, and modelled TTFT p50/p90; each pooled candidate
is judged against the goal: hit rate >= max(per-node best router and policy, block pool,
ideal LRU) - :data:`SLACK` points, blocks moved <= :data:`MOVED_SHARE` of the block pool's,
busiest node <= :data:`LOAD_LIMIT` times the mean.

Run ``python -m kvtier.replay.pool_matrix --out m.json TRACE...``; ``--table m.json`` prints
the tables again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.replay.dry import run_dry
from kvtier.replay.routing import make_simulation, routing_metrics
from kvtier.replay.sim import Simulation
from kvtier.replay.study import collect_rows, read_rows
from kvtier.replay.timed import GPU_ENGINE, CostModel, NodeClock
from kvtier.replay.trace import Request, iter_trace

__all__ = ["BASELINE_POLICIES", "BASELINE_ROUTINGS", "CANDIDATES", "LOAD_LIMIT", "LOCAL_DEFAULT",
           "MOVED_SHARE", "SLACK", "Config", "cell_rows", "configs", "main", "markdown",
           "run_pass"]

BASELINE_POLICIES = ("lru", "s3fifo", "arc")
BASELINE_ROUTINGS = ("rr", "session", "locate-bounded", "locate-live")
# The block pool's segment policy: what ``kvtier serve`` gives its segments.
POOL_POLICY = "arc"
SLACK = 0.5  # points under the best baseline a candidate may be
MOVED_SHARE = 1 / 3  # of the block pool's remote blocks per request
LOAD_LIMIT = 1.25  # busiest node's busy time over the mean
BASELINES = ("per-node", "block pool", "ideal")


@dataclass(frozen=True)
class Config:
    """One row of a cell: its family (``name``) and the simulation it stands for."""

    name: str
    mode: str
    routing: str
    policy: str
    options: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def label(self) -> str:
        """``name`` with the policy, for the JSON rows."""
        return f"{self.name} [{self.policy}]"


# The default pooled configuration (the local pool's defaults in kvtier.replay.local).
LOCAL_DEFAULT = Config("local pool locate-live", "local", "locate-live", "lru")
# Measured alternatives, to show what each part of the default buys.
CANDIDATES: tuple[Config, ...] = (
    LOCAL_DEFAULT,
    Config("local pool, GMS forwarding (margin 0)", "local", "locate-live", "lru",
           (("forward_margin", 0.0),)),
    Config("local pool, no hot moves", "local", "locate-live", "lru", (("hot_reads", 0),)),
)


def configs(baseline_policies: Sequence[str] = BASELINE_POLICIES,
            candidates: Sequence[Config] = CANDIDATES) -> list[Config]:
    """Every row of one cell: the baselines, then ``candidates``."""
    rows = [Config(f"per-node {routing}", "per-node", routing, p)
            for routing in BASELINE_ROUTINGS for p in baseline_policies]
    rows.append(Config("block pool", "pooled", "rr", POOL_POLICY))
    rows.append(Config("ideal", "ideal", "rr", "lru"))
    return rows + list(candidates)


def _family(row: dict[str, Any]) -> str:
    name: str = row["family"]
    return "per-node" if name.startswith("per-node") else name


def _simulation(config: Config, nodes: int, capacity: int, cost: CostModel) -> Simulation:
    return make_simulation(config.mode, config.routing, config.policy, nodes, [capacity],
                           clock=NodeClock(nodes, cost), **dict(config.options))


def _limited(requests: Iterable[Request], limit: int | None) -> Iterable[Request]:
    for i, req in enumerate(requests):
        if limit is not None and i >= limit:
            return
        yield req


def run_pass(trace: str, nodes: int, capacities: Sequence[int], rows: Sequence[Config],
             limit: int | None = None, cost: CostModel = GPU_ENGINE) -> list[dict[str, Any]]:
    """One timed dry pass of ``trace`` (its first ``limit`` requests) through every
    configuration at every capacity; one result row each (remote "bytes" are blocks)."""
    sims = [(config, _simulation(config, nodes, cap, cost)) for cap in capacities
            for config in rows]
    out = run_dry(_limited(iter_trace(trace), limit), [s for _, s in sims], block_bytes=1)
    results = []
    for (config, sim), row in zip(sims, out["results"], strict=True):
        row.update(routing_metrics(sim, 1), trace=Path(trace).name, config=config.label,
                   family=config.name, elapsed_s=out["elapsed_s"], limit=limit)
        results.append(row)
    return results


def _best(cell: dict[str, dict[str, Any]], family: str) -> dict[str, Any] | None:
    found = [r for r in cell.values() if _family(r) == family]
    return max(found, key=lambda r: r["prefix_hit_rate_blocks"]) if found else None


def cell_rows(cell: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """One cell's table lines: (row name, result row, goal verdict): the best per-node router
    and policy, the block pool, ideal LRU, then every per-node router at its best policy, then
    every candidate.

    A candidate's verdict is ``yes`` when it meets all three parts of the goal, else the parts
    it misses (``hit``, ``moved``, ``load``); baselines get ``-``, and candidates of a run
    without the baselines (``--only``) ``?``.
    """
    base = [_best(cell, f) for f in BASELINES]
    target = (max(100 * r["prefix_hit_rate_blocks"] for r in base if r is not None)
              if all(r is not None for r in base) else None)
    pool = base[1]
    lines: list[tuple[str, dict[str, Any], str]] = []
    for row in base:
        if row is not None:
            lines.append((f"{row['family']} ({row['policy']})", row, "-"))
    shown = {id(r) for r in base if r is not None}
    routers: dict[str, dict[str, Any]] = {}
    for row in cell.values():
        if _family(row) == "per-node":
            best = routers.get(row["family"])
            if best is None or row["prefix_hit_rate_blocks"] > best["prefix_hit_rate_blocks"]:
                routers[row["family"]] = row
    for row in routers.values():
        if id(row) not in shown:
            lines.append((f"{row['family']} ({row['policy']})", row, "-"))
    for row in cell.values():
        if _family(row) in BASELINES:
            continue
        name = f"{row['family']} ({row['policy']})"
        if target is None or pool is None:
            lines.append((name, row, "?"))
            continue
        misses = []
        if 100 * row["prefix_hit_rate_blocks"] < target - SLACK:
            misses.append("hit")
        if row["remote_bytes_per_request"] > MOVED_SHARE * pool["remote_bytes_per_request"]:
            misses.append("moved")
        if row["load_imbalance"] > LOAD_LIMIT:
            misses.append("load")
        lines.append((name, row, "yes" if not misses else "no (" + ", ".join(misses) + ")"))
    return lines


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One Markdown table per trace (lines per N, C and configuration), then per candidate
    the number of cells meeting the goal."""
    cells: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["nodes"], r["capacity_blocks"]), {})[r["config"]] = r
    out: list[str] = []
    met: dict[str, list[int]] = {}
    for trace in sorted({k[0] for k in cells}):
        out += [f"### `{trace}`", "",
                "| N | C/node | configuration | hit % | hit - target | blocks moved / request "
                "| busiest / mean | TTFT p50 s | TTFT p90 s | goal |",
                "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        for (t, n, c), cell in sorted(cells.items()):
            if t != trace:
                continue
            lines = cell_rows(cell)
            target = max((100 * row["prefix_hit_rate_blocks"] for _, row, v in lines
                          if v == "-"), default=float("nan"))
            for name, row, verdict in lines:
                hit = 100 * row["prefix_hit_rate_blocks"]
                out.append(f"| {n} | {c} | {name} | {hit:.2f} | {hit - target:+.2f} | "
                           f"{row['remote_bytes_per_request']:.1f} | "
                           f"{row['load_imbalance']:.2f} | {row.get('ttft_p50_s', 0.0):.2f} | "
                           f"{row.get('ttft_p90_s', 0.0):.2f} | {verdict} |")
                if verdict not in ("-", "?"):
                    tally = met.setdefault(name, [0, 0])
                    tally[0] += verdict == "yes"
                    tally[1] += 1
        out.append("")
    out += ["| pooled candidate | cells meeting the goal |", "|---|---:|"]
    out += [f"| {name} | {ok} of {total} |" for name, (ok, total) in met.items()]
    limits = sorted({r["limit"] for r in rows if r.get("limit")})
    if limits:
        out += ["", f"(first {', '.join(map(str, limits))} requests of a trace where a limit "
                "applied; see each row's `limit` in the JSON)"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--nodes", default="4,8")
    parser.add_argument("--capacity-blocks", default="1000,2500,10000")
    parser.add_argument("--limit", type=int, default=None,
                        help="replay only the first N requests of each trace")
    parser.add_argument("--baseline-policies", default=",".join(BASELINE_POLICIES),
                        help="policies the per-node rows try (each router shows its best)")
    parser.add_argument("--only", metavar="NAMES",
                        help="run only these configurations (comma-separated row names, "
                        "e.g. 'block pool,local pool locate-live'); the goal needs the "
                        "baselines")
    parser.add_argument("--out", help="append rows to this JSON file (rewritten after each "
                        "trace and N, so an interrupted run keeps what it finished)")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the tables of earlier --out files (merged) and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown(read_rows(args.table)))
        return 0
    if not args.traces:
        parser.error("give TRACE files (or --table)")
    caps = [int(c) for c in args.capacity_blocks.split(",")]
    rows_of = configs(args.baseline_policies.split(","))
    if args.only:
        names = set(args.only.split(","))
        rows_of = [c for c in rows_of if c.name in names]
        if not rows_of:
            parser.error(f"--only: no configuration named {args.only!r}")
    rows = collect_rows(args.traces, args.nodes, args.out,
                        lambda trace, n: run_pass(trace, n, caps, rows_of, args.limit))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
