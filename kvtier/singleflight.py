"""Per-key coordination of in-flight store operations: generations, locks, shared fetches.

State exists only while an operation on the key is in flight (reference counted), so memory
stays bounded by concurrency, not by the number of keys ever seen.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvtier.tiers.base import Block

__all__ = ["LEADER_GONE", "Flight", "KeyRegistry", "KeyState", "LeaderGone"]


@dataclass(eq=False, slots=True)
class KeyState:
    """Bookkeeping of one key with operations in flight.

    ``gen`` moves on every put/delete of the key, so a promotion or write-through that read
    an older value can tell it has been superseded; ``lock`` orders write-through writes and
    deletes of the key in the lower tiers; ``deleting`` counts deletes in progress (a
    demotion of the key is pointless then, and would resurrect it).
    """

    gen: int = 0
    refs: int = 0
    deleting: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LeaderGone:
    """Result of a shared fetch whose leader was cancelled: followers fetch again."""


LEADER_GONE = LeaderGone()
Flight = asyncio.Future[Block | LeaderGone | None]


class KeyRegistry:
    """Key states and single-flight fetches of one store."""

    def __init__(self) -> None:
        self._states: dict[bytes, KeyState] = {}
        self._flights: dict[bytes, Flight] = {}

    # ------------------------------------------------------------------ states
    def watch(self, key: bytes) -> KeyState:
        """Take a reference on ``key``'s state (created on demand)."""
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = KeyState()
        state.refs += 1
        return state

    def unwatch(self, key: bytes, state: KeyState) -> None:
        """Release a reference taken by :meth:`watch`."""
        state.refs -= 1
        if state.refs <= 0 and self._states.get(key) is state:
            del self._states[key]

    def state(self, key: bytes) -> KeyState | None:
        """The key's state if an operation on it is in flight."""
        return self._states.get(key)

    def invalidate(self, key: bytes) -> None:
        """A put or delete of ``key``: in-flight promotions and write-throughs of it are stale,
        and later readers must not join a fetch that started before it."""
        state = self._states.get(key)
        if state is not None:
            state.gen += 1
        self._flights.pop(key, None)

    def __len__(self) -> int:
        return len(self._states)

    # ------------------------------------------------------------------ flights
    def flight(self, key: bytes) -> Flight | None:
        """The fetch of ``key`` in progress, if any."""
        return self._flights.get(key)

    def lead(self, key: bytes) -> Flight:
        """Register a new fetch of ``key`` led by the caller, who must :meth:`finish` it."""
        flight: Flight = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        return flight

    def finish(self, key: bytes, flight: Flight) -> None:
        """End a led fetch: followers still waiting learn the leader is gone."""
        if not flight.done():
            flight.set_result(LEADER_GONE)
        if self._flights.get(key) is flight:
            del self._flights[key]

    @staticmethod
    async def join(flight: Flight, deadline: float | None) -> Block | LeaderGone | None:
        """Wait for another call's fetch, no longer than ``deadline`` (a miss after it).

        The wait is shielded: a follower that gives up does not cancel the leader's fetch.
        """
        try:
            if deadline is None:
                return await asyncio.shield(flight)
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(flight)
        except TimeoutError:
            return None
