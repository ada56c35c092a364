"""What both worker sides of the vLLM connector track about their saves and load errors.

:class:`~kvtier.integrations.vllm.WorkerSide` (through a store) and
:class:`~kvtier.integrations.vllm_local.LocalWorkerSide` (on the host daemon) move bytes
differently but report the same way: each save is a future per request, its outcome goes into
the next :class:`~kvtier.integrations.vllm_events.KVTierWorkerMetadata`, and a finished
request is reported once every save it made has ended.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import threading
from functools import partial
from typing import Any

from kvtier.integrations.paged import PagedLayers
from kvtier.integrations.vllm_events import KVTierWorkerMetadata
from kvtier.integrations.vllm_plan import BlockPlan, KVTierMetadata

__all__ = ["SHUTDOWN_GRACE_S", "SaveTracking"]

log = logging.getLogger("kvtier.integrations.vllm")

#: Seconds a worker side's ``close`` (the connector's ``shutdown``) waits for its saves in
#: flight. Well under vLLM 0.32's own bound: its front end SIGKILLs the engine's processes
#: 5 s after asking the engine core to stop (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` is
#: 5 s too), and the worker's teardown after the connector's still has to run.
SHUTDOWN_GRACE_S = 2.0


class SaveTracking(abc.ABC):
    """Saves in flight, their reports, and the load errors of one worker side.

    A subclass keys a plan's blocks (:meth:`_keys`) and starts one save
    (:meth:`_start_save`); this class runs :meth:`save` over them. The worker thread calls
    every public method; :meth:`_saved` runs as a save's done callback, on whichever thread
    ended the save.
    """

    def __init__(self) -> None:
        self.layers: PagedLayers | None = None  # vLLM's pages, once registered
        self._saving: dict[bytes, concurrent.futures.Future[None]] = {}  # a later load waits
        self._req_saves: dict[str, list[concurrent.futures.Future[None]]] = {}
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        # Save ids (BlockPlan.save_id) whose writes ended since the last report; written by
        # the saving thread in _saved, taken by the worker thread.
        self._report_lock = threading.Lock()
        self._report = KVTierWorkerMetadata()
        self._ended: set[concurrent.futures.Future[None]] = set()  # saves _saved has seen
        # Saves still copying out of vLLM's pages, each with the blocks it reads.
        self._page_copies: list[tuple[concurrent.futures.Future[Any], frozenset[int]]] = []

    def _layers(self) -> PagedLayers:
        if self.layers is None:
            raise RuntimeError("register_kv_caches was not called before the first transfer")
        return self.layers

    @abc.abstractmethod
    def _keys(self, plan: BlockPlan) -> list[bytes]:
        """The keys of the blocks ``plan`` moves."""

    @abc.abstractmethod
    def _start_save(self, layers: PagedLayers, plan: BlockPlan, keys: list[bytes]
                    ) -> concurrent.futures.Future[None]:
        """Start saving the blocks of ``plan`` under ``keys``: a future that ends when they
        are readable by other processes (or the save failed)."""

    def pages_settled(self, meta: KVTierMetadata | None = None) -> None:
        """Wait for the saves copying out of pages vLLM may write from this step on: with
        ``meta`` those reading one of its ``fresh_blocks``, else (or when it does not say)
        all of them.

        Why only those: a save reads full blocks of a request that holds them (running, or
        finished with its free delayed until the save ends). vLLM writes a running request's
        KV only past its computed tokens, into its partly filled last block or into blocks
        it gives out in the step, never into a full block; a block it takes back (a
        preempted request's) is written only once it is given out again, in a later step's
        ``fresh_blocks``. So a copy of other blocks can go on under the forward pass (a
        256 MiB save's copy was waited for by the next decode step).
        """
        copies = self._page_copies
        if not copies:
            return
        fresh = None if meta is None or meta.fresh_blocks is None else set(meta.fresh_blocks)
        wait = [(f, blocks) for f, blocks in copies if not f.done() and
                (fresh is None or not fresh.isdisjoint(blocks))]
        if wait:
            concurrent.futures.wait([f for f, _ in wait])
        self._page_copies = [(f, b) for f, b in copies if not f.done()]

    def save(self, meta: KVTierMetadata) -> None:
        """Start the saves ``meta`` plans; they run in the background."""
        if not meta.saves:
            return
        layers = self._layers()
        for plan in meta.saves:
            keys: list[bytes] = []
            try:
                keys = self._keys(plan)
                future = self._start_save(layers, plan, keys)
            except Exception as exc:  # the save fails alone; vLLM's step goes on
                future = concurrent.futures.Future()
                future.set_exception(exc)  # reported failed, and its request still finishes
            self._track_save(plan, keys, future)

    def _track_save(self, plan: BlockPlan, keys: list[bytes],
                    future: concurrent.futures.Future[None]) -> None:
        """Track the save of ``plan`` (blocks ``keys``) that ends with ``future``."""
        for key in keys:
            self._saving[key] = future
        self._req_saves.setdefault(plan.req_id, []).append(future)
        future.add_done_callback(partial(self._saved, keys=keys, save_id=plan.save_id,
                                         blocks=len(plan.block_ids)))

    def _saves_ended(self, keys: list[bytes], timeout: float) -> None:
        """Wait (up to ``timeout`` each) for the saves of ``keys`` still running: a block
        saved moments ago must be readable before it is loaded."""
        for key in keys:
            saving = self._saving.get(key)
            if saving is not None:
                concurrent.futures.wait([saving], timeout=timeout)

    def _wait_for_saves(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for every save in flight to end; log those that did
        not (their blocks may be missing for the next engine: vLLM kills the process)."""
        futures = {f for saves in self._req_saves.values() for f in saves}
        _, left = concurrent.futures.wait(futures, timeout=grace)
        if not left:
            return
        requests = sorted(r for r, saves in self._req_saves.items()
                          if any(f in left for f in saves))
        blocks = sum(f in left for f in self._saving.values())
        log.warning("kvtier: shutting down with %d save(s) of %d block(s) unfinished after "
                    "%.1f s (requests %s); what they had not committed is lost",
                    len(left), blocks, grace, ", ".join(requests))

    def _saved(self, future: concurrent.futures.Future[None], *, keys: list[bytes],
               save_id: int, blocks: int) -> None:
        for key in keys:
            if self._saving.get(key) is future:
                del self._saving[key]
        failed = future.cancelled() or future.exception() is not None
        if failed and not future.cancelled():
            log.warning("kvtier save of %d blocks failed: %r", blocks, future.exception())
        with self._report_lock:
            if save_id >= 0:
                outcome = self._report.failed if failed else self._report.saved
                outcome[save_id] = 1
            self._ended.add(future)

    def take_report(self) -> KVTierWorkerMetadata | None:
        """Saves that ended since the last call (for the scheduler's KV events), if any."""
        with self._report_lock:
            report = self._report
            if not report.saved and not report.failed:
                return None
            self._report = KVTierWorkerMetadata()
        return report

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves all ended (written through to every tier, or
        committed on the daemon: readable by other processes); vLLM frees their blocks
        after this."""
        self._finishing |= finished_req_ids & self._req_saves.keys()
        with self._report_lock:
            # Ended once _saved ran (not merely done()): its report then goes out in this
            # step's build_connector_worker_meta, which vLLM calls after get_finished.
            done = {r for r in self._finishing
                    if all(f in self._ended for f in self._req_saves[r])}
            for req_id in done:
                self._finishing.discard(req_id)
                self._ended.difference_update(self._req_saves.pop(req_id))
        return done

    def _load_failed(self, plan: BlockPlan, exc: BaseException) -> None:
        """Every block of ``plan`` is a load error: vLLM recomputes them. Any exception of a
        load ends here, not only a :class:`~kvtier.errors.TierError`: one raised out of
        vLLM's ``start_load_kv`` (or ``get_finished``) takes the whole engine down."""
        log.warning("kvtier load of %d blocks for %s failed (%s: %s); vLLM recomputes them",
                    len(plan.block_ids), plan.req_id, type(exc).__name__, exc)
        self._load_errors.update(plan.block_ids)

    def take_load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors
