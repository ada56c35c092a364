"""The matrix of issue 23 (``docs/pooling-results.md``, "One pool against per-node caches
behind a router"): for each trace and node count, one pass feeds per-node caches with sticky
session routing and with locate-bounded routing (each under every policy), one ideal global
LRU of N x C blocks, the pool with block placement routed round-robin, and the pool with
chain placement routed to each chain's owner (with and without bounded-load spill).

Every row has the same total memory (N x C blocks). Per cell it reports the prefix hit rate,
the remote blocks moved per request (pool reads of remote shards plus writes of new blocks to
remote owners), the busiest node's requests over the mean and, for pooled rows, the largest
shard's written blocks over the mean, and judges each pooled
candidate against the goal: hit rate >= max(per-node session best, per-node locate-bounded
best, ideal LRU) - :data:`SLACK` points, blocks moved <= :data:`MOVED_SHARE` of pooled
round-robin's, busiest node <= :data:`LOAD_LIMIT` times the mean.

Run ``python -m kvtier.replay.pool_matrix --out m.json TRACE...``; ``--table m.json`` prints
the tables again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.replay.dry import run_dry
from kvtier.replay.routing import make_simulation, routing_metrics
from kvtier.replay.sim import Simulation
from kvtier.replay.study import collect_rows, read_rows
from kvtier.replay.trace import Request, iter_trace

__all__ = ["BASELINE_POLICIES", "CANDIDATES", "LOAD_LIMIT", "MOVED_SHARE", "SLACK", "Config",
           "cell_rows", "configs", "main", "markdown", "run_pass"]

BASELINE_POLICIES = ("lru", "s3fifo", "arc")
# The pool's segment policy in every pooled row: what ``kvtier serve`` gives its segments.
POOL_POLICY = "arc"
SLACK = 0.5  # points under the best baseline a candidate may be
MOVED_SHARE = 0.5  # of pooled round-robin's remote blocks per request
LOAD_LIMIT = 1.25  # busiest node's requests over the mean


@dataclass(frozen=True)
class Config:
    """One row of a cell: its family (``name``) and the simulation it stands for."""

    name: str
    mode: str
    routing: str
    policy: str
    placement: str = "block"
    spill: float | None = None

    @property
    def label(self) -> str:
        """``name`` with the policy, for the JSON rows."""
        return f"{self.name} [{self.policy}]"


# Pooled candidates judged against the goal: chain placement with owner routing, plain (also
# under LRU, the policy of the first anchored measurements), with bounded-load spill at two
# epsilons, and with long chains split every 128 or 256 blocks, each run spilled on its own.
CANDIDATES: tuple[Config, ...] = (
    Config("anchor:1 owner", "pooled", "owner", POOL_POLICY, "anchor:1"),
    Config("anchor:1 owner", "pooled", "owner", "lru", "anchor:1"),
    Config("anchor:1 owner spill 0.1", "pooled", "owner", POOL_POLICY, "anchor:1", 0.1),
    Config("anchor:1 owner spill 0.25", "pooled", "owner", POOL_POLICY, "anchor:1", 0.25),
    Config("anchor:1:128 owner spill 0.1", "pooled", "owner", POOL_POLICY, "anchor:1:128",
           0.1),
    Config("anchor:1:256 owner spill 0.1", "pooled", "owner", POOL_POLICY, "anchor:1:256",
           0.1),
)


def configs(baseline_policies: Sequence[str] = BASELINE_POLICIES,
            candidates: Sequence[Config] = CANDIDATES) -> list[Config]:
    """Every row of one cell: the baselines, pooled round-robin, then ``candidates``."""
    rows = [Config("per-node session", "per-node", "session", p) for p in baseline_policies]
    rows += [Config("per-node locate-b", "per-node", "locate-bounded", p)
             for p in baseline_policies]
    rows.append(Config("ideal", "ideal", "rr", "lru"))
    rows.append(Config("pooled rr", "pooled", "rr", POOL_POLICY))
    return rows + list(candidates)


def _simulation(config: Config, nodes: int, capacity: int) -> Simulation:
    return make_simulation(config.mode, config.routing, config.policy, nodes, [capacity],
                           placement=config.placement, spill=config.spill)


def _limited(requests: Iterable[Request], limit: int | None) -> Iterable[Request]:
    for i, req in enumerate(requests):
        if limit is not None and i >= limit:
            return
        yield req


def run_pass(trace: str, nodes: int, capacities: Sequence[int], rows: Sequence[Config],
             limit: int | None = None) -> list[dict[str, Any]]:
    """One dry pass of ``trace`` (its first ``limit`` requests) through every configuration at
    every capacity; one result row each (block counts: remote "bytes" are blocks)."""
    sims = [(config, _simulation(config, nodes, cap)) for cap in capacities for config in rows]
    out = run_dry(_limited(iter_trace(trace), limit), [s for _, s in sims], block_bytes=1)
    results = []
    for (config, sim), row in zip(sims, out["results"], strict=True):
        row.update(routing_metrics(sim, 1), trace=Path(trace).name, config=config.label,
                   family=config.name, elapsed_s=out["elapsed_s"], limit=limit)
        results.append(row)
    return results


def _best(cell: dict[str, dict[str, Any]], family: str) -> dict[str, Any] | None:
    found = [r for r in cell.values() if r["family"] == family]
    return max(found, key=lambda r: r["prefix_hit_rate_blocks"]) if found else None


def cell_rows(cell: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """One cell's table lines: (row name, result row, goal verdict), baselines first (the
    per-node families at their best policy), then every other pooled configuration.

    A pooled candidate's verdict is ``yes`` when it meets all three parts of the goal, else
    the parts it misses (``hit``, ``moved``, ``load``); baselines get ``-``, and candidates
    of a run without the baselines or ``pooled rr`` (``--only``) ``?``.
    """
    base = [_best(cell, f) for f in ("per-node session", "per-node locate-b", "ideal")]
    target = max((100 * r["prefix_hit_rate_blocks"] for r in base if r is not None),
                 default=None)
    rr = _best(cell, "pooled rr")
    lines: list[tuple[str, dict[str, Any], str]] = []
    for row in [*base, rr]:
        if row is not None:
            lines.append((f"{row['family']} ({row['policy']})", row, "-"))
    for row in cell.values():
        if row["family"] in ("per-node session", "per-node locate-b", "ideal", "pooled rr"):
            continue
        if target is None or rr is None:  # a run without the baselines: nothing to judge
            lines.append((f"{row['family']} ({row['policy']})", row, "?"))
            continue
        misses = []
        if 100 * row["prefix_hit_rate_blocks"] < target - SLACK:
            misses.append("hit")
        if row["remote_bytes_per_request"] > MOVED_SHARE * rr["remote_bytes_per_request"]:
            misses.append("moved")
        if row["load_imbalance"] > LOAD_LIMIT:
            misses.append("load")
        verdict = "yes" if not misses else "no (" + ", ".join(misses) + ")"
        lines.append((f"{row['family']} ({row['policy']})", row, verdict))
    return lines


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One Markdown table per trace (lines per N, C and configuration), then per pooled
    candidate the number of cells meeting the goal."""
    cells: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["nodes"], r["capacity_blocks"]), {})[r["config"]] = r
    out: list[str] = []
    met: dict[str, list[int]] = {}
    for trace in sorted({k[0] for k in cells}):
        out += [f"### `{trace}`", "",
                "| N | C/node | configuration | hit % | target - hit | blocks moved / request "
                "| busiest / mean | largest shard / mean | goal |",
                "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        for (t, n, c), cell in sorted(cells.items()):
            if t != trace:
                continue
            lines = cell_rows(cell)
            target = max((100 * row["prefix_hit_rate_blocks"] for _, row, v in lines
                          if v == "-" and row["mode"] != "pooled"), default=float("nan"))
            for name, row, verdict in lines:
                hit = 100 * row["prefix_hit_rate_blocks"]
                shard = row.get("shard_write_imbalance")
                out.append(f"| {n} | {c} | {name} | {hit:.2f} | {target - hit:+.2f} | "
                           f"{row['remote_bytes_per_request']:.1f} | "
                           f"{row['load_imbalance']:.2f} | "
                           f"{'-' if shard is None else f'{shard:.2f}'} | {verdict} |")
                if verdict not in ("-", "?"):
                    tally = met.setdefault(name, [0, 0])
                    tally[0] += verdict == "yes"
                    tally[1] += 1
        out.append("")
    out += ["| pooled candidate | cells meeting the goal |", "|---|---:|"]
    out += [f"| {name} | {ok} of {total} |" for name, (ok, total) in met.items()]
    limits = sorted({r["limit"] for r in rows if r.get("limit")})
    if limits:
        out += ["", f"(first {', '.join(map(str, limits))} requests of each trace only)"]
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
                        help="policies the per-node rows try (each family shows its best)")
    parser.add_argument("--only", metavar="NAMES",
                        help="run only these configurations (comma-separated row names, "
                        "e.g. 'pooled rr,anchor:1 owner'); the goal needs the baselines")
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
