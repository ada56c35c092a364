"""The vLLM worker on the host daemon: ``tiers: ["local://NAME"]``.

No store and no event loop in the worker: it calls the daemon's socket from its own thread
(loads) and from one save thread (:class:`~kvtier.shm.sync_client.SyncLocalClient`), and
moves bytes once between the daemon's shared arena and vLLM's pages:

- a load leases the hit's slots, copies them into the request's pages, then releases the
  leases; a block whose lease was no longer valid (or that the daemon did not lend) is a
  load error, which vLLM recomputes, and so is every block of a load that failed in any
  way (the daemon, its answer, memory, the pages): no exception reaches vLLM;
- a save asks for slots (prepare), copies the blocks out of the pages into them, and commits;
  a later step's :meth:`LocalWorkerSide.start_loads` waits for the copies of blocks that
  step gives out (vLLM may write those pages in its forward pass; see
  :meth:`~kvtier.integrations.vllm_saves.SaveTracking.pages_settled`), never for the commit.

One copy per byte, through a bounce buffer of :data:`BOUNCE_BYTES` that stays in the CPU
cache (one for loads, one for saves, both made at register and reused): a block of every
layer is one slot in the arena but one piece per layer (per K/V plane) in vLLM's pages, and
copying a chunk of blocks per plane in one indexed copy, rather than each block's pieces one
call at a time, keeps the Python calls per load at ``blocks / chunk x planes``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvtier.errors import TierError
from kvtier.integrations.cpu_affinity import pin_current_thread, worker_spare_cpus
from kvtier.integrations.paged import PagedLayers
from kvtier.integrations.vllm_plan import BlockPlan, KeyMaker, KVTierMetadata, plan_keys
from kvtier.integrations.vllm_saves import SHUTDOWN_GRACE_S, SaveTracking
from kvtier.shm.sync_client import SyncLocalClient
from kvtier.tiers.dram_arena import fault_in, slot_bytes
from kvtier.tiers.local import local_key, parse_local_url

__all__ = ["BOUNCE_BYTES", "LocalLookups", "LocalWorkerSide", "is_local_only"]

log = logging.getLogger("kvtier.integrations.vllm")

#: Bytes of blocks copied per indexed copy (a chunk that stays in the CPU cache).
BOUNCE_BYTES = 4 << 20
_ALIGN = slot_bytes(1)  # every slot of the arena starts at a multiple of this


def is_local_only(tiers: Sequence[str]) -> bool:
    """Whether a connector's ``tiers`` is one ``local://`` tier (the daemon path)."""
    return len(tiers) == 1 and tiers[0].split("://", 1)[0].lower() == "local"


class LocalLookups:
    """The scheduler side's view of the daemon: a prefix lookup reads the daemon's shared
    presence index (:mod:`kvtier.shm.index`) from the scheduler's thread, with no call on the
    socket (one to map it, and again after a daemon restart).

    Parameters
    ----------
    url
        The connector's ``local://NAME?...`` tier.
    """

    def __init__(self, url: str) -> None:
        args = parse_local_url(url)
        self.namespace: str | None = args["namespace"]
        self.client = SyncLocalClient(args["daemon"], timeout=args["timeout"])

    def lookup_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the daemon holds, by its shared index (which refreshes
        no recency: the lease of a hit does).

        Raises
        ------
        TierError
            If the daemon does not answer within its URL's ``timeout`` (or ``timeout``,
            when shorter).
        """
        daemon_keys = [local_key(self.namespace, k) for k in keys]
        present = self.client.present_many(daemon_keys)
        if present is not None:  # the shared index: no call (a hint; the lease decides)
            return next((i for i, held in enumerate(present) if not held), len(keys))
        hit = self.client.call("/v1/lookup", {"keys": [k.hex() for k in daemon_keys]},
                               timeout=timeout).get("hit")
        if not isinstance(hit, int) or not 0 <= hit <= len(keys):
            raise TierError(f"local://{self.client.name}: malformed lookup answer")
        return hit

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The daemon's figures (``lookup_miss_reasons`` among them)."""
        return self.client.call("/v1/stats", timeout=timeout)

    def close(self) -> None:
        """Close this thread's connection."""
        self.client.close()


class LocalWorkerSide(SaveTracking):
    """The worker side of :class:`~kvtier.integrations.vllm.KVTierConnector` on a daemon.

    Same contract as :class:`~kvtier.integrations.vllm.WorkerSide` (the connector calls the
    same methods); called from the worker thread only.
    """

    def __init__(self, url: str, keys: KeyMaker, shard: tuple[int, int], io_timeout_s: float,
                 thread_cpus: Literal["spare", "inherit"] = "inherit") -> None:
        super().__init__()
        args = parse_local_url(url)
        self.namespace: str | None = args["namespace"]
        self.client = SyncLocalClient(args["daemon"], timeout=args["timeout"])
        self.keys = keys
        self.shard = shard
        self.io_timeout_s = io_timeout_s
        self.thread_cpus = thread_cpus
        self.cpus: set[int] = set()
        self._saver = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-local-save", initializer=self._pin_save_thread)
        self._releaser = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-local-release", initializer=self._pin_save_thread)
        self._loaded: set[str] = set()  # asynchronous loads done, not yet reported
        # Bounce buffers of the loads (worker thread) and of the saves (save thread), made
        # at register.
        self._load_bounce = np.empty((0, 0), np.uint8)
        self._save_bounce = np.empty((0, 0), np.uint8)

    def register(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        if self.thread_cpus == "spare":
            self.cpus = worker_spare_cpus()
        self.layers = PagedLayers(kv_caches, num_blocks)
        # Made and faulted in once, as the threads are started: a transfer then allocates
        # nothing (a fresh 4 MiB buffer per load cost its allocation and 1,024 page faults
        # inside start_load_kv, and under memory pressure a load or a save that fails).
        chunk = max(1, BOUNCE_BYTES // self.layers.block_bytes)
        self._load_bounce, self._save_bounce = self.layers.empty(chunk), self.layers.empty(chunk)
        for bounce in (self._load_bounce, self._save_bounce):
            fault_in(bounce.reshape(-1))
        for pool in (self._saver, self._releaser):
            pool.submit(_started).result()
        try:
            self.client.ensure()
        except TierError as exc:  # a daemon that starts later is mapped at first use
            log.warning("kvtier: %s; loads miss until it answers", exc)

    def _pin_save_thread(self) -> None:
        if self.cpus:
            pin_current_thread(self.cpus)

    def _keys(self, plan: BlockPlan) -> list[bytes]:
        keys = plan_keys(plan, self.keys, self.shard)
        if self.namespace is None:
            return keys
        return [local_key(self.namespace, k) for k in keys]

    def _rows(self, buffer: npt.NDArray[np.uint8], writeable: bool) -> npt.NDArray[np.uint8]:
        """The arena ``buffer`` as overlapping rows of one block, row ``i`` starting at byte
        ``i * _ALIGN`` (every slot starts on such a row)."""
        block = self._layers().block_bytes
        if buffer.nbytes < block:
            raise TierError(f"local://{self.client.name}: no arena mapped")
        return np.lib.stride_tricks.as_strided(
            buffer, shape=((buffer.nbytes - block) // _ALIGN + 1, block),
            strides=(_ALIGN, 1), writeable=writeable)

    def _row_of(self, slot: dict[str, Any] | None, rows: int) -> int | None:
        if not isinstance(slot, dict):
            return None
        offset, nbytes = slot.get("offset"), slot.get("nbytes")
        if not isinstance(offset, int) or offset % _ALIGN or not 0 <= offset // _ALIGN < rows \
                or nbytes != self._layers().block_bytes:
            return None
        return offset // _ALIGN

    # ------------------------------------------------------------------ loads
    def start_loads(self, meta: KVTierMetadata) -> None:
        self.pages_settled(meta)
        for plan in meta.loads:
            try:
                keys = self._keys(plan)
                self._saves_ended(keys, self.io_timeout_s)
                hits = self._load(keys, plan.block_ids)
            except Exception as exc:  # whatever failed (daemon, memory, pages): a miss
                self._load_failed(plan, exc)
            else:
                self._load_errors.update(b for b, hit in zip(plan.block_ids, hits, strict=True)
                                         if not hit)
            if plan.load_async:  # done already: reported at the next get_finished
                self._loaded.add(plan.req_id)

    def _load(self, keys: list[bytes], block_ids: list[int]) -> list[bool]:
        """Lease, copy into the pages, release; which blocks were loaded.

        Raises
        ------
        Exception
            Whatever made the load fail as a whole (the daemon, its answer, memory, the
            pages); its leases were released, or end at their time bound.
        """
        layers = self._layers()
        if self.client.info is None:
            self.client.ensure()
        asked = time.monotonic()
        answer = self.client.call("/v1/lease", {"keys": [k.hex() for k in keys]})
        slots = answer.get("slots")
        if not isinstance(slots, list) or len(slots) != len(keys):
            raise TierError(f"local://{self.client.name}: malformed lease answer")
        ids = [s["lease"] for s in slots if isinstance(s, dict) and "lease" in s]
        picked: list[tuple[int, int]] = []
        try:
            instance = answer.get("instance")
            mapped = self.client.arena(instance) if self.client.ensure(instance) else None
            if mapped is None:
                raise TierError("the daemon restarted during the load")
            buffer, ttl = mapped
            rows = self._rows(buffer, writeable=False)
            picked = [(i, r) for i, (s, key) in enumerate(zip(slots, keys, strict=True))
                      if isinstance(s, dict) and s.get("key") == key.hex()
                      and (r := self._row_of(s, len(rows))) is not None]
            bounce = self._load_bounce
            chunk = len(bounce)
            for start in range(0, len(picked), chunk):
                part = picked[start:start + chunk]
                out = bounce[:len(part)]
                # One block at a time through basic indexing (a view of the slot): np.take
                # would first make the whole overlapping-rows view of the arena contiguous,
                # a copy of rows x block bytes (80 GiB for a 320 MiB arena in real vLLM).
                for j, (_, r) in enumerate(part):
                    np.copyto(out[j], rows[r])
                layers.scatter_many([block_ids[i] for i, _ in part], out)
        finally:
            self._release(ids)
        # A lease lives until its release or its time bound, which the daemon set at least
        # ``ttl`` after this process asked (one monotonic clock for every process of the
        # host), so copies that ended before then read slots nothing could reuse: the
        # release's answer is not needed, and the release runs off the worker's thread.
        if time.monotonic() >= asked + ttl:
            return [False] * len(keys)  # a copy may have outlived its lease: a miss
        copied = {i for i, _ in picked}
        return [i in copied for i in range(len(keys))]

    def _release(self, ids: list[int]) -> None:
        """End read leases ``ids`` on the release thread (the worker does not wait)."""
        if ids:
            self._releaser.submit(self._release_now, ids)

    def _release_now(self, ids: list[int]) -> None:
        try:
            self.client.call("/v1/release", {"leases": ids})
        except Exception as exc:  # they end at their time bound
            log.debug("kvtier: releasing %d leases failed (%s)", len(ids), exc)

    def finished_loads(self) -> set[str]:
        done, self._loaded = self._loaded, set()
        return done

    # ------------------------------------------------------------------ saves
    def _start_save(self, layers: PagedLayers, plan: BlockPlan, keys: list[bytes]
                    ) -> concurrent.futures.Future[None]:
        copied: concurrent.futures.Future[None] = concurrent.futures.Future()
        written: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._saver.submit(self._save, layers, plan.block_ids, keys, copied, written)
        self._page_copies.append((copied, frozenset(plan.block_ids)))
        return written

    def _save(self, layers: PagedLayers, block_ids: list[int], keys: list[bytes],
              copied: concurrent.futures.Future[None],
              written: concurrent.futures.Future[None]) -> None:
        """On the save thread: prepare, copy out of the pages into the slots, commit.
        ``copied`` ends once the last block is out of the pages, before the commit. The
        daemon's prepare evicts ahead for room, so a save is one round; only when its arena
        cannot hold it all (a save larger than its capacity, slots held by reads) does a
        commit come first and the next round take the rest."""
        try:
            try:
                todo = list(range(len(keys)))
                while todo:
                    left = self._save_round(layers, [block_ids[i] for i in todo],
                                            [keys[i] for i in todo], copied)
                    if len(left) == len(todo):
                        raise TierError("no free slot in the daemon's arena")
                    todo = [todo[j] for j in left]
            finally:
                if not copied.done():
                    copied.set_result(None)  # the pages are free for vLLM either way
        except BaseException as exc:
            written.set_exception(exc)
            return
        written.set_result(None)

    def _save_round(self, layers: PagedLayers, block_ids: list[int], keys: list[bytes],
                    copied: concurrent.futures.Future[None]) -> list[int]:
        """Save what the daemon lends slots for; the indices of the blocks it did not.
        Ends ``copied`` before the commit when it lent them all (the last round)."""
        spec = {"dtype": "|u1", "shape": [layers.block_bytes]}
        answer = self.client.call("/v1/prepare", {
            "blocks": [{"key": k.hex(), **spec} for k in keys]})
        slots = answer.get("slots")
        if not isinstance(slots, list) or len(slots) != len(keys):
            raise TierError("malformed prepare answer")
        granted = [j for j, slot in enumerate(slots) if isinstance(slot, dict)]
        if not granted:
            return list(range(len(keys)))
        ids = [slots[j]["lease"] for j in granted]
        try:
            instance = answer.get("instance")
            mapped = self.client.arena(instance) if self.client.ensure(instance) else None
            if mapped is None:
                raise TierError("the daemon restarted during the save")
            rows = self._rows(mapped[0], writeable=True)
            found = [self._row_of(slots[j], len(rows)) for j in granted]
            where = [r for r in found if r is not None]
            if len(where) != len(found):
                raise TierError("the daemon lent a slot outside its arena")
            bounce = self._save_bounce
            chunk = len(bounce)
            for start in range(0, len(granted), chunk):
                part = granted[start:start + chunk]
                out = bounce[:len(part)]
                layers.gather_many([block_ids[j] for j in part], out=out)
                rows[where[start:start + chunk]] = out  # the one copy of a save
            if len(granted) == len(keys):
                copied.set_result(None)  # vLLM may write the pages: the commit needs none
            answer = self.client.call("/v1/commit", {"leases": ids})
            if answer.get("error") or not all(c is True for c in answer.get("committed", [])):
                raise TierError(f"commit refused: {answer.get('error') or 'slots expired'}")
        except BaseException:
            with contextlib.suppress(TierError):  # else they end at their time bound
                self.client.call("/v1/commit", {"leases": ids, "abort": True})
            raise
        return [j for j, slot in enumerate(slots) if not isinstance(slot, dict)]

    def close(self) -> None:
        """Wait (bounded: :data:`~kvtier.integrations.vllm_saves.SHUTDOWN_GRACE_S`) for the
        saves in flight, logging those that did not end, then stop the threads without
        waiting for them: a read lease ends with this process anyway (the daemon watches
        it), and vLLM kills the process soon after its shutdown."""
        self._wait_for_saves(SHUTDOWN_GRACE_S)
        self._page_copies.clear()
        self._saver.shutdown(wait=False)
        self._releaser.shutdown(wait=False)
        self.client.close()


def _started() -> None:
    """Nothing: submitted once so that a pool's thread starts at register, not in a load."""
