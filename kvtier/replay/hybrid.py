"""Hybrid layout for the dry engine: a private top tier per node above the pooled tier, at the
same total memory as a plain pool (``private`` + ``pooled`` blocks per node = C).

The private tier is write-through to the pool (``DESIGN.md`` section 5: private tiers above a
pool are write-through to it), so each block a request touches is refreshed or inserted in
the serving node's private tier and in its owner's shard; a prefix hit is the run of leading
blocks found in either. Routing (``rr``, ``session``) decides which private tier serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.replay.sim import BlockPolicy, Simulation, make_policy
from kvtier.replay.trace import BLOCK_TOKENS, Request

__all__ = ["HybridSimulation"]


class HybridSimulation:
    """``private_blocks`` per node in a private policy above a pool of ``pooled_blocks`` per
    shard (the shards of a :class:`~kvtier.replay.sim.Simulation` in ``pooled`` mode)."""

    def __init__(self, routing: str, policy: str, nodes: int, private_blocks: int,
                 pooled_blocks: int, *, private_policy: str = "lru") -> None:
        if private_blocks < 1 or pooled_blocks < 1:
            raise ValueError("private_blocks and pooled_blocks: expected >= 1")
        # The pool part reuses Simulation for routing, ring and shard policies.
        self.pool = Simulation("pooled", routing, policy, nodes, [pooled_blocks])
        self.private: list[BlockPolicy] = [make_policy(private_policy, private_blocks)
                                           for _ in range(nodes)]
        self.private_blocks, self.pooled_blocks = private_blocks, pooled_blocks
        self.private_hits = 0
        self.pool_hits = 0
        self.blocks = self.tokens = self.hit_tokens = 0

    def feed(self, req: Request, keys: Sequence[bytes]) -> None:
        """Replay one request whose block keys are ``keys``."""
        pool = self.pool
        node = pool._route(req, keys)
        mine = self.private[node]
        shards = pool._tops
        owners = [pool.owner(k) for k in keys]
        hit = 0
        for key, owner in zip(keys, owners, strict=True):
            if key in mine:
                self.private_hits += 1
            elif key in shards[owner]:
                self.pool_hits += 1
            else:
                break
            hit += 1
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            for tier in (mine, shards[owners[i]]):
                if not tier.touch(key):
                    for victim in tier.victims(1):
                        tier.remove(victim)
                    tier.admit(key, 1)
        self.blocks += len(keys)
        self.tokens += req.input_length
        self.hit_tokens += min(hit * BLOCK_TOKENS, req.input_length)

    @property
    def hit_blocks(self) -> int:
        """Prefix-hit blocks so far (private + pooled)."""
        return self.private_hits + self.pool_hits

    def result(self, block_bytes: int) -> dict[str, Any]:
        """The result row (same keys as :meth:`Simulation.result` where they apply)."""
        hits = self.hit_blocks
        return {"mode": "hybrid", "routing": self.pool.routing, "policy": self.pool.policy,
                "nodes": self.pool.nodes,
                "capacity_blocks": self.private_blocks + self.pooled_blocks,
                "tier_capacity_blocks": [self.private_blocks, self.pooled_blocks],
                "prefix_hit_rate_blocks": hits / self.blocks if self.blocks else 0.0,
                "prefix_hit_rate_tokens": self.hit_tokens / self.tokens if self.tokens else 0.0,
                "tier_hit_share": [self.private_hits / hits if hits else 0.0,
                                   self.pool_hits / hits if hits else 0.0],
                "hit_blocks": hits, "block_refs": self.blocks, "block_bytes": block_bytes}
