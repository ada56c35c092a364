"""Keep the daemon's shared presence index (:mod:`kvtier.shm.index`) true to its store.

The feed subscribes to the store's KV events: a key is in the index while at least one tier
of the daemon's chain holds it (a demotion from DRAM to disk keeps it; an eviction from the
last tier, a delete or a tier's ``AllBlocksCleared`` removes it). The subscription's resync
seeds it with what the tiers hold at start; a subscription that lost events to its buffer
bound is replaced by a new one (a new resync). Handlers that change the store call
:meth:`IndexFeed.sync` before they answer, so an engine's next lookup sees its own commit or
delete; events from other threads (a disk tier's eviction) land when the feed's task runs.

Keys this daemon wrote to a pool tier of its chain stay while that tier's events say so;
keys only other pool members wrote are not in the index (the daemon learns of them only by
asking the pool, a network round trip).

Concurrency: the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Subscription

if TYPE_CHECKING:
    from kvtier.events import EventHub
    from kvtier.shm.index import PresenceIndex

__all__ = ["IndexFeed"]

log = logging.getLogger("kvtier.shm")
#: Events a feed's subscription buffers before it counts as lost (and resyncs).
_BUFFER = 1 << 20


class IndexFeed:
    """Apply ``hub``'s events to ``index``.

    Parameters
    ----------
    hub
        The daemon store's event hub.
    index
        The index file the daemon writes.
    """

    def __init__(self, hub: EventHub, index: PresenceIndex) -> None:
        self.hub = hub
        self.index = index
        self._held: dict[bytes, int] = {}  # key -> bitmask of tiers holding it
        self._bits: dict[str, int] = {}
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        #: Resyncs after a subscription lost events.
        self.resyncs = 0

    def start(self) -> None:
        """Subscribe (with a resync) and apply events as they come."""
        self._sub = self.hub.subscribe(buffer=_BUFFER, resync=True)
        self.sync()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while (sub := self._sub) is not None:
            try:
                batch = await sub.next_batch()
            except StopAsyncIteration:
                if self._sub is sub:  # the hub closed, not a resync's replacement
                    return
                continue
            self._apply(batch)
            self._check_lost()

    def sync(self) -> None:
        """Apply every event buffered now."""
        if self._sub is not None:
            self._apply(self._sub.drain_nowait())
            self._check_lost()

    def _check_lost(self) -> None:
        if self._sub is None or not self._sub.dropped:
            return
        log.warning("shared index: %d event(s) lost; resynchronising", self._sub.dropped)
        self._sub.close()
        self.resyncs += 1
        self._sub = self.hub.subscribe(buffer=_BUFFER, resync=True)
        self._apply(self._sub.drain_nowait())

    def _bit(self, tier: str) -> int:
        bit = self._bits.get(tier)
        if bit is None:
            bit = self._bits[tier] = 1 << len(self._bits)
        return bit

    def _apply(self, events: list[KVEvent]) -> None:
        if not events:
            return
        held = self._held
        inserts: set[bytes] = set()
        removes: set[bytes] = set()
        for event in events:
            if isinstance(event, BlockStored):
                bit = self._bit(event.tier)
                for key in event.keys:
                    had = held.get(key, 0)
                    held[key] = had | bit
                    if not had:
                        inserts.add(key)
                        removes.discard(key)
            elif isinstance(event, BlockRemoved):
                bit = self._bit(event.tier)
                for key in event.keys:
                    left = held.get(key, 0) & ~bit
                    if left:
                        held[key] = left
                    elif held.pop(key, None) is not None:
                        removes.add(key)
                        inserts.discard(key)
            elif isinstance(event, AllBlocksCleared):
                if event.tier is None:
                    held.clear()
                    inserts.clear()
                    removes.clear()
                    self.index.clear()
                    continue
                bit = self._bit(event.tier)
                for key in [k for k, mask in held.items() if mask & bit]:
                    left = held[key] & ~bit
                    if left:
                        held[key] = left
                    else:
                        del held[key]
                        removes.add(key)
                        inserts.discard(key)
        self.index.apply(inserts, removes)

    async def stop(self) -> None:
        """Unsubscribe and stop the task."""
        if self._sub is not None:
            self._sub.close()
            self._sub = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
