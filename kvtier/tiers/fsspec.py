"""Any fsspec URL as a tier: ``file:///mnt/weka/kvtier``, ``memory://kv``,
``s3://bucket/prefix?endpoint_url=...``.

- Content-addressed layout: a key is stored at ``ROOT/ab/cd/abcd....kvb`` (its lowercase
  hex, ``fanout`` directory levels of two hex digits). No user-supplied text becomes a path
  component, so no traversal is possible.
- Atomic publish (see :mod:`kvtier.tiers.fsspec_io`): readers see whole blocks only, and
  several nodes may share one URL (same key, same content: concurrent writers are safe).
  Every frame is checksummed; a partial or corrupt object is a miss, deleted and counted.
- Optional ``capacity=``: LRU trimming of *this* node's writes (evicted blocks go to the
  demotion callback first). A shared directory as a whole is trimmed by ``kvtier gc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvtier.codec import (
    EncodedFrame,
    decode_frame,
    encode_frame,
    frame_size_bound,
    parse_compress,
)
from kvtier.errors import ConfigError, CorruptBlockError, TierError
from kvtier.policy import Clock
from kvtier.tiers.base import Block
from kvtier.tiers.budget import BudgetedTier, make_policy, parse_policy
from kvtier.tiers.fsspec_io import AsyncFsBackend, Backend, LocalBackend, SyncFsBackend
from kvtier.tiers.mounts import check_local, read_mountinfo
from kvtier.urls import TierURL, parse_bool, parse_size, parse_tier_url

__all__ = ["BLOCK_SUFFIX", "FsspecTier", "key_path"]

log = logging.getLogger("kvtier.tiers.fsspec")
T = TypeVar("T")

BLOCK_SUFFIX = ".kvb"
_OWN_OPTIONS = {"capacity", "compress", "shuffle", "fanout", "fsync", "name", "timeout",
                "storage_options", "clock", "policy", "nowait"}


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
                 nowait: bool | str = "auto", timeout: float = 30.0, policy: str = "lru",
                 clock: Clock = time.monotonic,
                 name: str | None = None) -> None:
        if not 0 <= fanout <= 4:
            raise ConfigError(f"fanout: expected 0..4, got {fanout}")
        if timeout <= 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout}")
        self.protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
        nowait_mode = _parse_nowait(nowait)
        if nowait_mode and self.protocol not in ("file", "local"):
            raise ConfigError(f"nowait: only for file:// tiers, not {self.protocol}://")
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
        self.hits = self.misses = self.io_errors = self.corrupt = 0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``PROTO://LOCATION?capacity=SIZE&policy=lru&compress=zstd:1&shuffle=1&fanout=2
        &fsync=0&nowait=auto&timeout=30&name=LABEL&<storage options>``; other query options and the
        ``storage_options`` keyword go to the fsspec filesystem."""
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
            timeout=timeout, policy=parse_policy(merged.get("policy")),
            name=str(merged["name"]) if "name" in merged else None, **kwargs)

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
                    await asyncio.wait_for(fs.set_session(), self.timeout)
                self._root = root
                self._backend = AsyncFsBackend(fs)
        return self._backend

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
    async def _io(self, op: Callable[[Backend], Awaitable[T]]) -> T:
        backend = await self._ready()
        async with asyncio.timeout(self.timeout):
            return await op(backend)

    async def _read(self, key: bytes) -> Block | None:
        """Read ``key``. A corrupt copy is a miss: deleted and counted. An I/O error is
        counted and raised as :class:`TierError` (the store turns it into a miss)."""
        path = await self._path(key)
        try:
            return await self._io(lambda b: b.read(path, decode_frame))
        except CorruptBlockError as exc:
            self.corrupt += 1
            log.warning("%s tier: corrupt block %s deleted: %s", self.name, path, exc)
            try:
                await self._io(lambda b: b.delete(path))
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
        else:
            self.hits += 1
            self._policy.touch(key)
        return block

    async def _contains(self, key: bytes) -> bool:
        if self._held(key):
            return True
        if key in self._leaving:  # being dropped: its file may go while we look
            return False
        path = await self._path(key)
        try:
            return await self._io(lambda b: b.exists(path))
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
        ask = [i for i, key in enumerate(keys) if not present[i] and key not in self._leaving]
        if ask:
            paths = [await self._path(keys[i]) for i in ask]
            try:
                async with asyncio.timeout(self.timeout):
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
        bound = frame_size_bound(block)
        self._policy.check_fits(bound)
        await self._store_evicting(((key, block),), (bound,))

    async def _commit(self, items: Sequence[tuple[bytes, Block]],
                      dropped: list[bytes]) -> list[int]:
        await self._drop_stored(dropped)
        return [await self._write(key, block) for key, block in items]

    async def _write(self, key: bytes, block: Block) -> int:
        """Encode and publish one block; returns its frame bytes."""
        path = await self._path(key)
        frames: list[EncodedFrame] = []

        def encode() -> EncodedFrame:
            frames.append(self._encoder(block)())
            return frames[-1]

        try:
            await self._io(lambda b: b.write(path, encode))
        except _IO_ERRORS as exc:
            self.io_errors += 1
            raise TierError(f"{self.name} tier: write of {path} failed: {exc!r}") from exc
        return frames[-1].nbytes if frames else frame_size_bound(block)

    async def _read_leaving(self, keys: list[bytes]) -> list[Block | None]:
        blocks: list[Block | None] = []
        for key in keys:
            try:
                blocks.append(await self._read(key))
            except TierError as exc:  # counted; the victim is dropped undemoted
                log.warning("%s tier: victim %s unreadable: %s", self.name, key.hex(), exc)
                blocks.append(None)
        return blocks

    async def _drop_stored(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                await self._remove(key)
            except TierError as exc:  # counted; the file stays until a delete or gc
                log.warning("%s tier: %s", self.name, exc)

    async def _remove(self, key: bytes) -> bool:
        path = await self._path(key)
        try:
            found = await self._io(lambda b: b.delete(path))
        except _IO_ERRORS as exc:
            self.io_errors += 1
            raise TierError(f"{self.name} tier: delete of {path} failed: {exc!r}") from exc
        finally:
            self._policy.remove(key)
        return found

    async def _delete(self, key: bytes) -> bool:
        # Waits for an in-flight eviction so a deleted key is not demoted afterwards.
        if self._busy():
            await self._settled([key])
        return await self._remove(key)

    async def _aclose(self) -> None:
        await self._commits_done()
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
                "url": self.url, **nowait}


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
    return f"{parsed.scheme}://{parsed.netloc}{parsed.path}"
