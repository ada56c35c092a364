"""Where a KV-aware router sends a request: the node with the longest local run of its prompt,
among the nodes whose load stays within :data:`LOAD_BOUND` times the mean.

This is consistent hashing with bounded loads (Mirrokni et al.) applied to prefix locality,
what llm-d's precise prefix scorer and Mooncake's Conductor do. The same choice serves
:meth:`kvtier.TieredStore.route` (runs predicted from the pool's chain placement, no
request), the dry replay's ``locate-bounded`` and ``owner`` routings and the real replay's
``locate-bounded`` routing (runs measured with ``POST /v1/locate``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from kvtier.errors import ConfigError
from kvtier.tiers.base import Tier

__all__ = ["LOAD_BOUND", "owner_runs", "pick_node", "route_by_owner"]

T = TypeVar("T", bound=Hashable)

# A node takes a request only while its load stays under 1.25 x the mean: the bound of
# Mirrokni et al.'s consistent hashing with bounded loads at epsilon = 0.25.
LOAD_BOUND = 1.25


def pick_node(runs: Sequence[int], loads: Sequence[float], bound: float | None = LOAD_BOUND
              ) -> int:
    """The index of the node to send a request to.

    Parameters
    ----------
    runs
        Per node, how many leading blocks of the request it serves locally.
    loads
        Per node, its load before this request (requests routed so far, or queue depth).
    bound
        A node whose load plus this request would exceed ``bound`` times the mean load
        (this request included) is skipped, unless it is the least loaded; ``None``: no bound.

    Returns
    -------
    int
        The node with the longest run among those within the bound; ties go to the least
        loaded, then to the lowest index.

    Raises
    ------
    ValueError
        If ``runs`` is empty or differs in length from ``loads``.
    """
    if not runs or len(runs) != len(loads):
        raise ValueError(f"runs, loads: expected equal non-empty lengths, got {len(runs)} "
                         f"and {len(loads)}")
    lightest = min(loads)
    limit = None if bound is None else bound * (sum(loads) + 1) / len(loads)
    best = -1
    for node, load in enumerate(loads):
        # The least-loaded node is always within the bound (min <= mean).
        if limit is not None and load + 1 > limit and load > lightest:
            continue
        if best < 0 or runs[node] > runs[best] or (
                runs[node] == runs[best] and load < loads[best]):
            best = node
    return best


def owner_runs(owners: Iterable[Sequence[T]], candidates: Sequence[T]) -> list[int]:
    """Per candidate, how many leading blocks it owns, given each block's owners in order
    (consumed only until no candidate owns the next block)."""
    runs = dict.fromkeys(candidates, 0)
    running = set(candidates)
    for block_owners in owners:
        running.intersection_update(block_owners)
        if not running:
            break
        for candidate in running:
            runs[candidate] += 1
    return [runs[c] for c in candidates]


def route_by_owner(tiers: Sequence[Tier], keys: Sequence[bytes], candidates: Sequence[str],
                   load: Mapping[str, float]) -> str:
    """:meth:`kvtier.TieredStore.route` over a store's ``tiers`` (see there)."""
    from kvtier.peer.tier import PeerTier

    if isinstance(candidates, str) or not candidates:
        raise ValueError(f"candidates: expected a non-empty sequence of member ids, "
                         f"got {candidates!r}")
    pool = next((t for t in tiers if isinstance(t, PeerTier)), None)
    if pool is None:
        raise ConfigError("route: the store has no peers:// tier to route by")
    runs = owner_runs((pool.owners(k) for k in keys), candidates)
    return candidates[pick_node(runs, [float(load.get(c, 0)) for c in candidates])]
