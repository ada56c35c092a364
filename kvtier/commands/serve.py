"""``kvtier serve``: expose this node's segment (a TieredStore) to the peer pool."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "serve"
HELP = "serve this node's segment (a tiered store) to the peer pool over HTTP"
log = logging.getLogger("kvtier.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``kvtier serve`` options."""
    parser.add_argument("--listen", default="127.0.0.1:7070", metavar="HOST:PORT",
                        help="bind address (default 127.0.0.1:7070; port 0 picks a free port "
                             "and prints it)")
    parser.add_argument("--tier", action="append", required=True, metavar="URL",
                        help="tier URL of the segment, top first; repeat for more tiers")
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the pool's bearer token (required unless "
                             "--insecure-no-auth)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="accept requests without a token (trusted test networks only)")
    parser.add_argument("--tls-cert", metavar="FILE", help="server certificate (PEM)")
    parser.add_argument("--tls-key", metavar="FILE", help="server private key (PEM)")
    parser.add_argument("--tls-client-ca", metavar="FILE",
                        help="require client certificates signed by this CA (mutual TLS)")
    parser.add_argument("--node-id", help="member id reported by /v1/health (default host:port)")
    parser.add_argument("--max-block-bytes", default="64MiB", metavar="SIZE",
                        help="largest block accepted (default 64MiB)")
    parser.add_argument("--max-batch", type=int, default=1024, metavar="N",
                        help="most blocks per batch request (default 1024)")
    parser.add_argument("--max-body", default="256MiB", metavar="SIZE",
                        help="largest request body (default 256MiB)")
    parser.add_argument("--max-inflight", default="1GiB", metavar="SIZE",
                        help="request body and batch answer bytes held at once, server-wide; "
                             "a request past it gets 503 with Retry-After (default 1GiB; at "
                             "least --max-body)")
    parser.add_argument("--repair-reserve", default=None, metavar="SIZE",
                        help="the share of --max-inflight only repair writes (?fill=1: read "
                             "repair, handoff, anti-entropy) may take, so they are admitted "
                             "while client requests get 503 (default: an eighth, at most "
                             "--max-inflight less --max-body)")
    parser.add_argument("--idle-timeout", type=float, default=15.0, metavar="SECONDS",
                        help="close a connection idle, or still sending its request head, "
                             "this long (default 15)")
    parser.add_argument("--body-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="refuse a request whose body sends no byte for this long with "
                             "408 (default 10)")
    parser.add_argument("--min-body-rate", default="256KiB", metavar="SIZE",
                        help="bytes per second a request body must average from 1 s after "
                             "its head, else 408 (default 256KiB; 0: off)")
    parser.add_argument("--max-connections", type=int, default=4096, metavar="N",
                        help="open connections served at once; more get 503 and are closed "
                             "(default 4096; clamped to the open-files limit less 128)")
    parser.add_argument("--body-reserve", default="64MiB", metavar="SIZE",
                        help="PUT body buffers faulted in at start and kept, as two buffers "
                             "of half the size: bodies that fit pay no page faults (default "
                             "64MiB; 0: map on demand)")
    parser.add_argument("--no-data-plane", action="store_true",
                        help="serve every request through aiohttp (by default block "
                             "GET/PUT and batch get take the data plane, docs/peer-pool.md)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop: uvloop, asyncio's default, or auto (uvloop when "
                             "installed; pip install 'kvtier[uvloop]')")
    parser.add_argument("--policy", choices=("lru", "s3fifo", "arc"), default="arc",
                        help="eviction policy of the segment's budgeted tiers whose URL names "
                             "none (default arc: best sessionless pool hit rate measured, see "
                             "docs/pooling-results.md)")
    parser.add_argument("--pool", metavar="POOL_URL",
                        help="the pool this node belongs to (peers://...; this node's self= "
                             "defaults to its listen address): its anti-entropy re-replicates "
                             "this node's blocks to their current owners after each membership "
                             "change (on unless --no-repair)")
    parser.add_argument("--repair", metavar="POOL_URL",
                        help="same as --pool (kept for existing scripts)")
    parser.add_argument("--no-repair", action="store_true",
                        help="run no anti-entropy although --pool is given")
    parser.add_argument("--repair-interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between retries of an anti-entropy pass that failed "
                             "(a pass starts as soon as a membership change is seen; "
                             "default 10)")
    parser.add_argument("--shm", metavar="NAME",
                        help="host daemon: keep the first tier (dram://?capacity=...) in a "
                             "shared-memory arena under /dev/shm that engine processes of this "
                             "host attach to with local://NAME (docs/host-daemon.md)")
    parser.add_argument("--shm-lease-ttl", type=float, default=10.0, metavar="SECONDS",
                        help="longest an engine may hold a slot of the shared arena (a dead "
                             "engine's slots are freed at once; default 10)")
    parser.add_argument("--shm-index-slots", type=int, default=1 << 20, metavar="N",
                        help="entries of the shared presence index engines read contains "
                             "and lookups from (a power of two, 8 bytes each; it takes keys "
                             "while 3/4 full; default 1048576)")
    parser.add_argument("--repair-rate", default="64MiB", metavar="SIZE",
                        help="anti-entropy push budget per second, so a refill cannot starve "
                             "clients (default 64MiB; 0: unpaced)")
    parser.add_argument("--events", metavar="ENDPOINT",
                        help="publish the segment's KV events on this ZMQ PUB address in "
                             "vLLM's wire format with vLLM's medium names (tcp://*:5557; "
                             "port 0 picks one and prints it; docs/events.md; needs "
                             "kvtier[events])")
    parser.add_argument("--events-model", default="", metavar="NAME",
                        help="model name in the events' topic kv@<node>@<model>")
    parser.add_argument("--versions", metavar="FILE",
                        help="log of the blocks' stamps and tombstones, kept across restarts "
                             "(default: DIR.versions beside the first lmdb:// or file:// "
                             "tier's DIR; in memory for other segments)")
    parser.add_argument("--tombstone-grace", type=float, default=600.0, metavar="SECONDS",
                        help="how long a delete's tombstone is kept once every owner holds "
                             "it (default 600)")


def versions_path(args: argparse.Namespace) -> str | None:
    """The stamps log of ``--versions``, or its default beside a persistent tier."""
    from urllib.parse import urlsplit

    if args.versions:
        return str(args.versions)
    for url in args.tier:
        parts = urlsplit(str(url))
        if parts.scheme in ("lmdb", "file") and parts.path.rstrip("/"):
            return parts.path.rstrip("/") + ".versions"
    return None


def versions_fsync(args: argparse.Namespace) -> bool:
    """Whether the stamps log is fsynced: when the first persistent tier fsyncs its writes
    (``lmdb://...?sync=1|meta``, ``file://...?fsync=1``), so the log is as durable."""
    from urllib.parse import parse_qs, urlsplit

    for url in args.tier:
        parts = urlsplit(str(url))
        query = {k.lower(): v[-1].strip().lower() for k, v in parse_qs(parts.query).items()}
        if parts.scheme == "lmdb":
            return query.get("sync", "0") in ("1", "meta", "true", "on", "yes")
        if parts.scheme == "file":
            return query.get("fsync", "0") in ("1", "true", "yes", "on")
    return False


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loop ``--loop`` asks for, as ``(name, factory)``.

    Raises
    ------
    ConfigError
        If ``uvloop`` is asked for and not installed.
    """
    from kvtier.errors import ConfigError

    if choice == "asyncio" or (choice == "auto" and importlib.util.find_spec("uvloop") is None):
        return "asyncio", asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        raise ConfigError("--loop: uvloop is not installed (pip install 'kvtier[uvloop]')"
                          ) from None
    return "uvloop", uvloop.new_event_loop


def run(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit status."""
    from kvtier.errors import ConfigError

    try:
        name, factory = loop_factory(args.loop)
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(_serve(args, name))
    except ConfigError as exc:
        print(f"kvtier serve: {exc}", flush=True)
        return 2


def segment_policy(urls: list[str], policy: str) -> dict[int | str, dict[str, Any]]:
    """``tier_options`` giving ``policy`` to every budgeted tier among ``urls`` whose URL
    does not choose one (a pool segment evicts with ARC by default: issue 15's matrix)."""
    from urllib.parse import parse_qs, urlsplit

    from kvtier.tiers.budget import BudgetedTier
    from kvtier.tiers.registry import tier_class

    options: dict[int | str, dict[str, Any]] = {}
    for i, url in enumerate(urls):
        parts = urlsplit(url)
        if "policy" in parse_qs(parts.query):
            continue
        if issubclass(tier_class(parts.scheme), BudgetedTier):
            options[i] = {"policy": policy}
    return options


async def _serve(args: argparse.Namespace, loop_name: str) -> int:
    from kvtier.errors import ConfigError
    from kvtier.peer.membership import split_member
    from kvtier.peer.protocol import Limits
    from kvtier.peer.server import PeerServer
    from kvtier.peer.tls import server_context
    from kvtier.store import open_store
    from kvtier.urls import parse_secret, parse_size

    if args.verbose < 2:
        # aiohttp logs every malformed request line or chunk a client sends as an ERROR with a
        # traceback; that is client noise (the client got its 400), not a server fault.
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    host, port = split_member(args.listen, "--listen", allow_zero=True)
    if args.token_file is None and not args.insecure_no_auth:
        raise ConfigError("--token-file: required (or pass --insecure-no-auth explicitly)")
    token = parse_secret(f"file:{args.token_file}", "--token-file") if args.token_file else None
    if args.tls_key and not args.tls_cert:
        raise ConfigError("--tls-key: given without --tls-cert")
    if args.tls_client_ca and not args.tls_cert:
        raise ConfigError("--tls-client-ca: mutual TLS needs --tls-cert and --tls-key")
    ctx = server_context(args.tls_cert, args.tls_key, args.tls_client_ca) \
        if args.tls_cert else None
    limits = Limits(max_block_bytes=parse_size(args.max_block_bytes, "--max-block-bytes"),
                    max_batch=args.max_batch,
                    max_body_bytes=parse_size(args.max_body, "--max-body"))
    max_inflight = parse_size(args.max_inflight, "--max-inflight")
    repair_reserve = None if args.repair_reserve is None else \
        parse_size(args.repair_reserve, "--repair-reserve")
    from kvtier.peer.versions import Versions

    tier_options = segment_policy(args.tier, args.policy)
    if args.shm is not None:
        if not args.tier[0].lower().startswith("dram://"):
            raise ConfigError("--shm: the first --tier must be dram://?capacity=SIZE (the "
                              "arena engines share)")
        tier_options.setdefault(0, {})["shm"] = args.shm
    store = await open_store(args.tier, tier_options=tier_options)
    try:
        # After the store: a tier's own error about its directory comes first.
        try:
            # A write is answered once its stamps are in the log only when its block
            # outlives a crash too (kvtier.peer.stamplog).
            versions = Versions(versions_path(args), grace=args.tombstone_grace,
                                fsync=versions_fsync(args),
                                wait=any(tier.persistent for tier in store.tiers))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--versions: cannot open the stamps log: {exc}") from None
        server = PeerServer(store, token=token, host=host, port=port, node_id=args.node_id,
                            limits=limits, ssl_context=ctx,
                            insecure_no_auth=args.insecure_no_auth, close_segment=True,
                            max_inflight_bytes=max_inflight,
                            repair_reserve_bytes=repair_reserve, idle_timeout=args.idle_timeout,
                            body_timeout=args.body_timeout,
                            min_body_rate=parse_size(args.min_body_rate, "--min-body-rate"),
                            max_connections=args.max_connections,
                            data_plane=not args.no_data_plane,
                            body_reserve=parse_size(args.body_reserve, "--body-reserve"),
                            versions=versions)
        try:
            bound_host, bound_port = await server.start()
        except OSError as exc:  # address in use, not ours to bind, unknown host
            raise ConfigError(f"--listen: cannot listen on {args.listen}: "
                              f"{exc.strerror or exc}") from None
    except BaseException:
        await store.aclose()
        raise
    events = await _start_events(args, server) if args.events else None
    local = None
    if args.shm is not None:
        local = await _start_local(args, server)
    try:
        close_pool = await _start_pool(args, server) if args.pool or args.repair else None
    except BaseException:
        if local is not None:
            await local.stop()
        raise
    if token is None:
        log.warning("serving WITHOUT authentication (--insecure-no-auth)")
    # Handlers first: whoever reads "listening" may signal at once.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvtier serve listening on {server.member_id}"
          f" ({'https' if ctx else 'http'}, node {server.node_id}, loop {loop_name})", flush=True)
    await stop.wait()
    if local is not None:
        server.shm_families = None  # a scrape meanwhile reads no closed index
        await local.stop()
    if close_pool is not None:
        await close_pool()
    # In-flight requests finish, then the store flushes its write-back queues and closes.
    await server.stop()
    if events is not None:  # after the store's close: its last events go out
        await events.aclose()
    print(f"kvtier serve on {bound_host}:{bound_port} stopped", flush=True)
    return 0


async def _start_events(args: argparse.Namespace, server: Any) -> Any:
    """The ``--events`` publisher of the segment store's KV events (kvtier.events_zmq)."""
    from kvtier.errors import ConfigError

    try:
        from kvtier.events_zmq import ZmqEventPublisher
    except ImportError as exc:
        await server.stop()
        raise ConfigError(f"--events: needs pyzmq and msgspec (pip install 'kvtier[events]'): "
                          f"{exc}") from None
    try:
        publisher = ZmqEventPublisher(server.segment.event_hub, args.events,
                                      model=args.events_model, vllm_medium_names=True)
        await publisher.start()
    except Exception as exc:  # a bad or busy address (zmq.ZMQError), a malformed endpoint
        await server.stop()
        raise ConfigError(f"--events: cannot publish on {args.events}: {exc}") from None
    print(f"kvtier serve events on {publisher.endpoint}", flush=True)
    return publisher


async def _start_local(args: argparse.Namespace, server: Any) -> Any:
    """The ``--shm NAME`` socket that engines of this host attach to (kvtier.shm.server)."""
    from kvtier.errors import ConfigError
    from kvtier.shm.server import LocalServer
    from kvtier.tiers.dram import DRAMTier

    top = server.segment.tiers[0]
    try:
        if not isinstance(top, DRAMTier):
            raise ConfigError("--shm: the first --tier must be dram://?capacity=SIZE")
        local = LocalServer(server.segment, top, lease_ttl=args.shm_lease_ttl,
                            index_slots=args.shm_index_slots)
        path = await local.start()
    except BaseException:
        await server.stop()
        raise
    server.shm_families = local.metric_families
    print(f"kvtier serve shm {args.shm} at {path}", flush=True)
    return local


async def _start_pool(args: argparse.Namespace, server: Any
                      ) -> Callable[[], Awaitable[None]] | None:
    """This member's pool tier of ``--pool POOL_URL``: its anti-entropy loop (see
    kvtier.peer.repair; off with ``--no-repair``), and under ``placement=local`` its holder
    (kvtier.peer.holder: directory registration, forwarding of evicted last copies, kept
    with ``--no-repair``). Returns what closes them at exit."""
    from kvtier.errors import ConfigError
    from kvtier.peer.holder import LocalHolder
    from kvtier.peer.repair import AntiEntropy
    from kvtier.peer.tier import PeerTier
    from kvtier.urls import parse_size

    if args.pool and args.repair and args.pool != args.repair:
        raise ConfigError("--repair: names another pool than --pool (give one of them)")
    url = args.pool or args.repair
    rate = parse_size(args.repair_rate, "--repair-rate")
    own = {} if "self=" in url else {"self": server.member_id}
    try:
        pool = PeerTier.from_url(url, local=server.segment, **own)
        if pool.placement == "local":
            LocalHolder(server, pool).attach()
        elif args.no_repair:
            return None
        if args.no_repair:
            await pool.open()
            return pool.aclose
        repair = AntiEntropy(server, pool, interval=args.repair_interval, rate=rate or None)
        await repair.start()
    except BaseException:
        await server.stop()
        raise
    return repair.close
