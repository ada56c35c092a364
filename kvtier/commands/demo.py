"""``kvtier demo``: what pooling buys, measured honestly, with nothing to set up.

Four nodes in this process on loopback (real ``PeerServer``s for the pool), every node with
the same ``dram://`` + ``lmdb://`` tiers in a temp dir, the built-in synthetic agentic
workload (or ``--trace``) with real bytes. Four rows at equal tiers and total capacity, which
differ only in what the row is about: per-node caches routed round-robin, with session
affinity, and by where a prefix lives (each node's ``locate_prefix``, load bounded); and the
pool with per-block placement routed round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.replay.real import RealConfig
from kvtier.replay.trace import BLOCK_TOKENS, Request

NAME = "demo"
HELP = ("show what pooling buys on an embedded default: 4 nodes on loopback replaying a "
        "synthetic agentic workload, per-node caches (round-robin, session, locate) vs the pool "
        "(block placement) at equal capacity (under a minute)")

# (label, mode, routing, placement): what each row is about; everything else is the same in
# every row.
ROWS = (("per-node rr", "per-node", "rr", "block"),
        ("per-node session", "per-node", "session", "block"),
        ("per-node locate-b", "per-node", "locate", "block"),
        ("pooled rr", "pooled", "rr", "block"))
# The row that runs first, bounded by the time limit: the slowest (HTTP on most blocks).
SLOWEST = "pooled rr"
LABEL_WIDTH = max(len(label) for label, *_ in ROWS)

# Prefill estimate defaults (flags change them): a Llama-3.1-8B-class model in bf16 has
# 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 128 KiB of KV per token.
PREFILL_TOKENS_PER_S = 10_000
KV_BYTES_PER_TOKEN = 128 << 10
LINK_GBIT_PER_S = 100.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier demo``."""
    parser.add_argument("--quick", action="store_true",
                        help="a smaller run (under 20 s), what the test suite runs")
    parser.add_argument("--trace", metavar="FILE", help="replay a Mooncake-format trace instead")
    parser.add_argument("--nodes", type=int, default=4, help="nodes (default 4)")
    parser.add_argument("--block-bytes", type=int, default=None,
                        help="bytes per KV block moved for real (default 32 KiB; 16 KiB "
                             "with --quick)")
    parser.add_argument("--dram-blocks", type=int, default=None,
                        help="DRAM blocks per node (default sized to the workload)")
    parser.add_argument("--lmdb-blocks", type=int, default=None, help="LMDB blocks per node")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the first (slowest) row; the others replay the same "
                             "requests (default 15; 5 with --quick)")
    parser.add_argument("--prefill-rate", type=float, default=PREFILL_TOKENS_PER_S,
                        metavar="TOKENS/S",
                        help=f"prefill rate for the estimate (default {PREFILL_TOKENS_PER_S})")
    parser.add_argument("--kv-bytes-per-token", type=int, default=KV_BYTES_PER_TOKEN,
                        help="KV bytes per token of the modelled engine (default 131072, "
                             "Llama-3.1-8B bf16)")
    parser.add_argument("--link-gbps", type=float, default=LINK_GBIT_PER_S,
                        help=f"network between nodes, Gbit/s (default {LINK_GBIT_PER_S:g})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def row_configs(args: argparse.Namespace) -> list[tuple[str, RealConfig]]:
    """The rows' configurations: one base config, with only mode, routing and placement
    changed.

    Raises
    ------
    ConfigError
        If a size or the time limit is not positive.
    """
    quick = args.quick
    default_dram = 200 if args.trace else (30 if quick else 50)
    block_bytes = args.block_bytes if args.block_bytes is not None else (
        16 << 10 if quick else 32 << 10)
    dram = args.dram_blocks if args.dram_blocks is not None else default_dram
    lmdb = args.lmdb_blocks if args.lmdb_blocks is not None else dram
    limit = args.time_limit if args.time_limit is not None else (5.0 if quick else 15.0)
    for name, value in (("--nodes", args.nodes), ("--block-bytes", block_bytes),
                        ("--dram-blocks", dram), ("--time-limit", limit),
                        ("--prefill-rate", args.prefill_rate),
                        ("--kv-bytes-per-token", args.kv_bytes_per_token),
                        ("--link-gbps", args.link_gbps)):
        if value <= 0:
            raise ConfigError(f"{name}: expected > 0, got {value}")
    if lmdb < 0:
        raise ConfigError(f"--lmdb-blocks: expected >= 0, got {lmdb}")
    base = RealConfig(mode="per-node", routing="rr", nodes=args.nodes, block_bytes=block_bytes,
                      dram_blocks=dram, lmdb_blocks=lmdb, shared_file=False, time_limit=limit)
    return [(label, dataclasses.replace(base, mode=mode, routing=routing, placement=placement))
            for label, mode, routing, placement in ROWS]


def _load(args: argparse.Namespace) -> list[Request]:
    from kvtier.replay.trace import iter_trace
    from kvtier.workload import WorkloadConfig, generate

    if args.trace:
        return list(iter_trace(args.trace, limit=300 if args.quick else 3000))
    cfg = WorkloadConfig(sessions=16 if args.quick else 48, concurrency=6 if args.quick else 16)
    return list(generate(cfg))


def _estimate(row: dict[str, Any], args: argparse.Namespace) -> tuple[float, float]:
    """Per request: prefill ms saved by hit tokens, and ms spent fetching remote hits, for
    the modelled engine (``--prefill-rate``, ``--kv-bytes-per-token``, ``--link-gbps``)."""
    n = max(1, int(row["requests"]))
    saved = row["hit_tokens"] / args.prefill_rate
    remote_tokens = row["remote_hit_blocks"] * BLOCK_TOKENS
    fetch = remote_tokens * args.kv_bytes_per_token / (args.link_gbps * 1e9 / 8)
    return saved / n * 1e3, fetch / n * 1e3


def _net_ms(row: dict[str, Any], args: argparse.Namespace) -> float:
    saved_ms, fetch_ms = _estimate(row, args)
    return saved_ms - fetch_ms


def _net_bytes_per_request(row: dict[str, Any]) -> float:
    return float(row["network_bytes"]) / max(1, int(row["requests"]))


def format_table(results: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    """The table, its legend and the summary line."""
    w = LABEL_WIDTH
    header = (f"{'configuration':<{w}} {'hit(blk)':>8} {'hit(tok)':>8} {'remote':>7} "
              f"{'MB/req':>7} {'load':>5} {'prefill saved':>21} {'fetch':>8} {'net':>8}")
    sub = (f"{'':<{w}} {'':>8} {'':>8} {'':>7} {'':>7} {'':>5} "
           f"{'tokens/req':>10} {'ms/req':>10} {'ms/req':>8} {'ms/req':>8}")
    lines = [header, sub, "-" * len(header)]
    for label, row in results:
        saved_ms, fetch_ms = _estimate(row, args)
        remote = "-" if row["remote_share"] is None else f"{row['remote_share'] * 100:.0f}%"
        tokens = row["hit_tokens"] / max(1, int(row["requests"]))
        lines.append(
            f"{label:<{w}} {row['prefix_hit_rate_blocks'] * 100:>7.1f}% "
            f"{row['prefix_hit_rate_tokens'] * 100:>7.1f}% {remote:>7} "
            f"{_net_bytes_per_request(row) / 1e6:>7.2f} {row['load_imbalance']:>5.2f} "
            f"{tokens:>10.0f} {saved_ms:>10.1f} {fetch_ms:>8.1f} {saved_ms - fetch_ms:>8.1f}")
    kv_kib = args.kv_bytes_per_token / 1024
    lines += [
        "",
        "legend:",
        "  hit(blk)  share of requested blocks found as a cached prefix (any tier, any node)",
        "  hit(tok)  the same weighted by prompt tokens (a request's last block may be partial)",
        "  remote    share of hit blocks read from another node's segment over HTTP",
        "  MB/req    bytes that crossed the network per request (pool reads of remote blocks",
        "            and writes of new blocks to their owners), at this demo's block size",
        "  load      busiest node's requests / mean (1.00 = even)",
        f"  prefill saved  hit tokens per request, and the prefill time they save at "
        f"{args.prefill_rate:,.0f} tokens/s",
        f"  fetch     time to pull the remote hits over a {args.link_gbps:g} Gbit/s link, "
        f"with {kv_kib:,.0f} KiB of KV per token",
        "            (a Llama-3.1-8B-class model in bf16; local DRAM/LMDB loads not counted)",
        "  net       prefill saved - fetch: positive means the fetches pay",
        "  Prefill compute is not simulated: these are estimates from the stated rates, not",
        "  measured GPU time. Every row has the same tiers and total capacity.",
    ]
    by_label = dict(results)
    pooled, session = by_label["pooled rr"], by_label["per-node session"]
    gain = (pooled["prefix_hit_rate_blocks"] - session["prefix_hit_rate_blocks"]) * 100
    # The demo moves small blocks; the modelled engine's block of BLOCK_TOKENS tokens is larger.
    scale = args.kv_bytes_per_token * BLOCK_TOKENS / pooled["block_bytes"]
    lines += [
        "",
        f"pooled vs per-node session affinity at equal capacity: {gain:+.1f} points, "
        f"{_net_bytes_per_request(pooled) / 1e6:.2f} MB moved per request "
        f"({_net_bytes_per_request(pooled) * scale / 1e6:,.0f} MB at {kv_kib:,.0f} KiB of KV "
        "per token).",
        "prefill saved net of fetches (estimate at the stated rates): "
        + ", ".join(f"{label} {_net_ms(row, args):.1f}" for label, row in results)
        + " ms per request.",
    ]
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> int:
    from kvtier.progress import Progress
    from kvtier.replay.real import replay_real

    configs = row_configs(args)
    requests = _load(args)
    base = configs[0][1]
    refs = sum(len(r.hash_ids) for r in requests)
    source = args.trace or "built-in synthetic agentic workload"
    print(f"kvtier demo: {base.nodes} nodes on loopback; every row: each node dram "
          f"{base.dram_blocks} + lmdb {base.lmdb_blocks} blocks of {base.block_bytes >> 10} KiB "
          f"({BLOCK_TOKENS} tokens per block)")
    print(f"workload: {source}: {len(requests)} requests, {refs:,} block refs "
          f"(sessions, shared system prompts, sub-agents)\n")
    # The slowest row runs first, bounded by the time limit; the others replay exactly the
    # requests it got through.
    order = sorted(configs, key=lambda item: item[0] != SLOWEST)
    done: dict[str, dict[str, Any]] = {}
    count: int | None = None
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        for i, (label, config) in enumerate(order):
            todo = requests if count is None else requests[:count]
            if count is not None:  # same requests as the first row: no time bound
                config = dataclasses.replace(config, time_limit=1e9)
            progress = Progress(len(todo), f"{label:<{LABEL_WIDTH}}",
                                enabled=False if args.no_progress else None)
            with progress:
                workdir = Path(tmp) / f"run{i}"
                workdir.mkdir()
                row = await replay_real(todo, config, workdir=workdir, progress=progress)
            done[label] = row
            count = int(row["requests"]) if count is None else count
    results = [(label, done[label]) for label, _ in configs]
    print(format_table(results, args))
    if count is not None and count < len(requests):
        print(f"(every row replayed the first {count} of {len(requests)} requests: the time "
              f"limit stopped the first row; --time-limit raises it)")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    try:
        return asyncio.run(_run(args))
    except ConfigError as exc:
        print(f"kvtier demo: {exc}", file=sys.stderr)
        return 2
