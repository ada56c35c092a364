"""Metadata-only replay: tier chains of block ids under the project's real policy classes.

One :class:`Simulation` is one result row (a mode, a routing, a policy, a capacity). All
simulations of a run are fed the same requests in one pass over the trace.

Convention (``../shared/traces/README.md``): a request's prefix hit is the run of leading
blocks found in some tier; then every block of the request is refreshed or inserted, last
block first, so a chain's head is its most recent entry and eviction takes tails first.

Load: by default a router's load signal is the number of requests each node was given so
far (``count``); with a :class:`~kvtier.replay.timed.NodeClock` (``--load inflight``) it is
the number each node has in flight at the request's arrival, and every request is timed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.peer.ring import DEFAULT_VNODES, HashRing
from kvtier.policy import ARCPolicy, RecencyPolicy, S3FIFOPolicy
from kvtier.replay.local import FORWARD_MARGIN, HOT_READS, MAX_COPIES, LocalPool
from kvtier.replay.timed import NodeClock
from kvtier.replay.trace import BLOCK_TOKENS, Request

__all__ = ["DEFAULT_POOL_VNODES", "MODES", "POLICIES", "ROUTINGS", "BlockPolicy", "Chain",
           "Simulation", "make_policy"]

MODES = ("per-node", "pooled", "local", "ideal")
ROUTINGS = ("rr", "random", "session", "prefix-affinity")
# Ring points per member for the pool: the same as a real PeerTier's (see
# docs/pooling-results.md for why 8192).
DEFAULT_POOL_VNODES = DEFAULT_VNODES


class BlockPolicy(Protocol):
    """What the replay needs of a policy: :class:`RecencyPolicy` and :class:`S3FIFOPolicy`."""

    def __contains__(self, key: object) -> bool: ...
    def touch(self, key: bytes) -> bool: ...
    def admit(self, key: bytes, size: int) -> None: ...
    def victims(self, incoming: int, replacing: bytes | None = None) -> list[bytes]: ...
    def remove(self, key: bytes) -> int | None: ...


POLICIES: dict[str, Callable[[int], BlockPolicy]] = {
    "lru": lambda cap: RecencyPolicy(cap),
    "s3fifo": lambda cap: S3FIFOPolicy(cap),
    "s3fifo2": lambda cap: S3FIFOPolicy(cap, promote_after=2),
    "arc": lambda cap: ARCPolicy(cap),
}


def make_policy(name: str, capacity_blocks: int) -> BlockPolicy:
    """A policy by name with a budget in blocks (every block has size 1)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(capacity_blocks)


class Chain:
    """One node's tiers, top first, with the store's semantics: a hit in tier ``t`` is
    copied into every tier above (promote all); a block evicted from tier ``i`` is demoted
    into tier ``i + 1`` unless already there."""

    __slots__ = ("demotions", "drops", "on_drop", "promotions", "tiers")

    def __init__(self, tiers: Sequence[BlockPolicy],
                 on_drop: Callable[[bytes], None] | None = None) -> None:
        self.tiers = list(tiers)
        self.demotions = 0
        self.promotions = 0
        self.drops = 0
        self.on_drop = on_drop  # told about every block that leaves the last tier

    def find(self, key: bytes) -> int:
        """Index of the first tier holding ``key``, or -1 (no recency refresh)."""
        for i, tier in enumerate(self.tiers):
            if key in tier:
                return i
        return -1

    def admit(self, level: int, key: bytes) -> None:
        """Put ``key`` into tier ``level``, demoting what it evicts down the chain."""
        tier = self.tiers[level]
        victims = tier.victims(1)
        for victim in victims:
            tier.remove(victim)
            below = level + 1
            if below == len(self.tiers):
                self.drops += 1
                if self.on_drop is not None:
                    self.on_drop(victim)
            elif victim not in self.tiers[below]:
                self.demotions += 1
                self.admit(below, victim)
        tier.admit(key, 1)

    def refresh(self, key: bytes) -> bool:
        """Read-or-insert ``key`` as a request does; returns whether it was inserted new."""
        tiers = self.tiers
        if tiers[0].touch(key):
            return False
        for level in range(1, len(tiers)):
            if tiers[level].touch(key):
                for upper in range(level - 1, -1, -1):
                    self.promotions += 1
                    self.admit(upper, key)
                return False
        self.admit(0, key)
        return True


class Simulation:
    """One replay configuration and its counters.

    Parameters
    ----------
    mode
        ``per-node`` (each node its own chain, requests routed), ``pooled`` (the block pool:
        each block lives on the chain of its ring owner), ``local`` (the local pool: a block
        lives where it was computed and is read from any holder, see
        :class:`~kvtier.replay.local.LocalPool`; one tier, LRU by global age) or ``ideal``
        (one chain of the total capacity).
    routing
        Which node serves a request (``rr``, ``random``, ``session``, ``prefix-affinity``).
    policy
        Policy name for every tier (see :data:`POLICIES`).
    nodes
        Serving nodes.
    capacities
        Blocks per node in each tier, top first.
    ring
        Placement for ``pooled`` (default: a :class:`HashRing` over ``node0..``).
    clock
        The timed load model (``None``: load is requests routed so far, nothing timed).
    hot_reads, max_copies, forward_margin
        ``local`` only: see :class:`~kvtier.replay.local.LocalPool`.
    """

    def __init__(self, mode: str, routing: str, policy: str, nodes: int,
                 capacities: Sequence[int], *, ring: HashRing | None = None,
                 seed: int = 0, cascade: bool = False, clock: NodeClock | None = None,
                 hot_reads: int = HOT_READS, max_copies: int = MAX_COPIES,
                 forward_margin: float = FORWARD_MARGIN) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: unknown {mode!r}; known: {', '.join(MODES)}")
        if routing not in ROUTINGS and mode != "ideal":
            raise ValueError(f"routing: unknown {routing!r}; known: {', '.join(ROUTINGS)}")
        if type(nodes) is not int or nodes < 1:
            raise ValueError(f"nodes: expected an int >= 1, got {nodes!r}")
        if not capacities or any(type(c) is not int or c < 1 for c in capacities):
            raise ValueError(f"capacity_blocks: expected ints >= 1, got {list(capacities)!r}")
        self.mode, self.routing, self.policy, self.nodes = mode, routing, policy, nodes
        self.capacities = list(capacities)
        self.placement = "local" if mode == "local" else "block"
        self.local: LocalPool | None = None
        if mode == "local":
            if len(capacities) != 1 or policy != "lru" or cascade:
                raise ValueError("mode local: one tier, policy lru (age is global), no cascade")
            self.local = LocalPool(nodes, capacities[0], hot_reads=hot_reads,
                                   max_copies=max_copies, forward_margin=forward_margin)
        if clock is not None and clock.nodes != nodes:
            raise ValueError(f"clock: has {clock.nodes} nodes, the simulation {nodes}")
        self.clock = clock
        if mode == "ideal":
            self.chains = [Chain([make_policy(policy, c * nodes) for c in capacities])]
        else:
            self.chains = [Chain([make_policy(policy, c) for c in capacities])
                           for _ in range(nodes)]
        # cascade: when a block leaves the pool, the blocks chained after it (its subtree in
        # the prefix tree) can never be a prefix hit until it returns, so they are dropped
        # too instead of squatting in other shards: tail-first eviction across the pool.
        self.cascade = cascade
        self._children: dict[bytes, set[bytes]] = {}
        self.orphans_dropped = 0
        if cascade:
            for chain in self.chains:
                chain.on_drop = self._drop_subtree
        self._tops = [chain.tiers[0] for chain in self.chains]
        self.members = [f"node{i}" for i in range(nodes)]
        self.ring = ring if ring is not None else HashRing(self.members, vnodes=DEFAULT_POOL_VNODES)
        self._member_index = {m: i for i, m in enumerate(self.ring.members)}
        self._owner: dict[bytes, int] = {}
        self._rng = random.Random(seed)
        self._rr = 0
        self._sessions: dict[str, int] = {}
        self.requests = 0
        self.blocks = 0
        self.hit_blocks = 0
        self.tokens = 0
        self.hit_tokens = 0
        self.tier_hits = [0] * len(capacities)
        self.remote_hits = 0
        self.remote_writes = 0
        self.inserted = 0
        self.shard_writes = [0] * nodes  # pooled: blocks written to each owner's shard
        self.node_requests = [0] * nodes

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.routing}/{self.policy}/C={self.capacities[0]}"

    # -- routing ---------------------------------------------------------------------
    def _next_rr(self) -> int:
        node = self._rr
        self._rr = (node + 1) % self.nodes
        return node

    def loads(self) -> list[int]:
        """Each node's load as routers see it now: requests routed so far (``count``), or
        requests in flight (timed)."""
        return self.clock.inflight if self.clock is not None else self.node_requests

    def tie_order(self) -> list[int]:
        """Nodes in the order routers break ties in: by index (``count``, as it always did),
        or least busy time so far first (timed: among idle nodes the least used one wins,
        not always the first)."""
        clock = self.clock
        if clock is None:
            return list(range(self.nodes))
        busy = clock.busy_s
        return sorted(range(self.nodes), key=busy.__getitem__)

    def _least_loaded(self) -> int:
        clock = self.clock
        assert clock is not None
        return min(range(self.nodes), key=lambda n: (clock.inflight[n], clock.remaining_s(n),
                                                     clock.busy_s[n]))

    def _route(self, req: Request, keys: Sequence[bytes]) -> int:
        routing = self.routing
        if self.mode == "ideal" and self.clock is not None:
            # One cache for all: where a request runs changes only its wait.
            return self._least_loaded()
        if self.mode == "ideal" or routing == "rr":
            return self._next_rr()
        if routing == "random":
            return self._rng.randrange(self.nodes)
        if routing == "session":
            # Traces without sessions: a conversation's turns share its prompt up to the
            # last turn, so its second block (the first after a common system prompt) names it.
            sid = req.session if req.session is not None else (
                f"#{req.hash_ids[min(1, len(req.hash_ids) - 1)]}" if req.hash_ids else "")
            node = self._sessions.get(sid)
            if node is None:
                node = self._sessions[sid] = self._next_rr()
            return node
        # prefix-affinity: the node whose own tiers hold the longest prefix; ties (usually
        # "nobody") go round-robin so load stays balanced, as a KV-aware router does.
        if self.mode == "pooled":
            return self._next_rr()
        if self.local is not None:
            runs = [self.local.local_run(n, keys) for n in range(self.nodes)]
            best_run = max(runs)
            return runs.index(best_run) if best_run else self._next_rr()
        best, best_len = -1, 0
        for node, chain in enumerate(self.chains):
            n = 0
            for key in keys:
                if chain.find(key) < 0:
                    break
                n += 1
            if n > best_len:
                best, best_len = node, n
        return best if best >= 0 else self._next_rr()

    def owner(self, key: bytes) -> int:
        """Pool member index owning ``key`` (memoised ring lookup)."""
        node = self._owner.get(key)
        if node is None:
            node = self._owner[key] = self._member_index[self.ring.primary(key)]
        return node

    @staticmethod
    def _admit_top(chain: Chain, key: bytes) -> None:
        # Chain.admit for a one-tier chain, without the demotion bookkeeping (hot path).
        tier = chain.tiers[0]
        for victim in tier.victims(1):
            tier.remove(victim)
            chain.drops += 1
            if chain.on_drop is not None:
                chain.on_drop(victim)
        tier.admit(key, 1)

    def _chain_of(self, key: bytes) -> Chain:
        return self.chains[self.owner(key)] if self.mode == "pooled" else self.chains[0]

    def _drop_subtree(self, key: bytes) -> None:
        stack = list(self._children.get(key, ()))
        while stack:
            child = stack.pop()
            if self.mode == "per-node":  # a node only knows its own chain's blocks
                holders = [c for c in self.chains if child in c.tiers[-1]]
            else:
                holders = [self._chain_of(child)]
            for chain in holders:
                for tier in chain.tiers:
                    if tier.remove(child) is not None:
                        self.orphans_dropped += 1
                        stack.extend(self._children.get(child, ()))

    # -- one request -----------------------------------------------------------------
    def feed(self, req: Request, keys: Sequence[bytes]) -> None:
        """Replay one request whose block keys are ``keys``."""
        clock = self.clock
        if clock is not None:
            clock.advance(req.timestamp / 1000)
        node = self._route(req, keys)
        remote_before = self.remote_hits
        if self.cascade:
            children = self._children
            for i in range(len(keys) - 1):
                kids = children.get(keys[i])
                if kids is None:
                    children[keys[i]] = {keys[i + 1]}
                else:
                    kids.add(keys[i + 1])
        self.requests += 1
        self.node_requests[node] += 1
        nkeys = len(keys)
        hit = 0
        if self.local is not None:
            hit, remote = self.local.serve(node, keys)
            self.tier_hits[0] += hit
            self.remote_hits += remote
        elif self.mode == "pooled":
            owner = self.owner
            memo = self._owner
            owners = [memo[k] if k in memo else owner(k) for k in keys]
            chains = self.chains
            if len(self.capacities) == 1:  # hot path: one tier per owner
                tops = self._tops
                for i in range(nkeys):
                    if keys[i] not in tops[owners[i]]:
                        break
                    hit += 1
                self.tier_hits[0] += hit
                self.remote_hits += hit - owners[:hit].count(node)
                for i in range(nkeys - 1, -1, -1):
                    o = owners[i]
                    if not tops[o].touch(keys[i]):
                        self._admit_top(chains[o], keys[i])
                        self.inserted += 1
                        self.shard_writes[o] += 1
                        if o != node:
                            self.remote_writes += 1
            else:
                for i in range(nkeys):
                    level = chains[owners[i]].find(keys[i])
                    if level < 0:
                        break
                    self.tier_hits[level] += 1
                    if owners[i] != node:
                        self.remote_hits += 1
                    hit += 1
                for i in range(nkeys - 1, -1, -1):
                    if chains[owners[i]].refresh(keys[i]):
                        self.inserted += 1
                        self.shard_writes[owners[i]] += 1
                        if owners[i] != node:
                            self.remote_writes += 1
        else:
            chain = self.chains[0] if self.mode == "ideal" else self.chains[node]
            tiers = chain.tiers
            if len(tiers) == 1:  # the common case, kept tight: this loop is the hot path
                top = tiers[0]
                for key in keys:
                    if key not in top:
                        break
                    hit += 1
                self.tier_hits[0] += hit
                touch = top.touch
                admit = self._admit_top
                for i in range(nkeys - 1, -1, -1):
                    if not touch(keys[i]):
                        admit(chain, keys[i])
                        self.inserted += 1
            else:
                for key in keys:
                    level = chain.find(key)
                    if level < 0:
                        break
                    self.tier_hits[level] += 1
                    hit += 1
                for i in range(nkeys - 1, -1, -1):
                    if chain.refresh(keys[i]):
                        self.inserted += 1
        self.blocks += nkeys
        self.hit_blocks += hit
        tokens = req.input_length
        hit_tokens = min(hit * BLOCK_TOKENS, tokens)
        self.tokens += tokens
        self.hit_tokens += hit_tokens
        if clock is not None:
            clock.serve(node, tokens, req.output_length, hit_tokens,
                        self.remote_hits - remote_before)

    # -- results ---------------------------------------------------------------------
    def result(self, block_bytes: int) -> dict[str, Any]:
        """The result row (rates are fractions in [0, 1])."""
        hits = self.hit_blocks
        local = self.local
        if local is not None:  # the local pool writes remotely only when it forwards
            self.remote_writes = local.forwarded
        moves = self.mode in ("pooled", "local")
        pooled = self.mode == "pooled"
        written: int = sum(self.shard_writes)
        row: dict[str, Any] = {
            "mode": self.mode,
            "routing": self.routing,
            "policy": self.policy,
            "nodes": self.nodes,
            "capacity_blocks": self.capacities[0],
            "tier_capacity_blocks": self.capacities,
            "prefix_hit_rate_blocks": hits / self.blocks if self.blocks else 0.0,
            "prefix_hit_rate_tokens": self.hit_tokens / self.tokens if self.tokens else 0.0,
            "remote_share": (self.remote_hits / hits if hits else 0.0) if moves else None,
            "tier_hit_share": [h / hits if hits else 0.0 for h in self.tier_hits],
            "hit_blocks": hits,
            "block_refs": self.blocks,
            "inserted_blocks": self.inserted,
            "promotions": sum(c.promotions for c in self.chains),
            "demotions": sum(c.demotions for c in self.chains),
            "evictions": sum(c.drops for c in self.chains),
            "orphans_dropped": self.orphans_dropped,
            "shard_write_imbalance": (max(self.shard_writes) * self.nodes / written
                                      if pooled and written else None),
            "bytes_remote_read": self.remote_hits * block_bytes if moves else 0,
            "bytes_remote_written": self.remote_writes * block_bytes if moves else 0,
            "bytes_moved": ((self.remote_hits + self.remote_writes) * block_bytes if moves
                            else 0) + sum(c.demotions + c.promotions for c in self.chains)
            * block_bytes,
        }
        if local is not None:
            row["local_pool"] = local.stats()
        if self.clock is not None:
            row.update(self.clock.metrics())
        if pooled and self._owner:
            per_node = [0] * self.nodes
            for o in self._owner.values():
                per_node[o] += 1
            row["shard_imbalance"] = max(per_node) / (len(self._owner) / self.nodes)
        return row
