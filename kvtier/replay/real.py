"""The ``--real`` engine: real bytes through real tiers and real peer servers on loopback.

Every serving node is a :class:`~kvtier.store.TieredStore`. ``per-node``: each node's own
``dram://`` (+ ``lmdb://``) chain. ``pooled``: each node serves a segment (its ``dram://`` +
``lmdb://``) with a real :class:`~kvtier.peer.server.PeerServer`, and reads/writes the pool
through a :class:`~kvtier.peer.tier.PeerTier` (its own keys without HTTP). ``ideal``: one
chain with the capacity of all nodes. An optional shared ``file://`` tier sits at the bottom
of every node's chain. Routing ``locate`` sends a request to the node with the longest local
prefix, within the load bound of :mod:`kvtier.routing`: pooled, it asks every member
``POST /v1/locate``; per-node, it asks every node's store :meth:`~kvtier.TieredStore.locate_prefix`
in process (what each node's server would answer). Routing ``owner`` (pooled) asks a router's own
store :meth:`~kvtier.TieredStore.route`, with no request to the pool. The pool places every
block by its own key. A request does what an inference server does: ``lookup_prefix``,
then ``get_many`` of the hit prefix (payloads are verified), then ``put_many`` of the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import secrets
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.peer.ring import HashRing
from kvtier.progress import Progress
from kvtier.replay.trace import BLOCK_TOKENS, Request
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier

__all__ = ["REAL_ROUTINGS", "Cluster", "RealConfig", "block_payload", "real_key", "replay_real"]

REAL_ROUTINGS = ("rr", "session", "locate", "owner")


def real_key(block_id: int) -> bytes:
    """A 16-byte key for a trace block id (a digest, like :func:`kvtier.prefix_keys`)."""
    return hashlib.blake2b(block_id.to_bytes(8, "little", signed=True), digest_size=16).digest()


def block_payload(block_id: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The deterministic payload of a block: readers check its first and last byte."""
    out = np.empty(nbytes, dtype=np.uint8)
    out.fill(block_id % 251)
    out[-1] = (block_id // 251) % 251
    return out


@dataclass(frozen=True)
class RealConfig:
    """One real-engine configuration (capacities are blocks per node)."""

    mode: str
    routing: str = "rr"
    nodes: int = 4
    block_bytes: int = 64 << 10
    dram_blocks: int = 1000
    lmdb_blocks: int = 0
    shared_file: bool = False
    vnodes: int = 8192
    time_limit: float = 20.0
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("per-node", "pooled", "ideal"):
            raise ConfigError(f"mode: unknown {self.mode!r}; known: per-node, pooled, ideal")
        if self.routing not in REAL_ROUTINGS:
            raise ConfigError(f"routing: --real supports {', '.join(REAL_ROUTINGS)}, "
                              f"got {self.routing!r}")
        if self.routing == "locate" and self.mode == "ideal":
            raise ConfigError("routing: locate needs mode per-node or pooled")
        if self.routing == "owner" and self.mode != "pooled":
            raise ConfigError("routing: owner (store.route over the pool) needs mode pooled")
        for name in ("nodes", "block_bytes", "dram_blocks", "vnodes", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected >= 1, got {getattr(self, name)}")


class Cluster:
    """The nodes of one configuration, built under ``workdir`` (use ``async with``)."""

    def __init__(self, config: RealConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.stores: list[TieredStore] = []
        self.segments: list[TieredStore] = []
        self.servers: list[Any] = []
        self.ring: HashRing | None = None  # pooled: who owns a key, as the PeerTiers see it
        self.router: TieredStore | None = None  # owner routing: a router process's own store
        self.token = secrets.token_urlsafe(16)

    def _local_tiers(self, index: int, scale: int) -> list[Tier]:
        cfg = self.config
        tiers: list[Tier] = [DRAMTier(cfg.dram_blocks * scale * cfg.block_bytes,
                                      name=f"dram{index}")]
        if cfg.lmdb_blocks:
            from kvtier.tiers.lmdb import LMDBTier

            tiers.append(LMDBTier(self.workdir / f"lmdb{index}",
                                  capacity=cfg.lmdb_blocks * scale * cfg.block_bytes,
                                  name=f"lmdb{index}"))
        return tiers

    def _shared(self) -> list[Tier]:
        if not self.config.shared_file:
            return []
        from kvtier.tiers.fsspec import FsspecTier

        return [FsspecTier(f"file://{self.workdir / 'shared'}", name="file")]

    async def __aenter__(self) -> Cluster:
        cfg = self.config
        if cfg.mode == "ideal":
            self.stores = [TieredStore(self._local_tiers(0, cfg.nodes) + self._shared())]
        elif cfg.mode == "per-node":
            self.stores = [TieredStore(self._local_tiers(i, 1) + self._shared())
                           for i in range(cfg.nodes)]
        else:
            await self._start_pool()
        return self

    async def _start_pool(self) -> None:
        from kvtier.peer.server import PeerServer
        from kvtier.peer.tier import PeerTier

        cfg = self.config
        token = self.token
        self.segments = [TieredStore(self._local_tiers(i, 1)) for i in range(cfg.nodes)]
        for i, segment in enumerate(self.segments):
            server = PeerServer(segment, token=token, node_id=f"node{i}")  # serves /v1/locate
            await server.start()
            self.servers.append(server)
        members = [s.member_id for s in self.servers]
        self.ring = HashRing(members, vnodes=cfg.vnodes)
        for server, segment in zip(self.servers, self.segments, strict=True):
            peers = PeerTier(members, token=token, self_id=server.member_id, local=segment,
                             timeout=5.0, vnodes=cfg.vnodes)
            shared = self._shared()
            # The pool tier has no budget of its own (the segments evict), so nothing is ever
            # demoted out of it: a shared tier below must be written through.
            self.stores.append(TieredStore([peers, *shared], write_policy="write_through"
                                           if shared else "write_back"))
        if cfg.routing == "owner":
            # A router holds no blocks: its pool tier only knows the members.
            self.router = TieredStore([PeerTier(members, token=token, timeout=5.0,
                                                vnodes=cfg.vnodes)])

    async def __aexit__(self, *exc: object) -> None:
        for store in [*self.stores, *([self.router] if self.router else [])]:
            with contextlib.suppress(Exception):
                await store.aclose()
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.stop()
        for segment in self.segments:
            with contextlib.suppress(Exception):
                await segment.aclose()


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def replay_real(requests: Iterable[Request], config: RealConfig, *,
                      workdir: Path | None = None, progress: Progress | None = None
                      ) -> dict[str, Any]:
    """Replay ``requests`` (until ``config.time_limit``) and return the result row.

    Raises
    ------
    AssertionError
        Never on a miss; only if a block read back has the wrong payload (a real bug).
    """
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="kvtier-replay-")))
        async with Cluster(config, Path(root)) as cluster:
            return await _drive(requests, config, cluster, progress)
    raise AssertionError("unreachable")  # pragma: no cover - the with block returns


async def _drive(requests: Iterable[Request], config: RealConfig, cluster: Cluster,
                 progress: Progress | None) -> dict[str, Any]:
    sessions: dict[str, int] = {}
    rr = itertools.count()
    payloads: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}
    latencies: list[float] = []
    counts = dict.fromkeys(("requests", "blocks", "hit_blocks", "tokens", "hit_tokens",
                            "bytes_read", "bytes_written", "remote_hits"), 0)
    ring = cluster.ring
    stream = iter(requests)
    node_requests = [0] * config.nodes
    members = [s.member_id for s in cluster.servers]
    http = None
    if config.routing == "locate" and config.mode == "pooled":
        import aiohttp

        http = aiohttp.ClientSession()
    start = time.perf_counter()

    async def one(req: Request) -> None:
        keys = [real_key(b) for b in req.hash_ids]
        if http is not None:
            node = await _locate_node(cluster, http, keys, node_requests)
        elif config.routing == "locate":
            node = await _local_node(cluster, keys, node_requests)
        elif cluster.router is not None:
            member = cluster.router.route(keys, members, dict(zip(members, node_requests,
                                                                  strict=True)))
            node = members.index(member)
        elif config.routing == "session" and req.session is not None:
            node = sessions.setdefault(req.session, next(rr) % config.nodes)
        else:
            node = next(rr) % config.nodes
        node_requests[node] += 1
        store = cluster.stores[0 if config.mode == "ideal" else node]
        t0 = time.perf_counter()
        hit = await store.lookup_prefix(keys)
        got = await store.get_many(keys[:hit]) if hit else []
        # A block may vanish between lookup and get (evicted meanwhile): the prefix ends there.
        served = 0
        for block_id, block in zip(req.hash_ids, got, strict=False):
            if block is None:
                break
            if block.nbytes != config.block_bytes or block.reshape(-1).view(np.uint8)[0] \
                    != block_id % 251:
                raise AssertionError(f"block {block_id}: wrong payload read back")
            served += 1
        if ring is not None:
            me = members[node]
            counts["remote_hits"] += sum(ring.primary(k) != me for k in keys[:served])
        new = []
        for block_id, key in zip(req.hash_ids[served:], keys[served:], strict=True):
            payload = payloads.get(block_id)
            if payload is None:
                payload = block_payload(block_id, config.block_bytes)
                if len(payloads) < 4096:  # reuse buffers of hot blocks, bounded
                    payloads[block_id] = payload
            new.append((key, payload))
        if new:
            await store.put_many(new)
        latencies.append(time.perf_counter() - t0)
        counts["requests"] += 1
        counts["blocks"] += len(keys)
        counts["hit_blocks"] += served
        counts["tokens"] += req.input_length
        counts["hit_tokens"] += min(served * BLOCK_TOKENS, req.input_length)
        counts["bytes_read"] += served * config.block_bytes
        counts["bytes_written"] += len(new) * config.block_bytes
        if progress is not None:
            progress.update(1)

    async def worker() -> None:
        # Workers take requests in trace order: one request in flight per worker, as
        # ``concurrency`` engines would issue them.
        for req in stream:
            if time.perf_counter() - start > config.time_limit:
                return
            await one(req)

    try:
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    finally:
        if http is not None:
            await http.close()
    elapsed = time.perf_counter() - start
    for store in cluster.stores:
        await store.flush()
    blocks, hit_blocks = counts["blocks"], counts["hit_blocks"]
    row = _row(config, cluster, elapsed, latencies, counts["requests"], blocks, hit_blocks,
               counts["tokens"], counts["hit_tokens"], counts["bytes_read"],
               counts["bytes_written"])
    if ring is not None:
        row["remote_share"] = counts["remote_hits"] / hit_blocks if hit_blocks else 0.0
    row["remote_hit_blocks"] = counts["remote_hits"]
    row["tokens"], row["hit_tokens"] = counts["tokens"], counts["hit_tokens"]
    mean = sum(node_requests) / len(node_requests)
    row["node_requests"] = node_requests
    row["load_imbalance"] = max(node_requests) / mean if mean else 0.0
    return row


async def _locate_node(cluster: Cluster, http: Any, keys: list[bytes],
                       node_requests: list[int]) -> int:
    """The member with the longest local prefix (``POST /v1/locate`` to all), among those
    within the load bound; ties and non-answers go to the least loaded."""
    from kvtier.peer.locate import locate_prefix
    from kvtier.routing import pick_node

    members = [s.member_id for s in cluster.servers]
    found = await locate_prefix(members, keys, token=cluster.token, deadline=1.0, session=http)
    return pick_node([found[m].blocks if m in found else 0 for m in members], node_requests)


async def _local_node(cluster: Cluster, keys: list[bytes], node_requests: list[int]) -> int:
    """Per-node caches: the node whose own tiers hold the longest prefix (each store's
    :meth:`~kvtier.TieredStore.locate_prefix`, nothing refreshed), within the load bound."""
    from kvtier.routing import pick_node

    found = [await store.locate_prefix(keys) for store in cluster.stores]
    return pick_node([f.nodes[f.node].blocks if f.node in f.nodes else 0 for f in found],
                     node_requests)


def _tier_shares(cluster: Cluster) -> tuple[list[str], list[float], dict[str, int]]:
    """Hits per tier name summed over nodes; pooled hits are split by the segment tiers."""
    hits: dict[str, int] = {}
    order: list[str] = []

    def add(name: str, n: int) -> None:
        if name not in hits:
            order.append(name)
            hits[name] = 0
        hits[name] += n

    moved = {"promotions": 0, "demotions": 0}
    for store in cluster.stores:
        for tier in store.stats()["tiers"]:
            if tier["scheme"] == "peers":
                continue  # attributed below, to the segment tier that served the hit
            add(str(tier["scheme"]), int(tier.get("hits", 0)))
            moved["promotions"] += int(tier.get("promotions", 0))
            moved["demotions"] += int(tier.get("demotions", 0))
    for segment in cluster.segments:
        for tier in segment.stats()["tiers"]:
            add(f"pool-{tier['scheme']}", int(tier.get("hits", 0)))
            moved["promotions"] += int(tier.get("promotions", 0))
            moved["demotions"] += int(tier.get("demotions", 0))
    total = sum(hits.values())
    return order, [hits[n] / total if total else 0.0 for n in order], moved


def _row(config: RealConfig, cluster: Cluster, elapsed: float, latencies: list[float],
         n_req: int, blocks: int, hit_blocks: int, tokens: int, hit_tokens: int,
         bytes_read: int, bytes_written: int) -> dict[str, Any]:
    names, shares, moved = _tier_shares(cluster)
    remote_bytes = sum(srv.bytes_out + srv.bytes_in for srv in cluster.servers)
    return {
        "mode": config.mode, "routing": "none" if config.mode == "ideal" else config.routing,
        "placement": "block",
        "policy": "lru", "engine": "real", "nodes": config.nodes,
        "capacity_blocks": config.dram_blocks, "lmdb_blocks": config.lmdb_blocks,
        "requests": n_req, "block_refs": blocks,
        "prefix_hit_rate_blocks": hit_blocks / blocks if blocks else 0.0,
        "prefix_hit_rate_tokens": hit_tokens / tokens if tokens else 0.0,
        "remote_share": None, "tier_names": names, "tier_hit_share": shares,
        "block_bytes": config.block_bytes, "bytes_read": bytes_read,
        "bytes_written": bytes_written, "network_bytes": remote_bytes,
        "bytes_moved": remote_bytes + (moved["promotions"] + moved["demotions"])
        * config.block_bytes, **moved,
        "elapsed_s": elapsed, "requests_per_s": n_req / elapsed if elapsed else 0.0,
        "read_gbps": bytes_read / elapsed / 1e9 if elapsed else 0.0,
        "p50_ms": _percentile(latencies, 0.5) * 1e3, "p99_ms": _percentile(latencies, 0.99) * 1e3,
    }

