"""Publish kvtier's KV events on ZMQ in vLLM's KV-event wire format (``kvtier[events]``).

What existing KV-aware routers (vLLM's own subscribers, llm-d's KV cache indexer) consume:
a ZMQ PUB socket sending three frames per batch,

1. topic, ``kv@<node>@<model>`` by default;
2. sequence number, u64 big-endian, one per batch, from 0;
3. a msgpack ``KVEventBatch`` (``ts``, ``events``, ``data_parallel_rank``), its events tagged
   msgspec structs ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with vLLM's field
   names (the structs below mirror ``vllm/distributed/kv_events.py``).

Batch 0 of every publisher is the hub's resync (``AllBlocksCleared``, then ``BlockStored``
for what the node holds): a restarted node says so first, to a subscriber that watches the
sequence (it went back to 0) and to one that does not. Each batch also carries the hub's
``incarnation`` (a field vLLM's decoder ignores).

With ``replay_endpoint`` a ROUTER socket answers a subscriber's request for missed batches
(frames ``[b"", start_seq u64 BE]``) with ``[b"", seq, payload]`` per kept batch from
``start_seq`` on, then ``[b"", -1 as i64 BE, b""]``, as vLLM's publisher does.

Every ``BlockStored`` / ``BlockRemoved`` also carries ``tier``, the kvtier tier's name (a
field vLLM's decoder ignores): a medium names a kind of device, and two tiers of one kind
(``lmdb://`` and ``file://`` are both ``STORAGE``) are told apart by ``(medium, tier)``.

kvtier keys are digests, so ``block_hashes`` are the 16-byte keys (vLLM's
``ExternalBlockHash`` is ``bytes | int``) and ``token_ids`` is empty unless the producer knew
the tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvtier.events import (
    VLLM_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventHub,
    KVEvent,
    Subscription,
)

__all__ = ["END_SEQ", "VLLM_MEDIUM", "MediumMap", "VllmAllBlocksCleared", "VllmBlockRemoved",
           "VllmBlockStored", "VllmKVEventBatch", "ZmqEventPublisher", "kvtier_medium",
           "to_vllm", "vllm_medium"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)

# A medium as sent: (medium, locality); locality None is left off the wire.
MediumMap = Callable[[str], tuple[str, str | None]]


def kvtier_medium(medium: str) -> tuple[str, str | None]:
    """kvtier's own spelling (``cpu``, ``disk``, ...), without a locality."""
    return medium, None


def vllm_medium(medium: str) -> tuple[str, str | None]:
    """vLLM 0.32's spelling and locality (:data:`kvtier.events.VLLM_MEDIUM`: ``cpu`` ->
    ``("CPU", "LOCAL")``, ``disk`` -> ``("STORAGE", "LOCAL")``, ``shared_storage`` ->
    ``("STORAGE", "REMOTE")``); a medium kvtier does not define goes out upper-cased, without
    a locality."""
    return VLLM_MEDIUM.get(medium, (medium.upper(), None))


class _EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None
    # kvtier's addition: the publisher's incarnation (a decoder of vLLM's struct ignores
    # the field; one that reads it tells a restart apart from a sequence gap).
    incarnation: str | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False,
                    tag=True):
    pass


class VllmBlockStored(_KVCacheEvent, tag="BlockStored"):
    """vLLM's ``BlockStored`` (field order and names as in vLLM)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # required (no default), as in vLLM: always on the wire
    locality: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # kvtier's addition (vLLM's decoder ignores it): the tier's name, so that two tiers of
    # one medium (lmdb:// and file://, both STORAGE) stay apart in an index keyed by it.
    tier: str | None = None


class VllmBlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved`` (plus kvtier's ``tier``)."""

    block_hashes: list[bytes | int]
    medium: str | None
    locality: str | None = None
    group_idx: int | None = None
    tier: str | None = None


class VllmAllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared`` (no fields). kvtier adds ``tier``, ``medium`` and
    ``locality`` when one tier was emptied (a wiped or gc-ed directory, a closing tier); a
    decoder that reads none of them clears every block of the node."""

    tier: str | None = None
    medium: str | None = None
    locality: str | None = None


class VllmKVEventBatch(_EventBatch):
    """vLLM's ``KVEventBatch``: what one PUB message carries."""

    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def to_vllm(event: KVEvent, medium: MediumMap = kvtier_medium
            ) -> VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared:
    """One kvtier event as vLLM's struct (``medium`` maps kvtier's medium name to the
    ``(medium, locality)`` sent, see :func:`vllm_medium`)."""
    if isinstance(event, BlockStored):
        name, locality = medium(event.medium)
        return VllmBlockStored(block_hashes=list(event.keys), parent_block_hash=event.parent,
                               token_ids=list(event.token_ids),
                               block_size=event.block_tokens or 0, lora_id=None,
                               medium=name, lora_name=None, locality=locality,
                               tier=event.tier)
    if isinstance(event, BlockRemoved):
        name, locality = medium(event.medium)
        return VllmBlockRemoved(block_hashes=list(event.keys), medium=name, locality=locality,
                                tier=event.tier)
    if isinstance(event, AllBlocksCleared):
        if event.tier is None:
            return VllmAllBlocksCleared()
        if event.medium is None:
            return VllmAllBlocksCleared(tier=event.tier)
        name, locality = medium(event.medium)
        return VllmAllBlocksCleared(tier=event.tier, medium=name, locality=locality)
    raise TypeError(f"event: expected a kvtier KV event, got {type(event).__name__}")


class ZmqEventPublisher:
    """Subscribes to an :class:`~kvtier.events.EventHub` and publishes its batches on ZMQ.

    Parameters
    ----------
    hub
        The events' source.
    endpoint
        PUB address; bound (``tcp://127.0.0.1:5557``, ``tcp://*:5557``, ``ipc://...``). Port 0
        (``tcp://127.0.0.1:0``) binds a free port, see :attr:`endpoint` after :meth:`start`.
    model
        Model name for the default topic ``kv@<node>@<model>``.
    topic
        Overrides the topic.
    replay_endpoint
        Optional ROUTER address answering requests for missed batches.
    buffer_batches
        Batches kept for replay.
    hwm
        ZMQ send high-water mark: past it PUB drops messages for a slow subscriber (ZMQ's own
        never-block rule, on top of the hub's bounded buffer).
    vllm_medium_names
        Send vLLM 0.32's spelling and ``locality``, as its own offloading connectors do
        (``CPU``/``LOCAL``, ``STORAGE``/``LOCAL``, ``STORAGE``/``REMOTE`` for a shared tier;
        :func:`vllm_medium`) instead of kvtier's (``cpu``, ``disk``, ``shared_storage``,
        no locality).
    data_parallel_rank
        Stamped on each batch (vLLM's field), ``None`` to omit it.

    Use ``async with`` (or :meth:`start` / :meth:`aclose`) on the loop the hub's producers run on.
    """

    def __init__(self, hub: EventHub, endpoint: str, *, model: str = "", topic: str | None = None,
                 replay_endpoint: str | None = None, buffer_batches: int = 10_000,
                 hwm: int = 100_000, vllm_medium_names: bool = False,
                 data_parallel_rank: int | None = None) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint: expected a ZMQ address like tcp://127.0.0.1:5557, "
                             f"got {endpoint!r}")
        if type(buffer_batches) is not int or buffer_batches < 0:
            raise ValueError(f"buffer_batches: expected an int >= 0, got {buffer_batches!r}")
        self.hub = hub
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic if topic is not None else f"kv@{hub.node}@{model}"
        self._topic = self.topic.encode()
        self._hwm = hwm
        self._medium: MediumMap = vllm_medium if vllm_medium_names else kvtier_medium
        self._rank = data_parallel_rank
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches or None)
        self._keep = buffer_batches > 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self.seq = 0
        self.sent_events = 0
        self.dropped_batches = 0  # batches ZMQ refused (kept for replay all the same)

    async def start(self) -> None:
        """Bind the sockets and start publishing."""
        if self._ctx is not None:
            raise RuntimeError("ZmqEventPublisher already started")
        self._ctx = zmq.asyncio.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self._hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(self.replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            raise
        self._sub = self.hub.subscribe()
        self._tasks.append(asyncio.create_task(self._publish(self._sub),
                                               name="kvtier-zmq-pub"))
        if self._router is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(),
                                                   name="kvtier-zmq-replay"))

    def encode(self, events: list[KVEvent]) -> bytes:
        """The msgpack payload of one batch."""
        batch = VllmKVEventBatch(ts=time.time(), events=[to_vllm(e, self._medium)
                                                         for e in events],
                                 data_parallel_rank=self._rank,
                                 incarnation=self.hub.incarnation)
        return self._encoder.encode(batch)

    async def _publish(self, sub: Subscription) -> None:
        pub = self._pub
        if pub is None:  # pragma: no cover - start() sets it before creating this task
            return
        async for events in sub.batches():
            payload = self.encode(events)
            seq = self.seq
            self.seq += 1
            try:
                # PUB never blocks: past the high-water mark ZMQ drops the message.
                await pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                         flags=zmq.NOBLOCK)
                self.sent_events += len(events)
            except zmq.Again:
                self.dropped_batches += 1
                log.debug("kv events: batch %d dropped by ZMQ (high-water mark)", seq)
            except zmq.ZMQError:
                self.dropped_batches += 1
                log.exception("kv events: publishing batch %d failed", seq)
            if self._keep:
                self._kept.append((seq, payload))

    async def _serve_replay(self) -> None:
        router = self._router
        if router is None:  # pragma: no cover - start() only creates this task with a router
            return
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._kept):
                if seq >= first:
                    await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def aclose(self) -> None:
        """Publish what is buffered, stop, and close the sockets."""
        if self._ctx is None:
            return
        if self._sub is not None:
            self._sub.close()
        publisher, *others = self._tasks
        for task in others:
            task.cancel()
        # The publisher drains what the subscription buffered, then ends; bounded in time.
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(publisher, timeout=5.0)
        for task in others:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._close_sockets()

    async def __aenter__(self) -> ZmqEventPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
