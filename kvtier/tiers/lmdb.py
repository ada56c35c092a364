"""``lmdb://``: blocks on local NVMe in one LMDB environment, byte budget, LRU, warm restart.

URL form: ``lmdb:///nvme/kvtier?capacity=500GiB&compress=zstd:1&shuffle=1&sync=0``.

- Every LMDB transaction runs start to commit inside one worker-thread call
  (:mod:`kvtier.tiers.lmdb_env`); reads copy out before their transaction ends. Except
  (``inline_reads``, on by default) small reads of uncompressed values in the page cache:
  they run on the event loop (:mod:`kvtier.tiers.lmdb_reads`).
- The budget accounts stored frame bytes. ``data.mdb`` can never grow past ``map_size =
  capacity + overhead`` (LMDB refuses with ``MapFullError``, which this tier catches: it
  evicts more and retries), so the directory stays under ``capacity + overhead + 64 KiB``
  on disk however many blocks are put. See ``docs/tiers-persistent.md``.
- Recency lives in memory (:class:`~kvtier.policy.RecencyPolicy`) and is persisted lazily in
  the ``recency`` database (with every write transaction, every ``touch_flush`` hits, and at
  close), so a reopen restores contents, usage and LRU order without reading any value.
- One process owns a directory (``flock`` on ``kvtier.lock``, :mod:`kvtier.tiers.lmdb_dir`,
  with the crash marker and ``writemap`` preallocation); a second opener gets
  :class:`DirectoryLockedError`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import lmdb

from kvtier.codec import encode_frame, frame_size_bound
from kvtier.deadline import acquire, in_thread
from kvtier.errors import (
    ConfigError,
    CorruptBlockError,
    DirectoryLockedError,
    TierError,
    TierFullError,
)
from kvtier.events_watch import DEFAULT_WATCH_INTERVAL
from kvtier.misses import MissReason
from kvtier.policy import Clock, RecencyPolicy
from kvtier.tasks import TaskSet
from kvtier.tiers.base import Block, run_to_end
from kvtier.tiers.budget import BudgetedTier, make_policy
from kvtier.tiers.lmdb_dir import (
    check_unclean_shutdown,
    lock_directory,
    mark_clean_close,
    preallocate,
)
from kvtier.tiers.lmdb_env import BlockEnv, Durability, PendingPut
from kvtier.tiers.lmdb_gc import OwnerWatch
from kvtier.tiers.lmdb_options import (
    DEFAULT_OVERHEAD_FIXED,
    default_overhead,
    map_size,
    path_of_url,
    tier_arguments,
)
from kvtier.tiers.lmdb_reads import INLINE_READ_BYTES, EnvReader
from kvtier.tiers.residency import mincore_available

__all__ = ["DEFAULT_OVERHEAD_FIXED", "INLINE_READ_BYTES", "DirectoryLockedError", "LMDBTier",
           "default_overhead"]

log = logging.getLogger("kvtier.tiers.lmdb")
T = TypeVar("T")

_MAX_ROOM_ATTEMPTS = 64
_MAP_FULL_RETRIES = 2


class _MapFull(Exception):
    """LMDB has no page left for a commit although the budget has room (its victims are
    deleted; the put evicts more and retries)."""


class LMDBTier(BudgetedTier):
    """Local-NVMe tier on one LMDB environment.

    Parameters
    ----------
    path
        Directory of the environment (created if missing). One process owns it.
    capacity
        Byte budget of stored frames (``None``: unbounded, ``map_size`` 1 TiB).
    compress_level
        zstd level for stored frames, or ``None``.
    shuffle
        Byte-shuffle before zstd (pays for fp16/bf16 KV).
    sync
        ``"0"`` (default): no fsync at commit; a process crash loses nothing committed, an OS
        crash or power loss may lose or corrupt the cache (delete the directory after one).
        ``"meta"``: fsync data but not the meta page; ``"1"``: fsync every commit.
    writemap
        Let LMDB write through its shared memory map (faster large puts). ``data.mdb`` is
        then preallocated to ``map_size`` at open (``posix_fallocate``), so a full disk
        cannot kill the process with ``SIGBUS`` later; where it cannot be preallocated the
        open fails with :class:`~kvtier.errors.ConfigError`.
    overhead
        Bytes of ``data.mdb`` on top of ``capacity`` (default :func:`default_overhead`).
    policy
        Eviction policy: ``"lru"`` (default), ``"s3fifo"`` or ``"arc"``.
    clock
        Wall-clock time source for recency (persisted, so it must survive restarts).
    touch_flush
        Persist recency after this many hits without a write transaction.
    watch
        Seconds between looks at the directory once :meth:`open` ran (0: off): answers
        ``kvtier gc`` run from another process (:mod:`kvtier.tiers.lmdb_gc`) and notices
        ``data.mdb`` removed (a wiped directory); what the tier drops then is reported
        (KV events: ``BlockRemoved``, and ``AllBlocksCleared`` when it emptied the tier).
    name
        Label in stats.

    Raises
    ------
    DirectoryLockedError
        If the directory is already open.
    """

    scheme = "lmdb"
    persistent = True

    def __init__(self, path: str | os.PathLike[str], *, capacity: int | None = None,
                 compress_level: int | None = None, shuffle: bool = False,
                 sync: Durability = "0", writemap: bool = False, overhead: int | None = None,
                 policy: str = "lru", clock: Clock = time.time, touch_flush: int = 1024,
                 inline_reads: bool = True, watch: float = DEFAULT_WATCH_INTERVAL,
                 name: str | None = None) -> None:
        super().__init__(name=name)
        if sync not in ("0", "meta", "1"):
            raise ConfigError(f"sync: expected '0', 'meta' or '1', got {sync!r}")
        if overhead is not None and overhead < 0:
            raise ConfigError(f"overhead: expected >= 0, got {overhead}")
        if touch_flush < 1:
            raise ValueError(f"touch_flush: expected >= 1, got {touch_flush}")
        if not watch >= 0:
            raise ConfigError(f"watch: expected >= 0 seconds, got {watch!r}")
        self.watch = watch
        self._owner_watch: OwnerWatch | None = None
        self._data_inode = 0
        self._policy = make_policy(policy, capacity, clock)
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = lock_directory(self.path)
        except OSError as exc:
            raise ConfigError(
                f"path: cannot use {str(self.path)!r} as an LMDB directory "
                f"({type(exc).__name__}: {exc.strerror or exc}); lmdb:// needs a directory "
                "this process can create and write - change the path") from None
        self.map_size = map_size(capacity, overhead)
        self.compress_level = compress_level
        self.shuffle = shuffle
        self.sync = sync
        self.writemap = writemap
        self._clock = clock
        self._touch_flush = touch_flush
        self._env: BlockEnv | None = None
        self._opening: asyncio.Future[BlockEnv] | None = None
        # Serialises write transactions (LMDB has one writer anyway); never held across a
        # demotion (see kvtier.tiers.budget).
        self._lock = asyncio.Lock()
        self._touched: set[bytes] = set()
        self._inflight = TaskSet()
        self._reader = EnvReader(inline=inline_reads and mincore_available(),
                                 frame_bytes=self._frame_bytes, track=self._inflight)
        self.hits = self.misses = self.corrupt = self.io_errors = self.map_full = 0
        self.discarded_after_os_crash = False

    # ------------------------------------------------------------------ set-up
    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``lmdb:///DIR?capacity=SIZE&policy=lru&compress=zstd:1&shuffle=1&sync=0|meta|1
        &writemap=0&overhead=SIZE&inline_reads=1&watch=SECONDS&name=LABEL``."""
        path, arguments = tier_arguments(url, options)
        return cls(path, **arguments)

    path_of_url = staticmethod(path_of_url)

    async def open(self) -> None:
        """Open the environment now (``open_store`` calls this), so ``stats()`` shows the
        blocks a previous run left and a directory LMDB cannot use fails at open.

        Raises
        ------
        ConfigError
            When LMDB cannot open or create its files in the directory.
        """
        try:
            await self._ready()
        except lmdb.Error as exc:
            raise ConfigError(f"path: LMDB cannot open {str(self.path)!r}: {exc}; change the "
                              "path (a writable local directory)") from exc
        if self.watch > 0 and self._owner_watch is None:
            self._owner_watch = OwnerWatch(self, self.watch, self._data_inode)
            self._owner_watch.start()

    async def _ready(self) -> BlockEnv:
        if self._env is not None:
            return self._env
        if self._opening is None:
            # One tracked, shielded open: a caller cancelled mid-open (a store timeout)
            # leaves it running, and the next caller awaits the same open. LMDB forbids
            # opening one environment twice in a process.
            self._opening = asyncio.ensure_future(self._open())
            self._inflight.track(self._opening)
            self._opening.add_done_callback(self._opened)
        return await asyncio.shield(self._opening)

    async def _open(self) -> BlockEnv:
        env, entries = await asyncio.to_thread(self._open_env)
        for key, size, last in entries:
            if isinstance(self._policy, RecencyPolicy):
                self._policy.admit(key, size, last_access=last)
            else:  # oldest first, as the saved order says
                self._policy.admit(key, size)
        self._env = env
        return env

    def _opened(self, task: asyncio.Future[BlockEnv]) -> None:
        if task.cancelled() or task.exception() is not None:
            self._opening = None  # nothing opened: the next call tries again

    def _open_env(self) -> tuple[BlockEnv, list[tuple[bytes, int, float]]]:
        if check_unclean_shutdown(self.path, sync=self.sync, name=self.name):
            self.discarded_after_os_crash = True
        env = BlockEnv(self.path, map_size=self.map_size, durability=self.sync,
                       writemap=self.writemap)
        self._data_inode = (self.path / "data.mdb").stat().st_ino  # what a wipe replaces
        if self.writemap:
            try:
                preallocate(self.path, self.map_size)
            except BaseException:
                env.close()
                raise
        return env, env.load_index()

    def _close_env(self, env: BlockEnv) -> None:
        env.close()  # flushes to disk whatever sync= says
        mark_clean_close(self.path)

    def _live_env(self) -> BlockEnv:
        if self._env is None:
            raise TierError(f"lmdb tier {self.name}: environment is not open")
        return self._env

    def _frame_bytes(self, key: bytes) -> int:
        """Stored bytes of a held block: from the policy, or from its eviction while it is
        leaving (out of the policy, still readable)."""
        size = self._policy.size_of(key)
        if size is None:
            entry = self._eviction_state.leaving_entry(key)
            size = entry.size if entry is not None else INLINE_READ_BYTES + 1
        return size

    async def _locked(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` under the writer lock as a tracked task that a cancelled caller
        waits for (a write transaction cannot be stopped, and one left running would act
        after the call returned)."""
        async def run() -> T:
            try:
                await acquire(self._lock, "lmdb writer lock")
            except BaseException:
                coro.close()  # never started
                raise
            try:
                return await coro
            finally:
                self._lock.release()

        task = self._inflight.start(run())
        return await run_to_end(task)

    # ---------------------------------------------------------------- contract
    def __len__(self) -> int:
        return len(self._policy)

    async def _get(self, key: bytes) -> Block | None:
        return (await self._get_many([key]))[0]

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        env = await self._ready()
        wanted = [k for k in dict.fromkeys(keys) if self._held(k)]
        found: dict[bytes, Block] = {}
        if wanted:
            try:
                results = await self._reader.read(env, wanted)
            except lmdb.Error as exc:
                self.io_errors += 1
                raise TierError(f"lmdb tier {self.name}: read failed: {exc}") from exc
            bad: list[bytes] = []
            for key, res in zip(wanted, results, strict=True):
                if isinstance(res, CorruptBlockError):
                    self.corrupt += 1
                    log.warning("lmdb tier %s: corrupt block %s dropped: %s", self.name,
                                key.hex(), res)
                    self._report_miss((key,), MissReason.CORRUPT, str(res))
                    bad.append(key)
                elif res is not None:
                    found[key] = res
            if bad:
                await self._locked(self._delete_locked(bad))
        out: list[Block | None] = []
        for key in keys:
            block = found.get(key)
            if block is None:
                self.misses += 1
            else:
                self.hits += 1
                self._policy.touch(key)
                self._touched.add(key)
            out.append(block)
        if len(self._touched) >= self._touch_flush:
            await self._locked(self._flush_touches_locked())
        return out

    async def _get_into(self, key: bytes, out: Block) -> bool:
        env = await self._ready()
        if not self._held(key):
            self.misses += 1
            return False
        try:
            res = await self._reader.read_into(env, key, out)
        except lmdb.Error as exc:
            self.io_errors += 1
            raise TierError(f"lmdb tier {self.name}: read failed: {exc}") from exc
        if isinstance(res, CorruptBlockError):
            self.corrupt += 1
            log.warning("lmdb tier %s: corrupt block %s dropped: %s", self.name, key.hex(), res)
            self._report_miss((key,), MissReason.CORRUPT, str(res))
            await self._locked(self._delete_locked([key]))
            res = False
        if not res:
            self.misses += 1
            return False
        self.hits += 1
        self._policy.touch(key)
        self._touched.add(key)
        if len(self._touched) >= self._touch_flush:
            await self._locked(self._flush_touches_locked())
        return True

    async def _contains(self, key: bytes) -> bool:
        await self._ready()
        return self._held(key)

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        await self._ready()
        return [self._held(k) for k in keys]

    async def _put(self, key: bytes, block: Block) -> None:
        await self._put_many([(key, block)])

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        await self._ready()
        batch = dict(items)  # a repeated key: the last value wins
        bounds = {k: frame_size_bound(b) for k, b in batch.items()}
        for key, bound in bounds.items():
            self._policy.check_fits(bound, f"value for key {key.hex()}")
        capacity = self._policy.capacity
        if capacity is not None and sum(bounds.values()) > capacity and len(batch) > 1:
            # The batch cannot fit at once: store it block by block (later ones evict
            # earlier ones, as a sequence of puts would).
            for key, block in batch.items():
                await self._put_many([(key, block)])
            return
        for _ in range(_MAX_ROOM_ATTEMPTS):
            try:
                await self._store_evicting(list(batch.items()), list(bounds.values()))
                return
            except _MapFull:
                # LMDB ran out of pages before the budget did (page rounding, fragmentation,
                # pages the last commits freed): evict more, then retry.
                if not await self._evict_more(sum(bounds.values())):
                    break
        raise TierFullError(f"lmdb tier {self.name}: map of {self.map_size} bytes stays "
                            "full after evicting every unpinned block")

    async def _delete(self, key: bytes) -> bool:
        return (await self._delete_many([key]))[0]

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        await self._ready()
        if self._busy():  # a deleted key is not demoted afterwards
            await self._settled(keys)
        present = await self._locked(self._delete_locked(list(dict.fromkeys(keys)),
                                                         cancellable=True))
        return [present.pop(k, False) for k in keys]

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        await self._ready()
        await super()._touch_chain(keys)
        self._touched.update(k for k in keys if k in self._policy)

    async def _aclose(self) -> None:
        if self._owner_watch is not None:
            await self._owner_watch.aclose()
        while self._inflight or self._eviction_state.committing:
            await self._inflight.wait()
            await self._commits_done()
        try:
            if self._env is not None:
                async with self._lock:
                    await self._flush_touches_locked()
                    await asyncio.to_thread(self._close_env, self._env)
                self._env = None
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    async def trim(self, capacity: int) -> tuple[int, int]:
        """Evict least recently used blocks until the tier holds at most ``capacity``
        bytes (``kvtier gc``), through the eviction template: demoted to the tier below
        when there is one, reported dropped; pinned blocks stay. A tier emptied this way is
        also reported cleared (``AllBlocksCleared``). Returns ``(blocks, bytes)`` evicted.
        """
        await self._ready()
        held, before = len(self._policy), self.used
        if before > capacity:
            await self._evict_more(before - capacity)
        if held and not len(self._policy) and not self._eviction_state.leaving_count:
            self._report_cleared()
        return held - len(self._policy), before - self.used

    # ------------------------------------------------------------ write path
    def _touch_records(self) -> list[tuple[bytes, int, float]]:
        records = []
        now = self._clock()
        for key in self._touched:
            size = self._policy.size_of(key)
            last = self._policy.last_access(key) if isinstance(self._policy, RecencyPolicy) \
                else now
            if size is not None and last is not None:
                records.append((key, size, last))
        self._touched.clear()
        return records

    async def _flush_touches_locked(self) -> None:
        records = self._touch_records()
        if records and self._env is not None:
            await asyncio.to_thread(self._env.write, [], [], records)

    async def _delete_locked(self, keys: list[bytes], *,
                             cancellable: bool = False) -> dict[bytes, bool]:
        """Delete ``keys`` in one write transaction. Only a caller's delete is
        ``cancellable`` by its deadline while queued; the tier's own (demoted victims, a
        corrupt block) runs whatever the deadline says, so storage and accounting agree."""
        env = self._live_env()
        try:
            present = await (in_thread(env.write, [], keys, [], what="lmdb delete")
                             if cancellable else asyncio.to_thread(env.write, [], keys, []))
        except lmdb.Error as exc:
            self.io_errors += 1
            raise TierError(f"lmdb tier {self.name}: delete failed: {exc}") from exc
        for key in keys:
            self._policy.remove(key)
            self._touched.discard(key)
        return dict(zip(keys, present, strict=True))

    # ------------------------------------------------- eviction template hooks
    async def _read_leaving(self, keys: list[bytes]) -> list[Block | None]:
        env = self._live_env()
        results = await self._reader.in_thread(env.read, keys)
        blocks: list[Block | None] = []
        for key, res in zip(keys, results, strict=True):
            if isinstance(res, CorruptBlockError):
                self.corrupt += 1
                log.warning("lmdb tier %s: corrupt victim %s dropped", self.name, key.hex())
                res = None
            blocks.append(res)
        return blocks

    async def _drop_stored(self, keys: list[bytes]) -> None:
        if keys:
            await self._locked(self._delete_locked(keys))

    async def _commit(self, items: Sequence[tuple[bytes, Block]],
                      dropped: list[bytes]) -> list[int]:
        """Delete the demoted victims and write ``items`` in one write transaction."""
        await acquire(self._lock, "lmdb writer lock")
        try:
            env = self._live_env()
            batch = dict(items)
            deletes = list(dropped)
            now = self._clock()
            pending: list[PendingPut] | None = None
            try:
                for _ in range(_MAP_FULL_RETRIES + 1):
                    touches = self._touch_records()
                    try:
                        pending = await in_thread(
                            self._encode_and_write, env, batch, pending, now, deletes, touches,
                            what="lmdb write")
                        break
                    except lmdb.MapFullError as exc:
                        self.map_full += 1
                        self._touched.update(k for k, _, _ in touches)
                        pending = getattr(exc, "kvtier_pending", pending)
                        if deletes:  # the victims go anyway: they were demoted
                            await self._delete_locked(deletes)
                            deletes = []
                        # Pages freed by the last commits become reusable two commits later.
                        await asyncio.to_thread(env.tick)
                        await asyncio.to_thread(env.tick)
                else:
                    raise _MapFull
            except BaseException as exc:
                # Nothing was written, whatever failed (an LMDB error, a worker thread out of
                # memory): the victims, demoted already, still go.
                if isinstance(exc, lmdb.Error):
                    self.io_errors += 1
                if deletes:
                    await self._delete_locked(deletes)
                if isinstance(exc, lmdb.Error):
                    raise TierError(f"lmdb tier {self.name}: put failed: {exc}") from exc
                raise
            for key in dropped:
                self._touched.discard(key)
            return [put.nbytes for put in pending or ()]
        finally:
            self._lock.release()

    def _encode_and_write(self, env: BlockEnv, batch: dict[bytes, Block],
                          pending: list[PendingPut] | None, now: float,
                          deletes: list[bytes],
                          touches: list[tuple[bytes, int, float]]) -> list[PendingPut]:
        if pending is None:
            pending = []
            for key, block in batch.items():
                frame = encode_frame(block, compress_level=self.compress_level,
                                     shuffle=self.shuffle)
                pending.append(PendingPut(key, frame.header, frame.payload, now))
        try:
            env.write(pending, deletes, touches)
        except lmdb.MapFullError as exc:
            exc.kvtier_pending = pending  # type: ignore[attr-defined]  # reuse the encoding
            raise
        return pending

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        disk = self._env.disk_bytes() if self._env is not None else 0
        return {**super().stats(), "opened": self._env is not None, "hits": self.hits,
                "misses": self.misses, "io_errors": self.io_errors, "corrupt": self.corrupt,
                "map_full": self.map_full,
                "map_size": self.map_size, "disk_bytes": disk, "path": str(self.path),
                "sync": self.sync, "compress_level": self.compress_level,
                "discarded_after_os_crash": self.discarded_after_os_crash,
                "reads_inline": self._reader.reads_inline,
                **(self._owner_watch.stats() if self._owner_watch is not None else {}),
                "read_slots_reused": self._env.read_slots_reused if self._env is not None else 0}
