"""``kvtier replay TRACE``: replay a request trace through per-node, pooled and ideal caches."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvtier.commands import check_output_file
from kvtier.errors import ConfigError

NAME = "replay"
HELP = ("replay a Mooncake-format trace (or builtin:agentic) through N simulated nodes: "
        "per-node vs block pool vs local pool vs ideal prefix hit rates, optionally timed")

BUILTIN = "builtin:agentic"


def _csv(kind: Callable[[str], Any], name: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            items = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            kind_name = getattr(kind, "__name__", "value")
            raise argparse.ArgumentTypeError(
                f"{name}: expected a comma-separated list of {kind_name}s, got {text!r}") from None
        if not items:
            raise argparse.ArgumentTypeError(f"{name}: empty list")
        return items
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier replay`` (the lists of modes, routings and policies come from
    :mod:`kvtier.replay.sim`, so the help names every one the replay accepts)."""
    from kvtier.replay.routing import LOCATE_ROUTINGS
    from kvtier.replay.sim import MODES, POLICIES, ROUTINGS

    parser.add_argument("trace", metavar="TRACE",
                        help=f"trace file (.jsonl or .jsonl.gz), or {BUILTIN} for the built-in "
                             "synthetic agentic workload")
    parser.add_argument("--nodes", type=int, default=4, help="serving nodes (default 4)")
    parser.add_argument("--capacity-blocks", type=_csv(int, "--capacity-blocks"),
                        default=[1000], metavar="C[,C...]",
                        help="blocks per node in the top tier; a list sweeps capacities")
    parser.add_argument("--lower-blocks", type=int, default=0, metavar="D",
                        help="blocks per node in a second, slower tier (0: none)")
    parser.add_argument("--mode", type=_csv(str, "--mode"),
                        default=["per-node", "pooled", "ideal"], help=",".join(MODES))
    parser.add_argument("--routing", type=_csv(str, "--routing"), default=["rr", "session"],
                        help=f"{','.join((*ROUTINGS, *LOCATE_ROUTINGS))} "
                             "(default rr,session; --real: rr, session, locate-bounded, "
                             "owner; see docs/replay.md)")
    parser.add_argument("--policy", type=_csv(str, "--policy"), default=["lru"],
                        help=f"{','.join(POLICIES)} (default lru)")
    parser.add_argument("--vnodes", type=int, default=None,
                        help="virtual nodes per member on the pool's ring (default: the "
                             "replay's balanced default, see docs/replay.md)")
    parser.add_argument("--cascade", action="store_true",
                        help="--dry: when a block leaves a node or the pool, drop the blocks "
                             "chained after it too (tail-first eviction across shards)")
    parser.add_argument("--load", choices=("count", "inflight"), default="count",
                        help="--dry: what routers see as load: requests routed so far "
                             "(count, the default) or requests in flight at arrival, with "
                             "every request timed by the cost model (inflight)")
    parser.add_argument("--engine", choices=("gpu", "cpu"), default="gpu",
                        help="--load inflight: cost model preset: a GPU-class engine "
                             "(default) or bench_engine's measured CPU engine "
                             "(docs/replay.md says where each figure comes from)")
    for flag, what in (("--prefill-s-per-token", "prefill seconds per uncached token"),
                       ("--decode-s-per-token", "node seconds per output token"),
                       ("--step-s", "fixed seconds per request"),
                       ("--fetch-s-per-block", "seconds to read one block from another "
                                               "node (TTFT only)")):
        parser.add_argument(flag, type=float, default=None, metavar="S",
                            help=f"--load inflight: {what} (default: the --engine preset's)")
    parser.add_argument("--live-weight", type=float, default=None, metavar="W",
                        help="locate-live: load penalty weight (default 0.5, see "
                             "docs/replay.md)")
    parser.add_argument("--hot-reads", type=int, default=None, metavar="K",
                        help="--mode local: remote reads of a block after which it is copied "
                             "or moved to the reader (0: never; default 2)")
    parser.add_argument("--max-copies", type=int, default=None, metavar="M",
                        help="--mode local: copies a hot block may have; at M it moves to "
                             "its reader instead (default 1)")
    parser.add_argument("--forward-margin", type=float, default=None, metavar="F",
                        help="--mode local: forward an evicted last copy of age a only to a "
                             "node whose oldest block is older than (1 + F) a (0: the Global "
                             "Memory Service rule; default 0.5)")
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument("--dry", action="store_true", help="metadata only (the default)")
    engine.add_argument("--real", action="store_true",
                        help="real bytes through real DRAM(+LMDB) tiers and real peer servers "
                             "on loopback, for a time-bounded prefix of the trace")
    parser.add_argument("--block-bytes", type=int, default=64 << 10,
                        help="bytes per block (--real payloads; --dry bytes-moved figures)")
    parser.add_argument("--limit", type=int, default=None, help="replay only N requests")
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="--real: stop each configuration after this many seconds")
    parser.add_argument("--json", metavar="FILE", help="write results as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot hit rate vs capacity (needs matplotlib: kvtier[plot])")
    parser.add_argument("--seed", type=int, default=0, help="seed for random routing/workload")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args: argparse.Namespace) -> None:
    from kvtier.replay.routing import LOCATE_ROUTINGS
    from kvtier.replay.sim import MODES, POLICIES, ROUTINGS

    if args.trace != BUILTIN:
        try:
            with open(args.trace, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"TRACE: cannot read {args.trace!r}: {exc.strerror or exc} "
                              f"(a .jsonl or .jsonl.gz file, or {BUILTIN})") from None
    check_output_file(args.json, "--json")
    check_output_file(args.plot, "--plot")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot: matplotlib is not installed; pip install 'kvtier[plot]'")
    if args.nodes < 1:
        raise ConfigError(f"--nodes: expected >= 1, got {args.nodes}")
    for cap in args.capacity_blocks:
        if cap < 1:
            raise ConfigError(f"--capacity-blocks: expected >= 1, got {cap}")
    if args.lower_blocks < 0:
        raise ConfigError(f"--lower-blocks: expected >= 0, got {args.lower_blocks}")
    if args.block_bytes < 1:
        raise ConfigError(f"--block-bytes: expected >= 1, got {args.block_bytes}")
    if args.vnodes is not None and args.vnodes < 1:
        raise ConfigError(f"--vnodes: expected >= 1, got {args.vnodes}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit: expected >= 1, got {args.limit}")
    for flag in ("prefill_s_per_token", "decode_s_per_token", "step_s", "fetch_s_per_block"):
        value = getattr(args, flag)
        if value is not None and not value >= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected >= 0, got {value}")
    for flag, value, low in (("--hot-reads", args.hot_reads, 0),
                             ("--max-copies", args.max_copies, 1),
                             ("--forward-margin", args.forward_margin, 0),
                             ("--live-weight", args.live_weight, 0)):
        if value is not None and not value >= low:
            raise ConfigError(f"{flag}: expected >= {low}, got {value}")
    if "local" in args.mode and (args.lower_blocks or args.cascade or args.policy != ["lru"]):
        raise ConfigError("--mode local: one tier under LRU by global age (no --lower-blocks, "
                          "--cascade or --policy other than lru)")
    if args.real:
        for flag, values, dry_only in (("--routing", args.routing, {"locate", "locate-live"}),
                                       ("--mode", args.mode, {"local"})):
            if dry_only & set(values):
                raise ConfigError(f"{flag}: {', '.join(sorted(dry_only & set(values)))} runs "
                                  "in --dry only; --real runs rr, session, locate-bounded, "
                                  "owner over per-node, pooled and ideal")
        if args.load != "count":
            raise ConfigError("--load: the timed model is a --dry model; --real measures time")
    for flag, values, known in (("--mode", args.mode, MODES), ("--routing", args.routing,
                                ROUTINGS + LOCATE_ROUTINGS), ("--policy", args.policy,
                                                              tuple(POLICIES))):
        for value in values:
            if value not in known:
                raise ConfigError(f"{flag}: unknown {value!r}; known: {', '.join(known)}")


def open_requests(trace: str, *, limit: int | None, seed: int,
                  on_progress: object = None) -> Iterator[object]:
    """The request stream of ``trace`` (a file or :data:`BUILTIN`)."""
    from kvtier.replay.trace import iter_trace
    from kvtier.workload import WorkloadConfig, generate

    if trace == BUILTIN:
        stream: Iterable[object] = generate(WorkloadConfig(seed=seed))
        return iter(stream if limit is None else itertools.islice(stream, limit))
    return iter_trace(trace, limit=limit, on_progress=on_progress)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    """Run the replay and print the table."""
    try:
        _check(args)
        report = _run_real(args) if args.real else _run_dry(args)
    except ConfigError as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    from kvtier.replay.report import format_table, write_json, write_plot

    print(format_table(report))
    rows: list[dict[str, Any]] = report["results"]  # type: ignore[assignment]
    if any("remote_bytes_per_request" in row for row in rows):
        from kvtier.replay.routing import format_routing_table

        print(f"\nrouting (remote MiB at --block-bytes {args.block_bytes}):")
        print(format_routing_table(rows))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            write_plot(report, args.plot)
        except ConfigError as exc:
            print(f"kvtier replay: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def cost_model(args: argparse.Namespace) -> Any:
    """The :class:`~kvtier.replay.timed.CostModel` of the ``--engine`` preset with the
    flags that override it."""
    import dataclasses

    from kvtier.replay.timed import CPU_ENGINE, GPU_ENGINE

    base = CPU_ENGINE if args.engine == "cpu" else GPU_ENGINE
    changes = {name: getattr(args, name) for name in ("prefill_s_per_token",
               "decode_s_per_token", "step_s", "fetch_s_per_block")
               if getattr(args, name) is not None}
    return dataclasses.replace(base, **changes)


def _run_dry(args: argparse.Namespace) -> dict[str, object]:
    from kvtier.peer.ring import HashRing
    from kvtier.progress import Progress
    from kvtier.replay.dry import run_dry
    from kvtier.replay.report import make_report
    from kvtier.replay.routing import make_simulation, routing_metrics
    from kvtier.replay.sim import DEFAULT_POOL_VNODES
    from kvtier.replay.timed import NodeClock
    from kvtier.replay.trace import trace_size

    cost = cost_model(args) if args.load == "inflight" else None
    members = [f"node{i}" for i in range(args.nodes)]
    ring = HashRing(members, vnodes=args.vnodes or DEFAULT_POOL_VNODES)
    sims = []
    for cap in args.capacity_blocks:
        caps = [cap] + ([args.lower_blocks] if args.lower_blocks else [])
        for mode, policy in itertools.product(args.mode, args.policy):
            routings = ["none"] if mode == "ideal" else args.routing
            for routing in routings:
                options = {name: getattr(args, name) for name in (
                    ("hot_reads", "max_copies", "forward_margin") if mode == "local" else ())
                    if getattr(args, name) is not None}
                if routing == "locate-live" and args.live_weight is not None:
                    options["live_weight"] = args.live_weight
                sims.append(make_simulation(
                    mode, routing, policy, args.nodes, caps, ring=ring, seed=args.seed,
                    cascade=args.cascade, **options,
                    clock=None if cost is None else NodeClock(args.nodes, cost)))
    builtin = args.trace == BUILTIN
    total = 0 if builtin else trace_size(args.trace)
    progress = Progress(total, f"replay {len(sims)} configs", enabled=False
                        if args.no_progress else None)
    with progress:
        requests = open_requests(args.trace, limit=args.limit, seed=args.seed,
                                 on_progress=lambda pos: progress.update(to=pos))
        out = run_dry(requests, sims, block_bytes=args.block_bytes,  # type: ignore[arg-type]
                      progress=progress)
    for row, sim in zip(out["results"], sims, strict=True):
        if sim.mode != "ideal":
            row.update(routing_metrics(sim, args.block_bytes))
    return make_report(args.trace, out["requests"], out["block_refs"], args.nodes,
                       args.capacity_blocks, out["results"], engine="dry",
                       unique_blocks=out["unique_blocks"], elapsed_s=round(out["elapsed_s"], 2),
                       vnodes=ring.vnodes, lower_blocks=args.lower_blocks,
                       cascade=args.cascade, load=args.load,
                       cost_model=None if cost is None else cost.describe())


def _run_real(args: argparse.Namespace) -> dict[str, object]:
    import asyncio

    from kvtier.progress import Progress
    from kvtier.replay.real import RealConfig, replay_real
    from kvtier.replay.report import make_report
    from kvtier.replay.sim import DEFAULT_POOL_VNODES

    if args.policy != ["lru"]:
        raise ConfigError("--policy: --real runs the tiers' own LRU; use --dry for other policies")
    requests = list(open_requests(args.trace, limit=args.limit or 20000, seed=args.seed))
    rows = []
    # The first (pooled: slowest) configuration runs until --time-limit; the others replay
    # exactly as many requests, so their hit rates compare like for like.
    modes = sorted(args.mode, key=lambda m: m != "pooled")
    count: int | None = None
    for cap in args.capacity_blocks:
        for mode in modes:
            for routing in (["none"] if mode == "ideal" else args.routing):
                # The real engine's locate routing is always load-bounded.
                real_routing = {"none": "rr", "locate-bounded": "locate"}.get(routing, routing)
                config = RealConfig(mode=mode, routing=real_routing,
                                    nodes=args.nodes, block_bytes=args.block_bytes,
                                    dram_blocks=cap, lmdb_blocks=args.lower_blocks,
                                    vnodes=args.vnodes or DEFAULT_POOL_VNODES,
                                    time_limit=args.time_limit if count is None else 1e9)
                todo = requests if count is None else requests[:count]
                progress = Progress(len(todo), f"real {mode}/{routing}/C={cap}",
                                    enabled=False if args.no_progress else None)
                with progress:
                    rows.append(asyncio.run(replay_real(todo, config,  # type: ignore[arg-type]
                                                        progress=progress)))
                count = int(rows[-1]["requests"]) if count is None else count
    done = min(int(r["requests"]) for r in rows)
    return make_report(args.trace, done, min(int(r["block_refs"]) for r in rows), args.nodes,
                       args.capacity_blocks, rows, engine="real",
                       block_bytes=args.block_bytes, time_limit_s=args.time_limit)
