"""Any fsspec URL as a tier: ``file:///mnt/weka/kvtier``, ``memory://kv``,
``s3://bucket/prefix?endpoint_url=...``.

- Content-addressed layout: a key is stored at ``ROOT/ab/cd/abcd....kvb`` (its lowercase
  hex, ``fanout`` directory levels of two hex digits). No user-supplied text becomes a path
  component, so no traversal is possible.
- Atomic publish (see :mod:`kvtier.tiers.fsspec_io`): readers see whole blocks only, and
  several nodes may share one URL (same key, same content: concurrent writers are safe).
  Every frame is checksummed; a partial or corrupt object is a miss, deleted and counted.
- Optional ``capacity=``: LRU trimming of *this* node's writes (evicted blocks go to the
  demotion callback first). A shared directory as a whole is trimmed by ``kvtier gc`` or,
  with ``fleet_capacity=``, by a background gc of the nodes, one at a time; ``file://``
  tiers log their reads so that gc keeps the blocks in use (:mod:`kvtier.tiers.fleet`).
- A write probe at open (:meth:`FsspecTier.open`, which ``open_store`` calls): a location
  that cannot take a block fails there with :class:`~kvtier.errors.ConfigError`, not with
  one dropped block after another. A probe refused for permission (``EACCES``, ``EROFS``)
  on a location that can still be read opens the tier read-only (reads serve, writes are
  refused, counted and warned about; ``stats()["read_only"]``), unless ``probe=require``;
  ``probe=0`` skips it (:mod:`kvtier.tiers.fsspec_readonly`).
- ``http://`` and ``https://`` are refused as tier URLs (almost always a typo for
  ``peers://``); ``fsspec+https://...`` asks for fsspec's HTTP filesystem explicitly, and
  ``fsspec+PROTO://`` works for any fsspec protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from kvtier.codec import (
    EncodedFrame,
    decode_frame,
    encode_frame,
    frame_size_bound,
    parse_compress,
)
from kvtier.deadline import Deadline, exempt
from kvtier.errors import ConfigError, CorruptBlockError, TierError
from kvtier.events_watch import DEFAULT_WATCH_INTERVAL
from kvtier.misses import MissReason
from kvtier.policy import Clock
from kvtier.tiers.base import Block, run_to_end
from kvtier.tiers.budget import BudgetedTier, make_policy, parse_policy
from kvtier.tiers.fleet import FLEET_OPTIONS, FleetMember, check_fleet_options, fleet_options
from kvtier.tiers.fsspec_io import AsyncFsBackend, Backend, LocalBackend, SyncFsBackend
from kvtier.tiers.fsspec_readonly import (
    ProbeMode,
    ReadOnlyGuard,
    check_readable,
    is_read_only_error,
    parse_probe,
)
from kvtier.tiers.mounts import check_local, read_mountinfo
from kvtier.urls import TierURL, parse_bool, parse_size, parse_tier_url
from kvtier.warnsummary import WarningSummary

__all__ = ["BLOCK_SUFFIX", "EXPLICIT_PREFIX", "FsspecTier", "key_path"]

log = logging.getLogger("kvtier.tiers.fsspec")
T = TypeVar("T")

BLOCK_SUFFIX = ".kvb"
_OWN_OPTIONS = {"capacity", "compress", "shuffle", "fanout", "fsync", "name", "timeout",
                "storage_options", "clock", "policy", "nowait", "probe", *FLEET_OPTIONS}
#: Prefix that asks for the fsspec tier explicitly (``fsspec+https://host/kv``).
EXPLICIT_PREFIX = "fsspec+"
_PROBE_BLOCK = np.zeros(16, np.uint8)
#: At least this long to remove a probe object an interrupted probe left.
_PROBE_CLEANUP_S = 5.0


def _io_error_types() -> tuple[type[BaseException], ...]:
    """What a storage back end raises for a failed operation: OSError (files, s3fs's error
    translation, aiohttp's connection errors), timeouts, and the client errors of botocore
    and aiohttp where installed. Counted and reported as TierError; anything else (a
    TypeError, say) is a bug and propagates as itself."""
    types: list[type[BaseException]] = [OSError, TimeoutError]
    for module, names in (("botocore.exceptions", ("BotoCoreError", "ClientError")),
                          ("aiohttp", ("ClientError",))):
        with contextlib.suppress(ImportError):
            found = importlib.import_module(module)
            types += [getattr(found, name) for name in names]
    return tuple(types)


_IO_ERRORS = _io_error_types()
# Keys up to this many bytes are named by their hex; longer ones by a digest, so a name
# stays under NAME_MAX (255) whatever the key length.
_MAX_HEX_KEY_BYTES = 100


def key_path(root: str, key: bytes, fanout: int = 2) -> str:
    """Where ``key`` lives under ``root``: ``root/ab/cd/abcd....kvb`` for ``fanout=2``."""
    name = key.hex() if len(key) <= _MAX_HEX_KEY_BYTES else \
        "h" + hashlib.blake2b(key, digest_size=32).hexdigest()
    padded = name.lstrip("h").ljust(2 * fanout, "0")
    parts = [padded[2 * i : 2 * i + 2] for i in range(fanout)]
    return "/".join([root.rstrip("/"), *parts, name + BLOCK_SUFFIX])


def _storage_value(value: object) -> object:
    # Query strings carry text; s3fs and friends expect real booleans (anon=false).
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


class FsspecTier(BudgetedTier):
    """A tier on any fsspec filesystem.

    Parameters
    ----------
    url
        Base URL without kvtier options (``file:///mnt/weka/kvtier``, ``s3://bucket/prefix``).
    storage_options
        Passed to the fsspec filesystem (``endpoint_url``, ``anon``, ``key``...).
    capacity
        Optional byte budget of this node's writes (frame bytes), LRU-trimmed.
    compress_level, shuffle
        zstd level and byte-shuffle for stored frames.
    fanout
        Directory levels of two hex digits each (0..4, default 2).
    fsync
        ``file://`` only: fsync the block and its directory before publishing.
    nowait
        ``file://`` only: read files that are in the page cache on the event loop
        (``preadv`` with ``RWF_NOWAIT``), others in a worker thread (see
        :class:`~kvtier.tiers.fsspec_io.LocalBackend`). ``"auto"`` (default): on where the
        root directory and every mount beneath it are on a local filesystem
        (:func:`~kvtier.tiers.mounts.check_local`: ext4, xfs, tmpfs...), off on NFS, FUSE
        and other network mounts, whose ``open`` would block the loop, and on other
        protocols. ``True``/``False`` (or ``1``/``0``) force it.
    timeout
        Seconds after which one storage operation is abandoned (a miss or a put error).
        Writes and deletes that run in a worker thread (``file://``, ``memory://`` and
        other synchronous filesystems) are never abandoned: a thread cannot be stopped, and
        one left running would land after a newer value or uncounted. On a hung mount
        they wait with it, and so do their callers, even cancelled ones. A put whose write
        had started at the timeout raises once it ended; the block it stored is counted.
    probe
        Write, rename and delete a probe object in :meth:`open` (default), so a location
        that cannot take a block fails at open. ``False``: a read-only reader.
    use_log
        ``file://`` only: log this tier's reads under ``ROOT/.kvtier-uses`` (default on), so
        a gc of the shared directory keeps the blocks nodes read although reads leave atime
        alone (:mod:`kvtier.tiers.fleet_uses`).
    fleet_capacity
        ``file://`` only: byte budget of the whole shared directory, kept by a background
        gc from :meth:`open` on, every ``gc_interval`` seconds, on one node at a time
        (:mod:`kvtier.tiers.fleet_gc`).
    gc_interval
        Seconds between the background gc's passes (default 300).
    watch
        ``file://`` only: seconds between looks at the directory (its gc epoch marker and
        its entries, :mod:`kvtier.events_watch`; default 2, 0: off). After ``kvtier gc`` or
        another node's fleet gc deleted blocks, or the directory was wiped, the tier
        forgets the blocks it counted that are gone and reports them (``BlockRemoved``;
        ``AllBlocksCleared`` for the tier when none is left).
    policy
        Eviction policy of the budget: ``"lru"`` (default), ``"s3fifo"`` or ``"arc"``.
    clock
        Time source for the recency policy.
    name
        Label in stats.
    """

    scheme = "fsspec"
    persistent = True

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 capacity: int | None = None, compress_level: int | None = None,
                 shuffle: bool = False, fanout: int = 2, fsync: bool = False,
                 nowait: bool | str = "auto", timeout: float = 30.0,
                 probe: bool | str | ProbeMode = ProbeMode.AUTO,
                 use_log: bool = True, fleet_capacity: int | None = None,
                 gc_interval: float = 300.0, watch: float = DEFAULT_WATCH_INTERVAL,
                 policy: str = "lru", clock: Clock = time.monotonic,
                 name: str | None = None) -> None:
        if not 0 <= fanout <= 4:
            raise ConfigError(f"fanout: expected 0..4, got {fanout}")
        if timeout <= 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout}")
        if url[:len(EXPLICIT_PREFIX)].lower() == EXPLICIT_PREFIX:
            url = url[len(EXPLICIT_PREFIX):]
        self.protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
        nowait_mode = _parse_nowait(nowait)
        if nowait_mode and self.protocol not in ("file", "local"):
            raise ConfigError(f"nowait: only for file:// tiers, not {self.protocol}://")
        check_fleet_options(self.protocol, fleet_capacity, gc_interval)
        self._fleet_settings = (use_log, fleet_capacity, gc_interval, watch)
        self.fleet: FleetMember | None = None  # file:// only, made with the back end
        super().__init__(name=name or self.protocol)
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.compress_level = compress_level
        self.shuffle = shuffle
        self.fanout = fanout
        self.fsync = fsync
        self._nowait_mode = nowait_mode
        self.nowait = False  # decided with the back end
        self.fstype: str | None = None
        self.timeout = timeout
        #: The write probe of :meth:`open` (may be changed before it).
        self.probe = parse_probe(probe)
        self.guard = ReadOnlyGuard(self.name, log)
        self._policy = make_policy(policy, capacity, clock)
        self._backend: Backend | None = None
        self._root = ""
        self._opening = asyncio.Lock()
        try:
            cls = fsspec.get_filesystem_class(self.protocol)
        except (ValueError, ImportError) as exc:
            raise ConfigError(f"url: fsspec cannot handle {url!r}: {exc}") from exc
        self._async = bool(getattr(cls, "async_impl", False))
        if not self._async:
            # Sync filesystems are cheap to build; failing here reports bad options early.
            self._backend, self._root = self._make_sync_backend()
        self.hits = self.misses = self.io_errors = self.corrupt = self.vanished = 0
        self._warnings = WarningSummary(log)  # one line per interval, not one per victim

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``PROTO://LOCATION?capacity=SIZE&policy=lru&compress=zstd:1&shuffle=1&fanout=2
        &fsync=0&nowait=auto&timeout=30&probe=1&name=LABEL&<storage options>``; other query
        options and the ``storage_options`` keyword go to the fsspec filesystem. A
        ``fsspec+`` prefix (``fsspec+https://...``) names the fsspec protocol explicitly."""
        parsed = parse_tier_url(url)
        merged: dict[str, Any] = {**parsed.params, **options}
        storage = {k: _storage_value(v) for k, v in merged.items() if k not in _OWN_OPTIONS}
        extra = merged.get("storage_options") or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"storage_options: expected a dict, got {type(extra).__name__}")
        storage.update(extra)
        capacity = merged.get("capacity")
        kwargs: dict[str, Any] = {}
        if "clock" in merged:
            kwargs["clock"] = merged["clock"]
        try:
            fanout = int(str(merged.get("fanout", 2)))
            timeout = float(str(merged.get("timeout", 30.0)))
        except ValueError as exc:
            raise ConfigError(f"url: bad fanout/timeout in {url!r}: {exc}") from None
        return cls(
            _base_url(parsed), storage_options=storage,
            capacity=None if capacity in (None, "") else parse_size(capacity),
            compress_level=parse_compress(merged.get("compress")),
            shuffle=parse_bool(merged.get("shuffle", False), "shuffle"),
            fanout=fanout, fsync=parse_bool(merged.get("fsync", False), "fsync"),
            nowait=merged.get("nowait", "auto"),
            probe=parse_probe(merged.get("probe", ProbeMode.AUTO)),
            timeout=timeout, policy=parse_policy(merged.get("policy")),
            name=str(merged["name"]) if "name" in merged else None,
            **fleet_options(merged), **kwargs)

    def _make_sync_backend(self) -> tuple[Backend, str]:
        try:
            fs, root = fsspec.url_to_fs(self.url, **self.storage_options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"url: cannot open {self.url!r}: {exc}") from exc
        if isinstance(fs, LocalFileSystem):
            if self.storage_options:
                # Local files go through os calls; a storage option here is a typo.
                unknown = ", ".join(sorted(self.storage_options))
                raise ConfigError(f"url: unknown option(s) {unknown} for file:// (kvtier "
                                  f"options: {', '.join(sorted(_OWN_OPTIONS))})")
            self._decide_nowait(root)
            use_log, fleet_capacity, gc_interval, watch = self._fleet_settings
            self.fleet = FleetMember(
                root, use_log=use_log, fleet_capacity=fleet_capacity, gc_interval=gc_interval,
                forget=lambda keys: self._forget(keys, "deleted by this node's fleet gc"),
                watch=watch, recheck=self._recheck)
            return LocalBackend(fsync=self.fsync, nowait=self.nowait), root
        return SyncFsBackend(fs), root

    def _decide_nowait(self, root: str) -> None:
        """Find the root's filesystem type (for stats) and settle ``nowait=auto``. Looks up
        /proc and path components on local mounts only, so it never waits for a server."""
        check = check_local(root, read_mountinfo())
        self.fstype = check.fstype
        self.nowait = check.local if self._nowait_mode is None else self._nowait_mode
        log.debug("%s tier: nowait=%s (%s): %s", self.name, self.nowait,
                  "auto" if self._nowait_mode is None else "forced", check.reason)

    async def _ready(self) -> Backend:
        if self._backend is not None:
            return self._backend
        async with self._opening:
            if self._backend is None:
                fs, root = fsspec.url_to_fs(
                    self.url, asynchronous=True, loop=asyncio.get_running_loop(),
                    skip_instance_cache=True, **self.storage_options)
                if hasattr(fs, "set_session"):
                    async with Deadline.after(self.timeout, f"{self.name} session"):
                        await fs.set_session()
                self._root = root
                self._backend = AsyncFsBackend(fs)
        return self._backend

    async def open(self) -> None:
        """Check that the location takes a block: write a probe object (a temp file renamed
        into place, for ``file://``), then delete it; with ``fleet_capacity``, start the
        background gc of the shared directory. ``open_store`` calls this.

        Under ``probe=auto`` a probe refused for permission (``EACCES``, ``EPERM``,
        ``EROFS``) on a root that can still be listed opens the tier read-only instead
        (:mod:`kvtier.tiers.fsspec_readonly`).

        Raises
        ------
        ConfigError
            Naming the URL and the error, when the probe cannot be written or deleted and
            the tier does not open read-only (a missing mount or directory, a bucket that
            does not exist, wrong credentials, a location that cannot be read either, or
            any failure under ``probe=require``).
        """
        if self.probe is not ProbeMode.OFF:
            await self._probe()
        if self.fleet is not None and not self.guard.read_only:
            self.fleet.start()

    async def _probe(self) -> None:
        try:
            backend = await self._ready()
            path = f"{self._root.rstrip('/')}/.kvtier-probe-{uuid.uuid4().hex}"
            frame = encode_frame(_PROBE_BLOCK)
            written = False
            try:
                async with Deadline.after(self.timeout, f"{self.name} write probe"):
                    written = True  # from here on the probe object may exist
                    await backend.write(path, lambda: frame)
                    await backend.delete(path)
                    written = False
            finally:
                if written:  # cancelled or timed out between the write and the delete
                    await self._remove_probe(backend, path)
        except Exception as exc:  # whatever the back end raises, the tier cannot be used
            error = f"{type(exc).__name__}: {exc}"
            if self.probe is ProbeMode.AUTO and is_read_only_error(exc):
                unreadable = await check_readable(self._backend, self._root, self.timeout)
                if unreadable is None:
                    await self._open_read_only(error)
                    return
                error += f"; and it cannot be read either: {unreadable}"
            where = "the path in the URL" if self.protocol in ("file", "local") else \
                "the URL or its storage options (bucket, endpoint_url, credentials)"
            raise ConfigError(
                f"{self.name} tier: {self.url!r} cannot take a block: the write probe failed "
                f"({error}); change {where}") from exc

    async def _open_read_only(self, why: str) -> None:
        """Serve reads only: the location refused the probe's write but can be read."""
        self.guard.set_read_only(f"the write probe failed: {why}")
        fleet, self.fleet = self.fleet, None  # its use log and gc write the shared directory
        if fleet is not None:
            await fleet.aclose()
        log.warning("%s tier: %s opened read-only: the write probe was refused (%s); reads "
                    "serve, writes and deletes are refused (probe=require makes this an "
                    "error)", self.name, self.url, why)

    async def _remove_probe(self, backend: Backend, path: str) -> None:
        """Delete a probe object an interrupted probe may have left, even when the open is
        being cancelled (the cancellation is raised after it). Bounded by the tier's
        timeout, but never less than a few seconds: the probe that needs it may have been
        cut short by a tiny one."""
        async def remove() -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(max(self.timeout, _PROBE_CLEANUP_S)):
                    await backend.delete(path)

        await run_to_end(asyncio.ensure_future(remove()))

    def _forget(self, keys: list[bytes], why: str) -> None:
        """Stop counting ``keys`` whose files were deleted behind this tier's back (by a
        gc pass of this node, or found missing on a read), and report them dropped (a
        ``BlockRemoved`` event; ``explain`` says ``evicted`` and ``why``). Keys in flight
        are left to their put or eviction."""
        state = self._eviction_state
        gone = [key for key in keys if not state.is_leaving(key) and not state.is_writing(key)
                and self._policy.remove(key) is not None]
        if gone:
            self._report_dropped(gone)
            self._report_miss(gone, MissReason.EVICTED, why)

    async def _recheck(self) -> None:
        """The directory changed under this tier (its epoch marker moved: a gc of another
        process; or its entries: a wipe): forget the held blocks whose files are gone
        (``BlockRemoved``), and report the tier cleared when nothing is left."""
        keys = list(self._policy.lru_order())
        if not keys:
            return
        paths = [self.path_of(key) for key in keys]
        present = await asyncio.to_thread(lambda: [os.path.exists(p) for p in paths])
        gone = [k for k, there in zip(keys, present, strict=True) if not there]
        self._forget(gone, "deleted by another process (kvtier gc, another node's fleet gc, "
                           "or a wipe of the directory)")
        if gone and not len(self._policy) and not self._eviction_state.leaving_count:
            self._report_cleared()

    @property
    def root(self) -> str:
        """The filesystem path blocks live under."""
        return self._root

    def path_of(self, key: bytes) -> str:
        """Where ``key`` is (or would be) stored (async filesystems: after first use)."""
        return key_path(self._root, key, self.fanout)

    async def _path(self, key: bytes) -> str:
        await self._ready()
        return self.path_of(key)

    # ---------------------------------------------------------------- contract
    async def _io(self, op: Callable[[Backend], Awaitable[T]], what: str) -> T:
        """``op`` under :attr:`timeout`, a :class:`~kvtier.deadline.Deadline` (within the
        caller's): a worker-thread call still queued at it is cancelled; one that started
        and changes storage is waited for (no timeout stops a thread: a write left running
        would land after a newer one, uncounted, a delete remove a newer block), as it is
        by a cancelled caller; the ``TimeoutError`` says which (:meth:`_write` counts what
        a waited-for write stored)."""
        backend = await self._ready()
        async with Deadline.after(self.timeout, f"{self.name} {what}"):
            return await op(backend)

    async def _read(self, key: bytes) -> Block | None:
        """Read ``key``. A corrupt copy is a miss: deleted and counted. An I/O error is
        counted and raised as :class:`TierError` (the store turns it into a miss)."""
        path = await self._path(key)
        try:
            return await self._io(lambda b: b.read(path, decode_frame), "read")
        except CorruptBlockError as exc:
            self.corrupt += 1
            log.warning("%s tier: corrupt block %s deleted: %s", self.name, path, exc)
            self._report_miss((key,), MissReason.CORRUPT, str(exc))
            try:
                await self._io(lambda b: b.delete(path), "delete")
            except _IO_ERRORS as del_exc:  # a read-only mount cannot delete it: still a miss
                log.warning("%s tier: cannot delete corrupt %s: %s", self.name, path, del_exc)
            self._policy.remove(key)
        except _IO_ERRORS as exc:
            self.io_errors += 1
            raise TierError(f"{self.name} tier: read of {path} failed: {exc!r}") from exc
        return None

    async def _get(self, key: bytes) -> Block | None:
        block = await self._read(key)
        if block is None:
            self.misses += 1
            if key in self._policy and not self._eviction_state.is_writing(key):
                # Counted here but gone from storage: deleted by the fleet gc, another
                # node or an operator. A miss; the budget stops counting it.
                self.vanished += 1
                self._forget([key], "file removed from the shared directory (fleet gc or "
                             "another node)")
        else:
            self.hits += 1
            self._policy.touch(key)
            if self.fleet is not None:
                self.fleet.note_read(self.path_of(key))
        return block

    async def _contains(self, key: bytes) -> bool:
        if self._held(key):
            return True
        if self._eviction_state.is_leaving(key):  # being dropped: its file may go while we look
            return False
        path = await self._path(key)
        try:
            return await self._io(lambda b: b.exists(path), "exists")
        except _IO_ERRORS as exc:
            self.io_errors += 1
            raise TierError(f"{self.name} tier: exists({path}) failed: {exc!r}") from exc

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        backend = await self._ready()
        if not isinstance(backend, LocalBackend):
            return await super()._contains_many(keys)
        # Local files: one batch of stats, not a task and a thread hop per key (a prefix
        # lookup of a 2,048-token prompt is 64 keys, on the engine scheduler's critical path).
        present = [self._held(key) for key in keys]
        leaving = self._eviction_state.is_leaving
        ask = [i for i, key in enumerate(keys) if not present[i] and not leaving(key)]
        if ask:
            paths = [await self._path(keys[i]) for i in ask]
            try:
                async with Deadline.after(self.timeout, f"{self.name} exists"):
                    found = await backend.exists_many(paths)
            except _IO_ERRORS as exc:
                self.io_errors += 1
                raise TierError(f"{self.name} tier: exists of {len(paths)} files failed: "
                                f"{exc!r}") from exc
            for i, yes in zip(ask, found, strict=True):
                present[i] = yes
        return present

    def _encoder(self, block: Block) -> Callable[[], EncodedFrame]:
        return lambda: encode_frame(block, compress_level=self.compress_level,
                                    shuffle=self.shuffle)

    async def _put(self, key: bytes, block: Block) -> None:
        if self.guard.read_only:
            self.guard.refuse("put")
            return
        bound = frame_size_bound(block)
        self._policy.check_fits(bound)
        await self._store_evicting(((key, block),), (bound,))

    async def _commit(self, items: Sequence[tuple[bytes, Block]],
                      dropped: list[bytes]) -> list[int]:
        await self._drop_stored(dropped)
        return [await self._write(key, block) for key, block in items]

    async def _write(self, key: bytes, block: Block) -> int:
        """Encode and publish one block; returns its frame bytes.

        A write that fails once its file is in place (its thread had started at the tier's
        ``timeout``, which waited for it and then raised) admits the block before raising:
        the file is stored, and the budget must count it (else it sits on disk, never
        evicted)."""
        path = await self._path(key)
        frames: list[EncodedFrame] = []
        published: list[bool] = []

        def encode() -> EncodedFrame:
            frames.append(self._encoder(block)())
            return frames[-1]

        try:
            await self._io(lambda b: b.write(path, encode, lambda: published.append(True)),
                           "write")
        except BaseException as exc:
            if published:
                self._policy.admit(key, frames[-1].nbytes)
            if not isinstance(exc, _IO_ERRORS):
                raise
            self.io_errors += 1
            raise TierError(f"{self.name} tier: write of {path} failed: {exc!r}") from exc
        return frames[-1].nbytes if frames else frame_size_bound(block)

    async def _read_leaving(self, keys: list[bytes]) -> list[Block | None]:
        blocks: list[Block | None] = []
        for key in keys:
            try:
                blocks.append(await self._read(key))
            except TierError as exc:  # counted; the victim is dropped undemoted
                self._warnings.warn(f"{self.name} tier", "victim read",
                                    f"{key.hex()}: {exc}")
                blocks.append(None)
        return blocks

    async def _drop_stored(self, keys: list[bytes]) -> None:
        async def drop() -> None:
            for key in keys:
                try:
                    await self._remove(key)
                except TierError as exc:  # counted; the file stays until a delete or gc
                    self._warnings.warn(f"{self.name} tier", "victim delete", str(exc))

        # The budget no longer counts the victims: their files go whatever the put's
        # deadline or cancellation says (else they stay on disk, held but uncounted).
        with exempt():
            await run_to_end(asyncio.ensure_future(drop()))

    async def _remove(self, key: bytes) -> bool:
        path = await self._path(key)
        # Forgotten only once the file is gone: a delete its deadline cancelled before it
        # started left the file, which stays counted (and evictable).
        gone: list[bool] = []
        try:
            found = await self._io(lambda b: b.delete(path, lambda: gone.append(True)),
                                   "delete")
        except _IO_ERRORS as exc:
            self.io_errors += 1
            raise TierError(f"{self.name} tier: delete of {path} failed: {exc!r}") from exc
        finally:
            if gone:
                self._policy.remove(key)
        return found

    async def _delete(self, key: bytes) -> bool:
        if self.guard.read_only:
            self.guard.refuse("delete")
            return False
        # Waits for an in-flight eviction so a deleted key is not demoted afterwards.
        if self._busy():
            await self._settled([key])
        return await self._remove(key)

    async def _aclose(self) -> None:
        if self.fleet is not None:
            await self.fleet.aclose()
        await self._commits_done()
        self._warnings.flush()
        self.guard.flush()
        if self._backend is not None:
            await self._backend.close()
            self._backend = None

    def stats(self) -> dict[str, Any]:
        backend = self._backend
        nowait = {"nowait": backend.nowait, "fstype": self.fstype,
                  "reads_nowait": backend.reads_nowait} \
            if isinstance(backend, LocalBackend) else {}
        return {**super().stats(), "scheme": self.protocol, "hits": self.hits,
                "misses": self.misses, "io_errors": self.io_errors, "corrupt": self.corrupt,
                "vanished": self.vanished, "url": self.url, **nowait, **self.guard.stats(),
                **(self.fleet.stats() if self.fleet is not None else {})}


def _parse_nowait(value: object) -> bool | None:
    """The ``nowait`` option: ``None`` for ``"auto"``; ``True``/``False`` (``1``/``0``,
    ``true``/``false``...) force it."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, bool | int | str):
        with contextlib.suppress(ConfigError):
            return parse_bool(value, "nowait")
    raise ConfigError(f"nowait: expected 0, 1 or auto, got {value!r}")


def _base_url(parsed: TierURL) -> str:
    """The URL without its query string (kvtier and storage options are passed apart)."""
    return f"{parsed.scheme.removeprefix(EXPLICIT_PREFIX)}://{parsed.netloc}{parsed.path}"
