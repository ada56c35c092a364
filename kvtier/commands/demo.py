"""``kvtier demo``: what pooling buys, at equal total memory, under the timed load model.

N nodes (default 4), every row with the same memory (C blocks per node), the built-in
synthetic agentic workload (or ``--trace``), replayed once through every row by the timed dry
replay (:mod:`kvtier.replay.timed`): each node serves its requests in arrival order with a
service time from the cost model, so routers see in-flight work and hit rates turn into
modelled TTFT. Rows: per-node caches routed round-robin, by session and by ``locate-live``;
the block pool (every block on its ring owner); the local pool (blocks kept where they were
computed, read from any holder, last copies forwarded by global age); one ideal global LRU.
Hit rates are counts from the project's policy classes; no bytes move and no model runs
(``kvtier replay --real`` moves real bytes through real tiers and peer servers).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

from kvtier.errors import ConfigError
from kvtier.replay.trace import BLOCK_TOKENS, Request

NAME = "demo"
HELP = ("show what pooling buys at equal memory, in under a minute: per-node caches "
        "(rr, session, locate-live) vs the block pool vs the local pool vs one ideal LRU, "
        "hit rate, bytes moved and modelled TTFT under a timed load model")

# (label, mode, routing, policy): every row has the same nodes, memory and cost model.
ROWS = (("per-node rr", "per-node", "rr", "lru"),
        ("per-node session", "per-node", "session", "lru"),
        ("per-node locate-live", "per-node", "locate-live", "lru"),
        ("block pool", "pooled", "rr", "lru"),
        ("local pool", "local", "locate-live", "lru"),
        ("ideal global LRU", "ideal", "none", "lru"))
LABEL_WIDTH = max(len(label) for label, *_ in ROWS)
# A Llama-3.1-8B-class model in bf16: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x
# 2 bytes = 128 KiB of KV per token (docs/performance.md, "Fetch vs recompute").
KV_BYTES_PER_TOKEN = 128 << 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier demo``."""
    parser.add_argument("--quick", action="store_true",
                        help="a smaller workload (a few seconds), what the test suite runs")
    parser.add_argument("--trace", metavar="FILE", help="replay a Mooncake-format trace instead")
    parser.add_argument("--limit", type=int, default=None,
                        help="--trace: replay only its first N requests (default 3000)")
    parser.add_argument("--nodes", type=int, default=4, help="nodes (default 4)")
    parser.add_argument("--capacity-blocks", type=int, default=None, metavar="C",
                        help="blocks per node, every row (default 100; 1000 with --trace)")
    parser.add_argument("--engine", choices=("gpu", "cpu"), default="gpu",
                        help="cost model: a GPU-class engine (default) or bench_engine's "
                             "measured CPU engine (see docs/replay.md)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=KV_BYTES_PER_TOKEN,
                        help="KV bytes per token for the bytes-moved column (default 131072, "
                             "Llama-3.1-8B bf16)")
    parser.add_argument("--no-progress", action="store_true",
                        help="accepted for compatibility; the demo prints no progress bar")


def _load(args: argparse.Namespace) -> list[Request]:
    from kvtier.replay.trace import iter_trace
    from kvtier.workload import WorkloadConfig, generate

    if args.trace:
        limit = args.limit if args.limit is not None else (300 if args.quick else 3000)
        return list(iter_trace(args.trace, limit=limit))
    cfg = WorkloadConfig(sessions=16 if args.quick else 48, concurrency=6 if args.quick else 16)
    requests = generate(cfg)
    return list(requests if args.limit is None else itertools.islice(requests, args.limit))


def replay_rows(requests: list[Request], args: argparse.Namespace
                ) -> list[tuple[str, dict[str, Any]]]:
    """One timed pass of ``requests`` through every row; ``(label, result row)`` each.

    Raises
    ------
    ConfigError
        If ``--nodes``, ``--capacity-blocks``, ``--limit`` or ``--kv-bytes-per-token`` is not
        positive.
    """
    from kvtier.replay.dry import run_dry
    from kvtier.replay.routing import make_simulation, routing_metrics
    from kvtier.replay.timed import CPU_ENGINE, GPU_ENGINE, NodeClock

    capacity = args.capacity_blocks if args.capacity_blocks is not None else (
        1000 if args.trace else 100)
    for name, value in (("--nodes", args.nodes), ("--capacity-blocks", capacity),
                        ("--kv-bytes-per-token", args.kv_bytes_per_token),
                        ("--limit", 1 if args.limit is None else args.limit)):
        if value < 1:
            raise ConfigError(f"{name}: expected >= 1, got {value}")
    cost = CPU_ENGINE if args.engine == "cpu" else GPU_ENGINE
    block_bytes = BLOCK_TOKENS * args.kv_bytes_per_token
    sims = [make_simulation(mode, routing, policy, args.nodes, [capacity],
                            clock=NodeClock(args.nodes, cost))
            for _, mode, routing, policy in ROWS]
    out = run_dry(requests, sims, block_bytes=block_bytes)
    results = []
    for (label, *_), sim, row in zip(ROWS, sims, out["results"], strict=True):
        if sim.mode != "ideal":
            row.update(routing_metrics(sim, block_bytes))
        row.setdefault("remote_bytes_per_request", 0.0)
        results.append((label, row))
    return results


def format_table(results: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    """The table, its legend and the summary lines."""
    w = LABEL_WIDTH
    header = (f"{'configuration':<{w}} {'hit(blk)':>8} {'hit(tok)':>8} {'remote':>7} "
              f"{'MB moved/req':>12} {'busiest/mean':>12} {'TTFT p50 s':>10} {'p90 s':>7}")
    lines = [header, "-" * len(header)]
    for label, row in results:
        remote = "-" if row["remote_share"] is None else f"{row['remote_share'] * 100:.0f}%"
        lines.append(
            f"{label:<{w}} {row['prefix_hit_rate_blocks'] * 100:>7.1f}% "
            f"{row['prefix_hit_rate_tokens'] * 100:>7.1f}% {remote:>7} "
            f"{row['remote_bytes_per_request'] / 1e6:>12.1f} {row['load_imbalance']:>12.2f} "
            f"{row['ttft_p50_s']:>10.2f} {row['ttft_p90_s']:>7.2f}")
    cost = results[0][1]["cost_model"]
    kv_kib = args.kv_bytes_per_token / 1024
    lines += [
        "",
        "legend:",
        "  hit(blk)      share of requested blocks found as a cached prefix (on any node the",
        "                row can read)",
        "  hit(tok)      the same weighted by prompt tokens (a request's last block may be "
        "partial)",
        "  remote        share of hit blocks read from another node",
        "  MB moved/req  bytes crossing the network per request (remote reads, writes to "
        "another node)",
        f"                at {BLOCK_TOKENS} tokens x {kv_kib:,.0f} KiB of KV per token per "
        "block",
        "  busiest/mean  busiest node's busy time (sum of its requests' service times) over "
        "the mean",
        "  TTFT          modelled: queue wait + step + prefill of uncached tokens + fetch of "
        "remote blocks",
        "routing (what decides which node serves a request):",
        "  rr              round-robin",
        "  session         every request of a session on the node its first one went to",
        "  locate-bounded  the node holding the longest prefix of the prompt itself, among "
        "nodes whose",
        "                  load is within 1.25x the mean (not a row here: see kvtier replay)",
        "  locate-live     the node with the best prefix share minus 0.5 x its relative queue "
        "depth",
        "                  (llm-d's precise prefix scorer plus its queue scorer)",
        "  owner           the node owning (block pool) or holding (local pool) the longest "
        "prefix by",
        "                  the ring or the holder directory, without asking (not a row here)",
        "rows:",
        "  per-node      each node caches only what it computed and reads only its own cache",
        "  block pool    every block on its ring owner, any node reads any block (rr routing)",
        "  local pool    blocks stay on the node that computed them, a directory knows the "
        "holders, any",
        "                node reads any block; an evicted last copy moves to a node with older "
        "blocks",
        "  ideal         one LRU of all nodes' memory, no bytes moved (an upper bound)",
        f"cost model ({args.engine}): prefill {cost['prefill_s_per_token'] * 1e3:.3f} ms per "
        f"uncached token, decode {cost['decode_s_per_token'] * 1e3:.3f} ms per output "
        f"token, step {cost['step_s'] * 1e3:.0f} ms,",
        f"  fetch {cost['fetch_s_per_block'] * 1e3:.2f} ms per remote block. Modelled, not "
        "measured: no bytes move, no model runs;",
        "  every row has the same nodes, memory per node and cost model.",
    ]
    by = dict(results)
    local, pool = by["local pool"], by["block pool"]
    best_label, best = max(((label, row) for label, row in results
                            if label.startswith("per-node")),
                           key=lambda item: item[1]["prefix_hit_rate_blocks"])
    share = (local["remote_bytes_per_request"] / pool["remote_bytes_per_request"]
             if pool["remote_bytes_per_request"] else 0.0)
    lines += [
        "",
        f"local pool vs {best_label} (the best per-node row): "
        f"{(local['prefix_hit_rate_blocks'] - best['prefix_hit_rate_blocks']) * 100:+.1f} "
        f"points, TTFT p90 {local['ttft_p90_s']:.2f} s vs {best['ttft_p90_s']:.2f} s.",
        f"local pool vs block pool: "
        f"{(local['prefix_hit_rate_blocks'] - pool['prefix_hit_rate_blocks']) * 100:+.1f} "
        f"points, moving {share * 100:.0f}% of its bytes per request.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    try:
        requests = _load(args)
        results = replay_rows(requests, args)
    except ConfigError as exc:
        print(f"kvtier demo: {exc}", file=sys.stderr)
        return 2
    refs = sum(len(r.hash_ids) for r in requests)
    source = args.trace or "built-in synthetic agentic workload"
    capacity = results[0][1]["capacity_blocks"]
    print(f"kvtier demo: {args.nodes} nodes, every row {capacity} blocks per node "
          f"({BLOCK_TOKENS} tokens per block), timed load model")
    print(f"workload: {source}: {len(requests)} requests, {refs:,} block refs\n")
    print(format_table(results, args))
    print("\nregenerate the full tables: python -m kvtier.replay.pool_matrix "
          "(docs/pooling-results.md)")
    return 0
