"""KV cache events: what this process's tiers admit and evict, for KV-aware routers.

A producer (a tier or the store) calls :meth:`EventHub.stored`, :meth:`EventHub.removed` or
:meth:`EventHub.cleared`; these never await, never block on a consumer and cost one append per
subscriber. Each :class:`Subscription` has a bounded buffer: when a consumer falls behind, the
oldest buffered events are dropped and counted (``Subscription.dropped``, ``EventHub.dropped``),
because a router that lost events must resynchronise anyway, while a store that waited for its
router would serve requests late. A consumer that wakes up takes everything buffered at once (a
batch), so it pays one wake-up per burst, not per event.

Usage::

    hub = EventHub(node="node0")
    async with hub.subscribe() as sub:     # or: async for event in hub.subscribe()
        hub.stored([k0, k1], tier="dram", parent=None, block_tokens=256)
        async for batch in sub.batches():  # lists of events, in emission order
            ...

Producers may call from any thread (an LMDB eviction running in ``asyncio.to_thread``): a
subscriber's wake-up is handed to its event loop with ``call_soon_threadsafe``.

Every event carries the hub's ``incarnation`` (random, new for every hub) and a ``seq`` in
emission order; every subscription starts with a resync (``AllBlocksCleared`` for the node,
then ``BlockStored`` for what it holds), so a consumer's view starts true after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_GPU", "MEDIUM_SHARED", "RESYNC_KEYS",
           "VLLM_MEDIUM", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventHub",
           "KVEvent", "Resident", "Subscription", "medium_of"]

# ``medium`` values, as in the contract and vLLM's events (vLLM itself spells its
# own tiers "GPU"/"CPU"; a publisher can map these with VLLM_MEDIUM).
MEDIUM_GPU = "gpu"
MEDIUM_CPU = "cpu"
MEDIUM_DISK = "disk"
MEDIUM_SHARED = "shared_storage"

#: kvtier medium -> vLLM 0.32's ``(medium, locality)``: its offloading tiers say "CPU" or
#: "STORAGE" (``vllm.v1.kv_offload.base.Medium``), its prefix cache "GPU", and a tier shared
#: with other instances is "REMOTE" (``Locality``). Used by the vLLM connector's events and
#: by ``ZmqEventPublisher(vllm_medium_names=True)``.
VLLM_MEDIUM: dict[str, tuple[str, str]] = {
    MEDIUM_GPU: ("GPU", "LOCAL"),
    MEDIUM_CPU: ("CPU", "LOCAL"),
    MEDIUM_DISK: ("STORAGE", "LOCAL"),
    MEDIUM_SHARED: ("STORAGE", "REMOTE"),
}

_SCHEME_MEDIUM = {
    "hbm": MEDIUM_GPU,
    "dram": MEDIUM_CPU,
    "lmdb": MEDIUM_DISK,
    "file": MEDIUM_DISK,
    # Shared by many nodes: a pool, a shared store or an object store.
    "peers": MEDIUM_SHARED,
    "redis": MEDIUM_SHARED,
    "redis+cluster": MEDIUM_SHARED,
    "mooncake": MEDIUM_SHARED,
    "s3": MEDIUM_SHARED,
    "gs": MEDIUM_SHARED,
    "memory": MEDIUM_CPU,
    # The host daemon's shared-memory DRAM (``kvtier serve --shm``): host memory on this
    # host, a hit one memcpy away, as vLLM's own CPU tier (one /dev/shm mapping shared by
    # an instance's workers) that vLLM reports as CPU/LOCAL. Not a storage medium, and not
    # reachable from other hosts' engines (those read it as a ``peers://`` pool member).
    "local": MEDIUM_CPU,
}


def medium_of(tier: object) -> str:
    """The event ``medium`` of a tier: its ``medium`` attribute if it has one (a ``file://``
    tier on a WEKA/VAST mount says ``shared_storage``), else by its ``scheme`` (``dram`` and
    ``local`` (the host daemon's shared memory) -> ``cpu``, ``lmdb``/``file`` -> ``disk``,
    ``peers``/``redis``/``s3``/... -> ``shared_storage``); an unknown scheme counts as
    ``disk``."""
    medium = getattr(tier, "medium", None)
    if isinstance(medium, str) and medium:
        return medium
    return _SCHEME_MEDIUM.get(str(getattr(tier, "scheme", "")), MEDIUM_DISK)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks ``keys`` (a prefix run, parent first) became readable from ``tier`` on ``node``.

    ``parent`` is the key of the block chained before ``keys[0]`` (``None`` at a prompt's
    start), ``block_tokens`` the tokens per block, ``token_ids`` the tokens of the blocks when
    the producer knows them (routers that hash tokens themselves need them; kvtier keys are
    already digests, so they are usually empty).
    """

    keys: tuple[bytes, ...]
    tier: str
    node: str
    medium: str
    parent: bytes | None = None
    block_tokens: int | None = None
    token_ids: tuple[int, ...] = ()
    ts: float = field(default_factory=time.time)
    seq: int = 0
    incarnation: str = ""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks ``keys`` stopped being readable from ``tier`` on ``node`` (evicted, demoted
    away or deleted)."""

    keys: tuple[bytes, ...]
    tier: str
    node: str
    medium: str
    ts: float = field(default_factory=time.time)
    seq: int = 0
    incarnation: str = ""


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of ``tier`` on ``node`` is gone (``tier`` ``None``: of every tier).

    The first event of every subscription is one with ``tier`` ``None``: forget what this
    node held before (another incarnation's blocks), the blocks it holds now follow.
    """

    node: str
    tier: str | None = None
    medium: str | None = None
    ts: float = field(default_factory=time.time)
    seq: int = 0
    incarnation: str = ""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _keys(keys: Iterable[bytes]) -> tuple[bytes, ...]:
    out = tuple(keys)
    for key in out:
        if not isinstance(key, bytes) or not 1 <= len(key) <= 128:
            raise TypeError(f"keys: expected bytes of 1..128 bytes, got {key!r:.60}")
    return out


class Subscription:
    """One consumer's bounded view of a hub's events (async iterator of events).

    Not for sharing between tasks: one task iterates. ``dropped`` counts the events this
    subscriber lost to its buffer bound.
    """

    def __init__(self, hub: EventHub, buffer: int, max_batch: int) -> None:
        self._hub = hub
        self._buffer: deque[KVEvent] = deque()
        self._limit = buffer
        self._max_batch = max_batch
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._pending: list[KVEvent] = []
        self.dropped = 0

    # -- producer side (any thread) -----------------------------------------------
    def _offer(self, event: KVEvent) -> int:
        """Buffer ``event``; returns how many events it pushed out (0 or 1)."""
        with self._lock:
            lost = 0
            if len(self._buffer) >= self._limit:
                self._buffer.popleft()
                lost = 1
                self.dropped += 1
            self._buffer.append(event)
        self._wake_consumer()
        return lost

    def _seed(self, events: list[KVEvent]) -> None:
        """Start the buffer with ``events`` (a resync): the bound grows by their number, so
        live events never push the resync out before it is taken."""
        with self._lock:
            self._buffer.extend(events)
            self._limit += len(events)
        if events:
            self._wake_consumer()

    def _wake_consumer(self) -> None:
        if threading.get_ident() == self._thread:
            self._wake.set()
        else:
            # RuntimeError: the consumer's loop is closed, nobody to wake.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wake.set)

    # -- consumer side --------------------------------------------------------------
    async def next_batch(self) -> list[KVEvent]:
        """Wait for events and return all buffered ones (at most ``max_batch``), oldest first.

        Raises
        ------
        StopAsyncIteration
            Once the subscription or its hub is closed and the buffer is drained.
        """
        while True:
            with self._lock:
                if self._buffer:
                    n = min(len(self._buffer), self._max_batch)
                    batch = [self._buffer.popleft() for _ in range(n)]
                    if not self._buffer:
                        self._wake.clear()
                    return batch
                self._wake.clear()
                if self._closed:
                    raise StopAsyncIteration
            await self._wake.wait()

    def drain_nowait(self) -> list[KVEvent]:
        """Everything buffered now, oldest first, without waiting (for synchronous pollers
        such as an engine connector's ``take_events()``)."""
        with self._lock:
            batch = list(self._buffer)
            self._buffer.clear()
            self._wake.clear()
        pending, self._pending = self._pending[::-1], []
        return pending + batch

    async def batches(self) -> AsyncIterator[list[KVEvent]]:
        """Batches of events until the subscription is closed."""
        while True:
            try:
                yield await self.next_batch()
            except StopAsyncIteration:
                return

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> KVEvent:
        if not self._pending:
            self._pending = await self.next_batch()
            self._pending.reverse()
        return self._pending.pop()

    def close(self) -> None:
        """Stop receiving; iteration ends once what is buffered has been taken. Any thread may
        call it, also after the store (or its event loop) closed; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._hub._unsubscribe(self)
        self._wake_consumer()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


#: What a hub's ``resident`` callback returns: per tier, ``(tier, medium, keys held)``.
Resident = Iterable[tuple[str, str, Sequence[bytes]]]
#: Keys per ``BlockStored`` of a subscription's resync.
RESYNC_KEYS = 1024


class EventHub:
    """Fan-out of KV events to bounded subscriptions; producers never wait.

    Every event carries the hub's :attr:`incarnation` (a random id, new for every hub, so
    for every process start) and a sequence number ``seq`` (1, 2, ... in emission order,
    across all producers' threads): a consumer that sees a gap in ``seq`` lost events, one
    that sees a new incarnation talks to a restarted node.

    Parameters
    ----------
    node
        This node's id, stamped on every event.
    buffer
        Default per-subscriber bound, in events.
    max_batch
        Most events a consumer takes per wake-up.
    resident
        What the node holds now (``(tier, medium, keys)`` per tier): each subscription
        starts with ``AllBlocksCleared`` (every tier) and then ``BlockStored`` for these
        keys, so a consumer's view starts true whatever it believed before (a restart, a
        late subscriber). ``None``: the subscription starts with the ``AllBlocksCleared``
        only.
    """

    def __init__(self, node: str, *, buffer: int = 10_000, max_batch: int = 1024,
                 resident: Callable[[], Resident] | None = None) -> None:
        if not isinstance(node, str) or not node:
            raise ValueError(f"node: expected a non-empty str, got {node!r}")
        for name, value in (("buffer", buffer), ("max_batch", max_batch)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.node = node
        self.incarnation = uuid.uuid4().hex[:16]
        self.resident = resident
        self._buffer = buffer
        self._max_batch = max_batch
        self._subs: tuple[Subscription, ...] = ()
        self._lock = threading.Lock()
        self.seq = 0  # of the last event emitted
        self.emitted = 0
        self.dropped = 0

    def subscribe(self, *, buffer: int | None = None, resync: bool = True) -> Subscription:
        """A new subscription on the running event loop (bounded to ``buffer`` events).

        With ``resync`` (default) it starts with ``AllBlocksCleared`` (``tier`` ``None``)
        and ``BlockStored`` runs (at most :data:`RESYNC_KEYS` keys each, ``parent``
        ``None``) for what the node holds now, all with the ``seq`` of the last event
        emitted before; the bound grows by their number.
        """
        size = self._buffer if buffer is None else buffer
        if type(size) is not int or size < 1:
            raise ValueError(f"buffer: expected an int >= 1, got {size!r}")
        sub = Subscription(self, size, self._max_batch)
        with self._lock:  # no event slips between the snapshot and the first live one
            if resync:
                sub._seed(self._resync_events())
            self._subs = (*self._subs, sub)
        return sub

    def _resync_events(self) -> list[KVEvent]:
        seq, inc = self.seq, self.incarnation
        out: list[KVEvent] = [AllBlocksCleared(self.node, seq=seq, incarnation=inc)]
        for tier, medium, keys in (self.resident() if self.resident is not None else ()):
            held = tuple(keys)
            for start in range(0, len(held), RESYNC_KEYS):
                out.append(BlockStored(held[start:start + RESYNC_KEYS], tier, self.node,
                                       medium, seq=seq, incarnation=inc))
        return out

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    @property
    def subscribers(self) -> int:
        """Open subscriptions."""
        return len(self._subs)

    def _emit(self, build: Callable[[int], KVEvent]) -> None:
        """Number and hand the event ``build(seq)`` to every subscriber, under the hub's
        lock: producers on several threads get their events out in ``seq`` order."""
        with self._lock:
            subs = self._subs
            if not subs:
                return
            self.seq += 1
            self.emitted += 1
            event = build(self.seq)
            for sub in subs:
                self.dropped += sub._offer(event)

    def emit(self, event: KVEvent) -> None:
        """Hand ``event`` to every subscriber, renumbered with this hub's ``seq`` and
        incarnation (a no-op without subscribers)."""
        self._emit(lambda seq: dataclasses.replace(event, seq=seq,
                                                   incarnation=self.incarnation))

    def stored(self, keys: Sequence[bytes], *, tier: str, medium: str,
               parent: bytes | None = None, block_tokens: int | None = None,
               token_ids: Sequence[int] = ()) -> None:
        """Emit :class:`BlockStored` for ``keys`` admitted into ``tier``."""
        if not self._subs or not keys:
            return
        checked, tokens = _keys(keys), tuple(token_ids)
        self._emit(lambda seq: BlockStored(checked, tier, self.node, medium, parent,
                                           block_tokens, tokens, seq=seq,
                                           incarnation=self.incarnation))

    def removed(self, keys: Sequence[bytes], *, tier: str, medium: str) -> None:
        """Emit :class:`BlockRemoved` for ``keys`` that left ``tier``."""
        if not self._subs or not keys:
            return
        checked = _keys(keys)
        self._emit(lambda seq: BlockRemoved(checked, tier, self.node, medium, seq=seq,
                                            incarnation=self.incarnation))

    def cleared(self, *, tier: str | None = None, medium: str | None = None) -> None:
        """Emit :class:`AllBlocksCleared` (``tier`` ``None``: every tier of this node)."""
        if self._subs:
            self._emit(lambda seq: AllBlocksCleared(self.node, tier, medium, seq=seq,
                                                    incarnation=self.incarnation))

    def close(self) -> None:
        """End every subscription (each still yields what it had buffered)."""
        for sub in self._subs:
            sub.close()
