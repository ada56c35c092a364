"""Locate-aware routing for the dry replay: send a request to the node that can serve the
longest prefix of it *locally* (without a network fetch), ties by load.

This is what a KV-aware router does with ``store.locate_prefix`` (``POST /v1/locate``): each
node reports how many leading blocks of the prompt its own tiers hold. In ``per-node`` mode a
node's local tiers are its whole chain; in ``pooled`` mode they are its own shard of the pool,
so a node's local run starts at the prompt's first block and ends at the first block it does
not own or does not hold; in ``local`` mode they are the blocks the node keeps itself.

Four routings:

``locate``
    The longest local prefix wins; ties (usually "nobody holds anything") go to the node with
    the fewest requests so far.
``locate-bounded``
    The same among the nodes whose request count stays within :data:`LOAD_BOUND` times the
    mean (consistent hashing with bounded loads): a prefix shared by every request (a system
    prompt) cannot pull all traffic to one node.
``locate-live``
    A live router's score, as llm-d's precise prefix-cache scorer plus its queue scorer
    combine them: per node, ``run / len(prompt) - LIVE_LOAD_WEIGHT * (q - q_min) / (q_max -
    q_min)`` (the load term is 0 when every node has the same ``q``), where ``q`` is the
    node's load; the highest score wins, ties to the least loaded. ``LIVE_LOAD_WEIGHT`` is
    0.5, half of what llm-d's gateway plugin profile implies (it weighs its prefix-cache and
    queue scorers equally, weight 2 each: weight 1 here); at weight 1 per-node caches on the
    agentic trace send so much work away from the prefix's holder that they lose ~40 points
    of hit rate and saturate (docs/pooling-results.md), so 0.5 is the stronger baseline.
``owner``
    What :meth:`kvtier.TieredStore.route` does: no locate request; per-node and ``pooled``:
    the node owning the longest leading run of the prompt on the ring; ``local``: the holder
    of the longest leading run by the holder directory; within the same load bound. On the
    ring a run is predicted, not checked against what the node holds.

Load is the number of requests routed so far (``--load count``), or, with the timed model
(``--load inflight``), the number each node has in flight at the request's arrival.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.replay.sim import Simulation
from kvtier.replay.trace import Request
from kvtier.routing import LOAD_BOUND, owner_runs, pick_node

__all__ = ["LIVE_LOAD_WEIGHT", "LOAD_BOUND", "LOCATE_ROUTINGS", "LocateSimulation",
           "format_routing_table", "live_pick", "make_simulation", "routing_metrics"]

LOCATE_ROUTINGS = ("locate", "locate-bounded", "locate-live", "owner")
LIVE_LOAD_WEIGHT = 0.5


def live_pick(runs: Sequence[int], loads: Sequence[float], blocks: int,
              weight: float = LIVE_LOAD_WEIGHT) -> int:
    """``locate-live``'s choice: the node with the highest prefix score minus load penalty
    (see the module docstring); ties go to the least loaded, then the lowest index."""
    low, high = min(loads), max(loads)
    spread = high - low
    best, best_score = 0, float("-inf")
    for node, (run, load) in enumerate(zip(runs, loads, strict=True)):
        score = (run / blocks if blocks else 0.0) - (
            weight * (load - low) / spread if spread else 0.0)
        if score > best_score or (score == best_score and load < loads[best]):
            best, best_score = node, score
    return best


class LocateSimulation(Simulation):
    """A :class:`~kvtier.replay.sim.Simulation` routed by local prefix length.

    Parameters
    ----------
    mode
        ``per-node``, ``pooled`` or ``local`` (``ideal`` has one chain: nothing to route).
    routing
        One of :data:`LOCATE_ROUTINGS`.
    policy, nodes, capacities, ring, seed, cascade, clock, hot_reads, max_copies
        As for :class:`~kvtier.replay.sim.Simulation`.
    live_weight
        ``locate-live``'s load weight (default :data:`LIVE_LOAD_WEIGHT`).
    """

    def __init__(self, mode: str, routing: str, policy: str, nodes: int,
                 capacities: Sequence[int], *, live_weight: float = LIVE_LOAD_WEIGHT,
                 **options: Any) -> None:
        if routing not in LOCATE_ROUTINGS:
            raise ValueError(f"routing: expected one of {', '.join(LOCATE_ROUTINGS)}, "
                             f"got {routing!r}")
        if mode not in ("per-node", "pooled", "local"):
            raise ValueError(f"mode: locate routing needs per-node, pooled or local, "
                             f"got {mode!r}")
        super().__init__(mode, "rr", policy, nodes, capacities, **options)
        self.routing = routing
        self.load_bound = None if routing in ("locate", "locate-live") else LOAD_BOUND
        if not live_weight >= 0:
            raise ValueError(f"live_weight: expected >= 0, got {live_weight!r}")
        self.live_weight = live_weight
        self.local_blocks = 0  # sum over requests of the chosen node's local prefix

    def local_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Per node, how many leading ``keys`` its own tiers hold (no recency refresh)."""
        out = [0] * self.nodes
        if not keys:
            return out
        if self.local is not None:
            return [self.local.local_run(n, keys) for n in range(self.nodes)]
        if self.mode == "per-node":
            for node, chain in enumerate(self.chains):
                tiers = chain.tiers
                n = 0
                if len(tiers) == 1:
                    top = tiers[0]
                    for key in keys:
                        if key not in top:
                            break
                        n += 1
                else:
                    for key in keys:
                        if chain.find(key) < 0:
                            break
                        n += 1
                out[node] = n
            return out
        # pooled: only the owner of the first block can hold a leading run.
        first = self.owner(keys[0])
        chain = self.chains[first]
        n = 0
        for key in keys:
            if self.owner(key) != first or chain.find(key) < 0:
                break
            n += 1
        out[first] = n
        return out

    def owned_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Per node, how many leading ``keys`` it owns (on the ring; in ``local`` mode, holds
        by the directory), as :func:`kvtier.routing.owner_runs` counts them for a real pool."""
        if self.local is not None:
            holders = self.local.holders
            return owner_runs((holders.get(k, ()) for k in keys), range(self.nodes))
        return owner_runs(([self.owner(k)] for k in keys), range(self.nodes))

    def _route(self, req: Request, keys: Sequence[bytes]) -> int:
        local = self.owned_prefix(keys) if self.routing == "owner" else self.local_prefix(keys)
        loads = self.loads()
        order = self.tie_order()  # both pickers break ties by position: least busy first
        runs = [local[n] for n in order]
        queued = [loads[n] for n in order]
        if self.routing == "locate-live":
            best = order[live_pick(runs, queued, len(keys), self.live_weight)]
        else:
            best = order[pick_node(runs, queued, self.load_bound)]
        self.local_blocks += local[best]
        return best


def make_simulation(mode: str, routing: str, policy: str, nodes: int,
                    capacities: Sequence[int], **options: Any) -> Simulation:
    """A :class:`Simulation`, or a :class:`LocateSimulation` for the locate routings."""
    if routing in LOCATE_ROUTINGS:
        return LocateSimulation(mode, routing, policy, nodes, capacities, **options)
    return Simulation(mode, routing, policy, nodes, capacities, **options)


def routing_metrics(sim: Simulation, block_bytes: int) -> dict[str, Any]:
    """What routing costs and balances: bytes crossing the network per request (pool reads
    of remote shards plus writes of new blocks to remote owners), and requests per node.

    ``load_imbalance`` is the busiest node's request count over the mean (1.0 is perfect);
    with the timed model, its busy time over the mean busy time. ``remote_bytes_per_request``
    is 0 for per-node and ideal rows, which move nothing.
    """
    requests = sim.requests
    pooled = sim.mode in ("pooled", "local")
    per_node: Sequence[float] = (sim.clock.busy_s if sim.clock is not None
                                 else sim.node_requests)
    mean = sum(per_node) / len(per_node) if per_node else 0.0
    read = sim.remote_hits * block_bytes if pooled else 0
    written = sim.remote_writes * block_bytes if pooled else 0
    return {
        "placement": sim.placement,
        "load_imbalance": max(per_node) / mean if mean else 0.0,
        "remote_read_bytes_per_request": read / requests if requests else 0.0,
        "remote_write_bytes_per_request": written / requests if requests else 0.0,
        "remote_bytes_per_request": (read + written) / requests if requests else 0.0,
    }


def format_routing_table(rows: Sequence[dict[str, Any]]) -> str:
    """Routing columns of result rows: placement, load max/mean, remote MiB per request."""
    timed = any("ttft_p50_s" in r for r in rows)
    header = (f"{'mode':<9} {'routing':<15} {'placement':<10} {'C/node':>7} {'hit(blk)':>9} "
              f"{'load max/mean':>13} {'remote MiB/req':>14} {'(read+write)':>16}")
    if timed:
        header += f" {'TTFT p50 s':>10} {'p90 s':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        if "remote_bytes_per_request" not in r:
            continue
        line = (
            f"{r['mode']:<9} {r['routing']:<15} {r['placement']:<10} {r['capacity_blocks']:>7} "
            f"{r['prefix_hit_rate_blocks'] * 100:>8.1f}% {r['load_imbalance']:>13.2f} "
            f"{r['remote_bytes_per_request'] / 2**20:>14.2f} "
            f"{r['remote_read_bytes_per_request'] / 2**20:>7.2f}+"
            f"{r['remote_write_bytes_per_request'] / 2**20:<8.2f}")
        if timed:
            line += f" {r.get('ttft_p50_s', 0.0):>10.3f} {r.get('ttft_p90_s', 0.0):>8.3f}"
        lines.append(line)
    return "\n".join(lines)
