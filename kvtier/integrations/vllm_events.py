"""KV cache events of :class:`~kvtier.integrations.vllm.KVTierConnector`, for ``take_events()``.

vLLM's scheduler calls ``connector.take_events()`` every step (in the EngineCore process) and
publishes what it returns in its own ``KVEventBatch``, under its own pod identity, next to the
GPU prefix cache's events. The scheduler-side connector does not do the saves (the workers do,
in other processes), so events are built in two halves:

* when the scheduler plans a save it snapshots what vLLM's own ``BlockStored`` carries for
  those blocks while the ``Request`` is alive (``request.block_hashes``, parent hash, token ids,
  LoRA) under a save id that travels with the plan;
* each worker reports the save ids whose writes completed (or failed) in its
  :class:`KVTierWorkerMetadata` (``build_connector_worker_meta``); vLLM sums them over the
  workers and hands them to the scheduler in ``update_connector_output``; a save announced
  by every shard (TP rank, PP stage) becomes one ``BlockStored`` per medium it landed in.

A block whose load failed (evicted after the lookup) is announced as ``BlockRemoved``.

Events are vLLM's own classes (``vllm.distributed.kv_events``) when vLLM is importable, so its
publisher encodes them like its own; otherwise dataclasses with the same fields (tests). The
buffer is bounded: past ``capacity`` the oldest events are dropped and counted (a router that
lost events resynchronises; the scheduler never waits for it).
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.events import MEDIUM_SHARED, VLLM_MEDIUM, medium_of

__all__ = ["ConnectorEvents", "KVTierWorkerMetadata", "LocalBlockRemoved", "LocalBlockStored",
           "event_media"]


@dataclass(frozen=True)
class _Scheme:
    scheme: str


def event_media(tier_urls: Sequence[str]) -> list[tuple[str, str]]:
    """The distinct ``(medium, locality)`` pairs vLLM events use for these tiers, in order.

    ``dram``/``memory`` -> ``("CPU", "LOCAL")``, ``hbm`` -> ``("GPU", "LOCAL")``,
    ``lmdb``/``file`` -> ``("STORAGE", "LOCAL")``, a pool or shared store (``peers``,
    ``redis``, ``s3``, ...) -> ``("STORAGE", "REMOTE")``.
    """
    media: list[tuple[str, str]] = []
    for url in tier_urls:
        kv_medium = medium_of(_Scheme(url.split("://", 1)[0].lower()))
        pair = VLLM_MEDIUM.get(kv_medium, VLLM_MEDIUM[MEDIUM_SHARED])
        if pair not in media:
            media.append(pair)
    return media


@dataclass
class LocalBlockStored:
    """``vllm.distributed.kv_events.BlockStored``'s fields, used when vLLM is not installed."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None
    group_idx: int | None = None


@dataclass
class LocalBlockRemoved:
    """``vllm.distributed.kv_events.BlockRemoved``'s fields, used when vLLM is not installed."""

    block_hashes: list[bytes | int]
    medium: str | None
    locality: str | None = None
    group_idx: int | None = None


def _worker_metadata_bases() -> tuple[type[Any], ...]:
    try:
        base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    except ImportError:
        return ()
    return (base.KVConnectorWorkerMetadata,)


@dataclass
class _WorkerMetadata:
    """Save ids whose writes completed (``saved``) or failed (``failed``), with how many
    workers reported each; :meth:`aggregate` sums them (vLLM calls it across workers)."""

    saved: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: Any) -> Any:
        for mine, theirs in ((self.saved, other.saved), (self.failed, other.failed)):
            for save_id, count in theirs.items():
                mine[save_id] = mine.get(save_id, 0) + count
        return self


@dataclass
class KVTierWorkerMetadata(_WorkerMetadata, *_worker_metadata_bases()):  # type: ignore[misc]
    """Worker -> scheduler report of one step (vLLM ``KVConnectorWorkerMetadata``)."""


@dataclass
class _StoredRun:
    hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    reports: int = 0


def _local_convert(block_hash: bytes) -> bytes | int:
    # vLLM's maybe_convert_block_hash: events carry the low 64 bits as an int unless
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class ConnectorEvents:
    """The scheduler side's event state: pending save snapshots and the bounded outbox.

    Parameters
    ----------
    media
        ``(medium, locality)`` pairs a completed save is announced in (:func:`event_media`).
    block_size
        Tokens per block.
    shards
        Workers that must report a save before it counts (TP size x PP size).
    capacity
        Events buffered between two :meth:`take` calls; older ones are dropped past it.
    pending_saves
        Save snapshots kept while their workers have not reported (oldest dropped past it).

    Called from the scheduler thread only.
    """

    def __init__(self, media: Sequence[tuple[str, str]], block_size: int, shards: int,
                 capacity: int = 10_000, pending_saves: int = 65_536) -> None:
        self.media = list(media)
        self.block_size = block_size
        self.shards = shards
        self.capacity = capacity
        self.pending_saves = pending_saves
        self.dropped = 0
        self._outbox: deque[Any] = deque()
        self._pending: OrderedDict[int, _StoredRun] = OrderedDict()
        self._next_id = 0
        self._stored_cls, self._removed_cls, self._convert, self._extra_keys = _event_api()

    def record_save(self, request: Any, first: int, end: int) -> int:
        """Snapshot blocks ``first..end-1`` of ``request``; the save id for its plan, or -1
        when the request has no vLLM block hashes for them (prefix caching off)."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        if len(hashes) < end or first >= end:
            return -1
        lora = getattr(request, "lora_request", None)
        lora_id = getattr(lora, "adapter_id", getattr(lora, "lora_int_id", None)) if lora else None
        lora_name = getattr(lora, "name", getattr(lora, "lora_name", None)) if lora else None
        tokens = request.all_token_ids[first * self.block_size:end * self.block_size]
        run = _StoredRun(hashes[first:end], hashes[first - 1] if first > 0 else None,
                         [int(t) for t in tokens], lora_id, lora_name,
                         self._block_extra_keys(request, first, end))
        save_id = self._next_id
        self._next_id += 1
        self._pending[save_id] = run
        while len(self._pending) > self.pending_saves:  # a worker that never reported
            self._pending.popitem(last=False)
        return save_id

    def _block_extra_keys(self, request: Any, first: int, end: int) -> list[Any] | None:
        """vLLM's per-block ``extra_keys`` (LoRA name, multimodal items, cache salt), as its
        prefix cache publishes them; ``None`` without vLLM."""
        if self._extra_keys is None:
            return None
        generate, to_event = self._extra_keys
        keys: list[Any] = []
        mm_index = 0
        try:
            for block in range(first, end):
                extra, mm_index = generate(request, block * self.block_size,
                                           (block + 1) * self.block_size, mm_index)
                keys.append(extra)
            converted: list[Any] | None = to_event(keys)
        except (AttributeError, TypeError, ValueError, IndexError):
            return None  # not a vLLM Request (a test's stand-in): the hashes still identify
        return converted

    def worker_report(self, meta: Any) -> None:
        """Apply the workers' aggregated :class:`KVTierWorkerMetadata` of one step."""
        if not isinstance(meta, _WorkerMetadata):
            return
        for save_id in meta.failed:  # a block missing on any shard cannot be loaded
            self._pending.pop(save_id, None)
        for save_id, count in sorted(meta.saved.items()):
            run = self._pending.get(save_id)
            if run is None:
                continue
            run.reports += count
            if run.reports >= self.shards:
                del self._pending[save_id]
                self._stored(run)

    def _stored(self, run: _StoredRun) -> None:
        hashes = [self._convert(h) for h in run.hashes]
        parent = self._convert(run.parent) if run.parent is not None else None
        for medium, locality in self.media:
            self._emit(self._stored_cls(
                block_hashes=list(hashes), parent_block_hash=parent,
                token_ids=list(run.token_ids), block_size=self.block_size,
                lora_id=run.lora_id, medium=medium, lora_name=run.lora_name,
                locality=locality, group_idx=0, **self._extra_field(run)))

    def _extra_field(self, run: _StoredRun) -> dict[str, Any]:
        return {} if self._extra_keys is None else {"extra_keys": run.extra_keys}

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        """Announce blocks kvtier no longer holds (their load failed) in every medium."""
        if not block_hashes:
            return
        hashes = [self._convert(h) for h in block_hashes]
        for medium, locality in self.media:
            self._emit(self._removed_cls(block_hashes=list(hashes), medium=medium,
                                         locality=locality, group_idx=0))

    def _emit(self, event: Any) -> None:
        if self.capacity == 0:
            self.dropped += 1
            return
        if len(self._outbox) >= self.capacity:
            self._outbox.popleft()
            self.dropped += 1
        self._outbox.append(event)

    def take(self) -> list[Any]:
        """Events since the last call, oldest first."""
        events = list(self._outbox)
        self._outbox.clear()
        return events


def _event_api() -> tuple[Any, Any, Any, tuple[Any, Any] | None]:
    """vLLM's ``BlockStored``, ``BlockRemoved``, hash conversion and extra-keys helpers, or the
    local stand-ins (no extra keys)."""
    try:
        events: Any = importlib.import_module("vllm.distributed.kv_events")
        utils: Any = importlib.import_module("vllm.v1.core.kv_cache_utils")
    except ImportError:
        return LocalBlockStored, LocalBlockRemoved, _local_convert, None
    return (events.BlockStored, events.BlockRemoved, utils.maybe_convert_block_hash,
            (utils.generate_block_hash_extra_keys, utils.to_event_extra_keys))
