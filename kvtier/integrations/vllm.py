"""vLLM v1 KV connector: ``KVTierConnector`` (load with ``kv_connector_module_path``).

::

    --kv-transfer-config '{"kv_connector":"KVTierConnector",
        "kv_connector_module_path":"kvtier.integrations.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"tiers":["dram://?capacity=8GiB","file:///mnt/kv"]}}'

vLLM constructs the connector twice: in the scheduler (``role`` SCHEDULER) and in each worker
(``role`` WORKER), usually in different processes. The scheduler side
(:class:`~kvtier.integrations.vllm_plan.SchedulerPlanner`) answers prefix lookups and plans
loads and saves; the worker side (:class:`WorkerSide`) moves blocks between vLLM's paged
per-layer tensors and kvtier through a :class:`~kvtier.BlockingStore`. See
``docs/integrations/vllm.md``.

This module imports without vLLM (the class then derives from a small local base with the
same metadata-binding methods), so it can be driven by fakes and type-checked anywhere.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvtier.blocking import BlockingStore
from kvtier.errors import ConfigError
from kvtier.integrations.cpu_affinity import pin_current_thread, worker_spare_cpus
from kvtier.integrations.miss_log import LookupStore
from kvtier.integrations.paged import PagedLayers
from kvtier.integrations.vllm_events import ConnectorEvents, KVTierWorkerMetadata, event_media
from kvtier.integrations.vllm_local import LocalLookups, LocalWorkerSide, is_local_only
from kvtier.integrations.vllm_plan import (
    BlockPlan,
    ConnectorSettings,
    KeyMaker,
    KVTierMetadata,
    SchedulerPlanner,
    plan_keys,
)
from kvtier.integrations.vllm_saves import SHUTDOWN_GRACE_S, SaveTracking
from kvtier.keys import KeyNamespace
from kvtier.store import TieredStore
from kvtier.tiers.dram_arena import fault_in

__all__ = ["KVTierConnector", "KVTierMetadata", "WorkerSide", "vllm_available"]

log = logging.getLogger("kvtier.integrations.vllm")

#: ``close_timeout`` of the connector's stores: at shutdown, after the saves' grace
#: (:data:`~kvtier.integrations.vllm_saves.SHUTDOWN_GRACE_S`), a store waits this long for
#: what is still in flight, then this long for its flush, so the whole shutdown stays under
#: vLLM's 5 s before it kills the process.
STORE_CLOSE_S = 1.0


class _LocalBase:
    """Stands in for ``KVConnectorBase_V1`` when vLLM is not installed (metadata binding)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self._vllm_config = vllm_config
        self._role = role
        self._kv_cache_config = kv_cache_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._connector_metadata: Any = None

    @property
    def role(self) -> Any:
        return self._role

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Any:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata bound for this step")
        return self._connector_metadata


def _vllm_bases() -> tuple[type[Any], ...]:
    try:
        base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    except ImportError:
        return (_LocalBase,)
    return (base.KVConnectorBase_V1, base.SupportsHMA)


_BASES = _vllm_bases()


def vllm_available() -> bool:
    """Whether the connector derives from vLLM's real ``KVConnectorBase_V1``."""
    return _BASES[0] is not _LocalBase


def _metadata_bases() -> tuple[type[Any], ...]:
    try:
        base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    except ImportError:
        return ()
    return (base.KVConnectorMetadata,)


@dataclass
class _VLLMMetadata(KVTierMetadata, *_metadata_bases()):  # type: ignore[misc]
    """:class:`KVTierMetadata` registered as vLLM ``KVConnectorMetadata``."""


def namespace_for(vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings,
                  tp_size: int) -> KeyNamespace:
    """The base key namespace: model, KV dtype, a layout tag (engine, device, shapes), TP size.

    :class:`KeyMaker` adds each shard's TP rank and PP stage.
    """
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, list | tuple):  # vLLM allows several names; the first is canonical
        served = served[0] if served else None
    model = settings.model or str(served or model_config.model)
    dtype = str(cache_config.cache_dtype)
    if dtype == "auto":
        dtype = str(model_config.dtype).removeprefix("torch.")
    layout = settings.layout
    if layout is None:
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        device = getattr(vllm_config.device_config, "device_type", "") or ""
        # No layer count: with PP the scheduler's and each stage's configs list different
        # layers, and the model name already fixes it.
        layout = (f"vllm/{device}/{type(spec).__name__}/H{spec.num_kv_heads}"
                  f"/D{spec.head_size}/B{spec.block_size}")
    return KeyNamespace(model=model, dtype=dtype, layout=layout, tp_size=tp_size)


def cpu_reservation_note(vllm_config: Any, cpus: int, environ: Mapping[str, str]
                         ) -> str | None:
    """Why this CPU engine will run slowly with any KV connector, or ``None``.

    vLLM's CPU backend keeps one core per rank free for its scheduler process and, when a KV
    connector is configured, one more per rank; on a host with no more cores than that it
    keeps none free. Every worker rank then runs as many OMP threads as there are cores, and
    the scheduler process busy-waits for each step's result on one of them: on a loaded
    2-core host every forward pass (prefix-cache hits included) took 5-10x longer.
    """
    if getattr(vllm_config.device_config, "device_type", "") != "cpu" or \
            "VLLM_CPU_NUM_OF_RESERVED_CPU" in environ:
        return None
    parallel = vllm_config.parallel_config
    ranks = int(parallel.tensor_parallel_size) * int(getattr(parallel,
                                                             "pipeline_parallel_size", 1))
    if cpus > 2 * ranks:
        return None
    return (f"vLLM's CPU backend reserves {2 * ranks} core(s) when a KV connector is "
            f"configured and this host has {cpus}, so it reserves none: the scheduler "
            "process's busy-wait competes with the OMP threads of every forward pass (5-10x "
            "slower steps on a loaded host). Set VLLM_CPU_NUM_OF_RESERVED_CPU="
            f"{ranks} (as without a connector) before starting vLLM.")


@dataclass
class _Load:
    plan: BlockPlan
    future: concurrent.futures.Future[list[bool]]
    staging: npt.NDArray[np.uint8]  # (blocks, block_bytes): row i is block_ids[i]
    scattered: bool = False  # its rows were copied into the engine's pages (or dropped)


@dataclass
class _Held:
    offset: int
    count: int
    future: concurrent.futures.Future[Any]
    ready: Callable[[], bool] | None  # more than the future's end that must happen first


class StagingArea:
    """Host rows that loads land in before their scatter (or saves gather into), faulted in
    once and reused.

    A new array per transfer costs a page fault per 4 KiB on its first write: on the
    benchmark VM 15-60 ms for a 16 MiB prompt, more than the copy itself
    (``docs/performance.md``). Rows are handed out as a ring: each transfer holds its rows
    until its future ended (and, for a load, its rows were scattered), and rows come back
    oldest first. A transfer that failed or was abandoned at its timeout (the store's thread
    may still be using its rows) keeps the old array for itself: the area maps a new one once
    nothing else holds rows. A transfer that does not fit gets a fresh array. Called from
    the worker thread only.
    """

    def __init__(self, rows: npt.NDArray[np.uint8]) -> None:
        fault_in(rows.reshape(-1))
        self.rows = rows
        self._held: collections.deque[_Held] = collections.deque()
        self._given: _Held | None = None  # taken, not yet held
        self._spoiled = False  # a failed transfer's rows are in the array
        self.fresh = 0  # transfers that did not fit and got an array of their own

    def _release(self) -> None:
        while self._held and self._ended(self._held[0]):
            done = self._held.popleft().future
            self._spoiled |= done.cancelled() or done.exception() is not None
        if not self._held and self._spoiled:
            self.rows = np.empty_like(self.rows)
            fault_in(self.rows.reshape(-1))
            self._spoiled = False

    @staticmethod
    def _ended(held: _Held) -> bool:
        return held.future.done() and (held.ready is None or held.ready())

    def _offset(self, count: int) -> int | None:
        size = len(self.rows)
        if not self._held:
            return 0 if count <= size else None
        oldest, newest = self._held[0], self._held[-1]
        end = newest.offset + newest.count
        if newest.offset >= oldest.offset:  # one run [oldest, end): room after it, or at 0
            if end + count <= size:
                return end
            return 0 if count <= oldest.offset else None
        return end if end + count <= oldest.offset else None  # wrapped: room in between

    def take(self, count: int, fresh: Callable[[int], npt.NDArray[np.uint8]]
             ) -> npt.NDArray[np.uint8]:
        """``count`` rows: from the area when they fit, else ``fresh(count)``. Rows from the
        area must be given to :meth:`hold` before the next call."""
        self._release()
        offset = None if self._spoiled else self._offset(count)
        if offset is None:
            self.fresh += 1
            return fresh(count)
        self._given = _Held(offset, count, concurrent.futures.Future(), None)
        return self.rows[offset:offset + count]

    def hold(self, rows: npt.NDArray[np.uint8], future: concurrent.futures.Future[Any],
             ready: Callable[[], bool] | None = None) -> None:
        """Keep ``rows`` (as :meth:`take` returned them) from reuse until ``future`` is done
        and ``ready()`` is true."""
        given, self._given = self._given, None
        if given is not None and np.shares_memory(rows, self.rows):
            self._held.append(_Held(given.offset, given.count, future, ready))


class WorkerSide(SaveTracking):
    """The worker side: executes each step's :class:`KVTierMetadata` on the paged tensors.

    Loads run through one ``store.get_many_into`` into the rows of one host staging array,
    then one batched scatter into the engine's blocks (synchronous loads before the forward
    pass, asynchronous ones when :meth:`finished_loads` finds them done). Saves gather all of
    a request's blocks in one batched copy, then ``put_many`` in the background; a later load
    of a key waits for its save. The gather runs on a thread of its own, so the step that
    computed the blocks returns (and samples its token) without waiting for it; vLLM writes
    pages only in a forward pass, and the next step's :meth:`start_loads`, which comes before
    its forward pass (and before any scatter of ours), waits for every gather first: a page
    freed meanwhile (a preempted request) is never overwritten while it is copied.
    Called from the worker thread only.
    """

    def __init__(self, store: BlockingStore, keys: KeyMaker, shard: tuple[int, int],
                 io_timeout_s: float, staging_bytes: int = 0,
                 max_blocks: int | None = None,
                 thread_cpus: Literal["spare", "inherit"] = "inherit") -> None:
        super().__init__()
        self.store = store
        self.keys = keys
        self.shard = shard
        self.io_timeout_s = io_timeout_s
        self.staging_bytes = staging_bytes
        self.max_blocks = max_blocks  # blocks of the longest request (max_model_len)
        self.staging: StagingArea | None = None  # loads land here
        self.save_staging: StagingArea | None = None  # saves gather here
        self.thread_cpus = thread_cpus
        self.cpus: set[int] = set()  # where the connector's threads run (empty: inherited)
        self._gatherer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-save-gather", initializer=self._pin_gather_thread)
        self._async_loads: list[_Load] = []
        self._failed_async: set[str] = set()  # asynchronous loads that failed to start

    def register(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        # vLLM pinned this worker to its compute cores before it registers the KV caches.
        # The save gather (a copy that would preempt the next step) gets the spare CPUs only;
        # the store's thread also the worker's own, which are idle while a synchronous load
        # runs on it (pinned to the spare ones alone, a 16 MiB peer load took 32 ms, not 23).
        if self.thread_cpus == "spare" and (cpus := worker_spare_cpus()):
            compute = os.sched_getaffinity(0)
            self.store.submit(partial(_pin_store_thread, cpus=cpus | compute)
                              ).result(self.io_timeout_s)
            self.cpus = cpus
            log.info("kvtier: the connector's save gather runs on CPUs %s, its store thread "
                     "on those and this worker's compute CPUs %s", sorted(cpus),
                     sorted(compute))
        self.layers = PagedLayers(kv_caches, num_blocks)
        rows = min(_staging_blocks(self.staging_bytes, self.layers.block_bytes,
                                   self.max_blocks), num_blocks)
        if rows > 0:
            self.staging = StagingArea(self.layers.empty(rows))
            self.save_staging = StagingArea(self.layers.empty(rows))

    def _keys(self, plan: BlockPlan) -> list[bytes]:
        return plan_keys(plan, self.keys, self.shard)

    def _pin_gather_thread(self) -> None:
        if self.cpus:
            pin_current_thread(self.cpus)

    def start_loads(self, meta: KVTierMetadata) -> None:
        self.pages_settled(meta)  # a gather is a memory copy on this host: it ends on its own
        layers = self._layers()
        for plan in meta.loads:
            try:
                load = self._start_load(layers, plan)
            except Exception as exc:  # whatever failed (store, memory): a miss, not a crash
                self._load_failed(plan, exc)
                if plan.load_async:  # vLLM waits for it: reported at the next get_finished
                    self._failed_async.add(plan.req_id)
                continue
            if plan.load_async:
                self._async_loads.append(load)
            else:
                self._finish_load(load, wait=True)

    def _start_load(self, layers: PagedLayers, plan: BlockPlan) -> _Load:
        keys = self._keys(plan)
        self._saves_ended(keys, self.io_timeout_s)
        # Into host staging, never straight into vLLM's pages: a load abandoned at its
        # timeout keeps running in a thread and must not write a page vLLM recomputes.
        staging = layers.empty(len(keys)) if self.staging is None else \
            self.staging.take(len(keys), layers.empty)
        future = self.store.submit(partial(_get_into, keys=keys, outs=list(staging)))
        load = _Load(plan, future, staging)
        if self.staging is not None:
            self.staging.hold(staging, future, partial(_scattered, load))
        return load

    def _finish_load(self, load: _Load, *, wait: bool) -> None:
        layers = self._layers()
        try:
            hits = load.future.result(self.io_timeout_s if wait else 0)
            found = [i for i, hit in enumerate(hits) if hit]
            if len(found) == len(hits):
                layers.scatter_many(load.plan.block_ids, load.staging)
            else:
                self._load_errors.update(b for b, hit in zip(load.plan.block_ids, hits,
                                                            strict=True) if not hit)
                if found:
                    layers.scatter_many([load.plan.block_ids[i] for i in found],
                                        load.staging[found])
        except Exception as exc:  # a block half scattered is recomputed too
            load.future.cancel()
            self._load_failed(load.plan, exc)
        finally:
            load.scattered = True

    def finished_loads(self) -> set[str]:
        done = [load for load in self._async_loads if load.future.done()]
        for load in done:
            self._async_loads.remove(load)
            self._finish_load(load, wait=False)
        failed, self._failed_async = self._failed_async, set()
        return {load.plan.req_id for load in done} | failed

    def _start_save(self, layers: PagedLayers, plan: BlockPlan, keys: list[bytes]
                    ) -> concurrent.futures.Future[None]:
        rows = layers.empty(len(keys)) if self.save_staging is None else \
            self.save_staging.take(len(keys), layers.empty)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        gather = self._gatherer.submit(self._gather_and_put, layers, plan.block_ids, keys,
                                       rows, future)
        self._page_copies.append((gather, frozenset(plan.block_ids)))
        if self.save_staging is not None:
            self.save_staging.hold(rows, future)
        return future

    def _gather_and_put(self, layers: PagedLayers, block_ids: list[int], keys: list[bytes],
                        rows: npt.NDArray[np.uint8],
                        future: concurrent.futures.Future[None]) -> None:
        """On the gather thread: copy the blocks out of the pages, then write them; ``future``
        ends with the write."""
        try:
            items = list(zip(keys, layers.gather_many(block_ids, out=rows), strict=True))
            written = self.store.submit(partial(_put_and_wait_written, items=items))
        except BaseException as exc:  # the save fails alone; vLLM's step goes on
            future.set_exception(exc)
            return
        written.add_done_callback(partial(_pass_outcome, future))

    def close(self) -> None:
        """Wait (bounded: :data:`~kvtier.integrations.vllm_saves.SHUTDOWN_GRACE_S`) for the
        saves in flight, logging those that did not end, then close the store within its
        :data:`STORE_CLOSE_S` bounds: a tier that hangs must not hold vLLM's teardown until
        it kills the process."""
        self._wait_for_saves(SHUTDOWN_GRACE_S)
        self._page_copies.clear()
        self._gatherer.shutdown(wait=False)
        for load in self._async_loads:
            load.future.cancel()
        self._async_loads.clear()
        _close_store(self.store)


class KVTierConnector(*_BASES):  # type: ignore[misc]
    """vLLM ``KVConnectorBase_V1`` (and ``SupportsHMA``) backed by a kvtier pool.

    Parameters
    ----------
    vllm_config, role, kv_cache_config
        As vLLM's connector factory passes them. ``kv_transfer_config.kv_connector_extra_config``
        holds the settings (:class:`~kvtier.integrations.vllm_plan.ConnectorSettings`):
        ``tiers`` is required.

    Notes
    -----
    The scheduler-side object opens a :class:`~kvtier.BlockingStore` over
    ``scheduler_tiers`` (when there are any); each worker opens one over ``tiers``. Only
    full blocks are stored; one kvtier block is one vLLM block across all layers. Saves copy
    each block out of vLLM's pages, then ``put_many`` and wait for its write-through writes in
    the background; a request with saves reports ``True`` from :meth:`request_finished`, and the
    workers report it from :meth:`get_finished` once those writes reached every tier, so a
    finished request's blocks are readable by other processes sharing a pool or persistent
    tier.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                f"KVTierConnector handles one KV cache group; this model has "
                f"{len(kv_cache_config.kv_cache_groups)} (a hybrid model): start vLLM with "
                "--disable-hybrid-kv-cache-manager")
        parallel = vllm_config.parallel_config
        tp_size = int(parallel.tensor_parallel_size)
        pp_size = int(getattr(parallel, "pipeline_parallel_size", 1))
        block_size = int(vllm_config.cache_config.block_size)
        self._kv_cache_config = kv_cache_config
        self._is_worker = getattr(role, "name", str(role)).upper().endswith("WORKER")
        shard = _shard() if self._is_worker else (0, 0)
        keys = KeyMaker(self._settings,
                        namespace_for(vllm_config, kv_cache_config, self._settings, tp_size),
                        block_size, pp_size)
        # Write-through: a block saved into this worker's private DRAM must also reach the
        # shared tiers below, where other engines (and this engine's scheduler) can see it.
        options = {"write_policy": "write_through", "close_timeout": STORE_CLOSE_S,
                   **self._settings.store_options}
        self._planner: SchedulerPlanner | None = None
        self._worker: WorkerSide | LocalWorkerSide | None = None
        if self._is_worker and is_local_only(self._settings.tiers):
            # On the host daemon: one copy per hit and per save, no store in the worker.
            self._worker = LocalWorkerSide(self._settings.tiers[0], keys, shard,
                                           self._settings.io_timeout_s,
                                           self._settings.thread_cpus)
        elif self._is_worker:
            max_len = getattr(vllm_config.model_config, "max_model_len", None)
            max_blocks = -(-int(max_len) // block_size) if max_len else None
            # Known before the layers register only where vLLM's spec says it.
            staging = _staging_blocks(self._settings.staging_bytes,
                                      _block_bytes(kv_cache_config), max_blocks) \
                * _block_bytes(kv_cache_config)
            self._worker = WorkerSide(
                BlockingStore(list(self._settings.tiers),
                              tier_options=_warm_answer_buffers(self._settings.tiers, staging),
                              **options),
                keys, shard, self._settings.io_timeout_s, self._settings.staging_bytes,
                max_blocks, self._settings.thread_cpus)
        else:
            note = cpu_reservation_note(vllm_config, os.cpu_count() or 1, os.environ)
            if note:
                log.warning(note)
            sched = list(self._settings.scheduler_tiers)
            events = None
            # Only when vLLM publishes KV events (as its scheduler decides).
            kv_events = getattr(vllm_config, "kv_events_config", None)
            wanted = bool(getattr(kv_events, "enable_kv_cache_events", False))
            if self._settings.event_buffer > 0 and wanted:
                # Saves write through to every tier, so a saved block is in each one's medium.
                events = ConnectorEvents(event_media(self._settings.tiers), block_size,
                                         len(keys.shards), capacity=self._settings.event_buffer)
            lookups: LookupStore | None = None
            if is_local_only(sched):  # the daemon's socket, from the scheduler's thread
                lookups = LocalLookups(sched[0])
            elif sched:
                lookups = BlockingStore(sched, **options)
            # kv_consumer: this engine only loads what others stored (vLLM leaves it to us).
            role_name = str(getattr(transfer, "kv_role", None) or "kv_both")
            self._planner = SchedulerPlanner(self._settings, keys, lookups, events,
                                             saves=role_name != "kv_consumer")

    # ---------------------------------------------------------------- worker side
    def _worker_side(self) -> WorkerSide | LocalWorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side method called on the scheduler-side connector")
        return self._worker

    def _planner_side(self) -> SchedulerPlanner:
        if self._planner is None:
            raise RuntimeError("scheduler-side method called on the worker-side connector")
        return self._planner

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_side().register(kv_caches, int(self._kv_cache_config.num_blocks))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads completed in :meth:`start_load_kv`; nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Blocks are saved across all layers at once in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        self._worker_side().save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        worker = self._worker_side()
        sent = worker.finished_saves(finished_req_ids)
        done = worker.finished_loads()
        return sent or None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        """Which saves ended this step; vLLM sums the workers' reports for the scheduler."""
        return self._worker_side().take_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._planner is not None and self._planner.store is not None:
            store = self._planner.store
            if isinstance(store, BlockingStore):
                _close_store(store)
            else:
                store.close()

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._planner_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._planner_side().update_state_after_alloc(request, blocks.get_block_ids()[0],
                                                      num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        plan = self._planner_side().build_connector_meta(scheduler_output)
        return _VLLMMetadata(loads=plan.loads, saves=plan.saves, fresh_blocks=plan.fresh_blocks)

    def update_connector_output(self, connector_output: Any) -> None:
        planner = self._planner_side()
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            planner.load_errors(sorted(invalid))
        # After the errors: an asynchronous load's errors come no later than its completion.
        received = getattr(connector_output, "finished_recving", None)
        if received:
            planner.loads_finished(sorted(received))
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if report is not None and planner.events is not None:
            planner.events.worker_report(report)

    def take_events(self) -> Iterable[Any]:
        """KV cache events since the last call: ``BlockStored`` for blocks whose save
        completed on every worker (one per medium: ``CPU``, ``STORAGE``), ``BlockRemoved`` for
        blocks whose load failed. vLLM's own event classes when vLLM is installed; vLLM's
        scheduler publishes them under its pod identity. See ``docs/events.md``."""
        if self._planner is None or self._planner.events is None:
            return []
        return self._planner.events.take()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copied their blocks already; freeing waits only so that the request ends
        # once its blocks are readable by other processes (get_finished reports it then).
        return self._planner_side().request_finished(request.request_id), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])


async def _put_and_wait_written(store: TieredStore, *, items: list[tuple[bytes, Any]]) -> None:
    # Waits for this save's write-through writes only: a flush of the whole queue would also
    # wait for every other request's saves queued before it.
    written = await store.put_many(items)
    await written


async def _pin_store_thread(store: TieredStore, *, cpus: set[int]) -> None:
    pin_current_thread(cpus)  # the store's loop thread; threads it starts later follow


async def _get_into(store: TieredStore, *, keys: list[bytes], outs: list[Any]) -> list[bool]:
    return await store.get_many_into(keys, outs)


def _close_store(store: BlockingStore) -> None:
    """Close ``store`` within its ``close_timeout`` bounds; a store that did not flush by
    then is logged, not raised (vLLM's teardown goes on)."""
    try:
        store.close()
    except TimeoutError as exc:
        log.warning("kvtier: %s; what it had not written is lost", exc)


def _pass_outcome(into: concurrent.futures.Future[None],
                  source: concurrent.futures.Future[None]) -> None:
    if source.cancelled():
        into.cancel()
    elif (exc := source.exception()) is not None:
        into.set_exception(exc)
    else:
        into.set_result(None)


def _scattered(load: _Load) -> bool:
    return load.scattered


def _block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one engine block across all layers of this worker (what a kvtier block
    holds), from vLLM's KV cache spec; 0 where the spec does not say."""
    group = kv_cache_config.kv_cache_groups[0]
    page = getattr(group.kv_cache_spec, "page_size_bytes", None)
    return int(page) * len(group.layer_names) if page else 0


def _staging_blocks(staging_bytes: int, block_bytes: int, max_blocks: int | None) -> int:
    """Rows of a staging area: the blocks of the longest request, within
    ``staging_bytes``."""
    if block_bytes <= 0:
        return 0
    rows = staging_bytes // block_bytes
    return rows if max_blocks is None else min(rows, max_blocks)


def _warm_answer_buffers(tiers: Iterable[str], staging: int) -> dict[str | int, dict[str, Any]]:
    """``tier_options`` giving each peer tier whose URL does not choose ``recv_reserve``
    two answer buffers the size of a full staging area (plus frame heads), faulted in at
    open: the first hit after the engine started then lands in mapped memory."""
    if staging <= 0:
        return {}
    reserve = 2 * (staging + staging // 64 + (64 << 10))
    return {url: {"recv_reserve": reserve} for url in tiers
            if url.split("://", 1)[0].lower() in ("peers", "peers+dns")
            and "recv_reserve=" not in url}


def _shard() -> tuple[int, int]:
    """This worker's (TP rank, PP stage); (0, 0) outside a vLLM worker (fakes, tests)."""
    try:
        parallel: Any = importlib.import_module("vllm.distributed.parallel_state")
        return (int(parallel.get_tensor_model_parallel_rank()),
                int(parallel.get_pipeline_model_parallel_rank()))
    except (ImportError, AssertionError, AttributeError):
        return 0, 0

