"""``mooncake://``: a Mooncake Store (``mooncake_master`` plus the segments its clients
mount) as a pool tier.

Each block is one Mooncake object, ``prefix + key.hex()``, holding kvtier's checksummed frame
(dtype and shape travel in its header; a torn or foreign value is a miss and that copy is
removed). Data moves through the zero-copy calls: frames are staged in an area registered
once with the client (``batch_upsert_from``, ``batch_get_into``), then decoded and copied
once into a fresh array or the caller's ``out``; only a frame larger than the free staging
space takes the copying calls. ``lookup_prefix`` and ``contains_many`` use one
``batch_is_exist``.

The client's calls block, so they run on the tier's own worker threads, never on the event
loop, each under a :class:`~kvtier.deadline.Deadline` of ``timeout`` seconds (within the
caller's): a call still queued at it is cancelled and never runs. A started read is left to
finish alone (a counted miss), which is harmless: ``get_into`` copies into ``out`` on the
loop from the staging slot a thread filled (no thread writes into ``out`` after the call
returned). A started write (put, delete) is awaited to its end, even by a cancelled caller,
since its thread reads the caller's blocks and changes the pool; writes of one key run in
call order (an older value never lands after a newer one). The
master is probed with a TCP connect before ``setup()``, which holds the GIL while it retries
an unreachable master. Capacity belongs to the master (it evicts by lease and watermark), so
:attr:`capacity` is ``None``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Self, TypeVar

import numpy as np

from kvtier.codec import decode_frame, encode_frame
from kvtier.deadline import Deadline, DeadlineExceeded, after_earlier, in_thread
from kvtier.errors import ConfigError, CorruptBlockError, TierError
from kvtier.tiers.base import BatchTier, Block, copy_into
from kvtier.tiers.mooncake_client import (
    BUFFER_TOO_SMALL,
    OBJECT_NOT_FOUND,
    MooncakeClient,
    MooncakeSettings,
)
from kvtier.urls import merge_options, parse_number, parse_size, parse_tier_url

__all__ = ["MooncakeTier"]

log = logging.getLogger("kvtier.tiers.mooncake")
T = TypeVar("T")
_OPTIONS = {"metadata", "protocol", "device", "segment", "local_buffer", "staging", "replicas",
            "prefix", "local_host", "timeout", "threads", "name"}
_PROTOCOLS = ("tcp", "rdma")
_DEFAULT_SLOT = (1 << 20) + 4096  # a 1 MiB block's frame fits; the hint grows with use
#: A fetched frame: ``(slot offset, slot size, frame bytes)`` in the staging area, or bytes.
_Fetched = tuple[int, int, int] | bytes | None


class MooncakeTier(BatchTier):
    """A Mooncake Store as a tier shared by every store whose clients reach its master.

    Parameters
    ----------
    settings
        The client configuration; tiers in one process with equal settings share a client.
    replicas
        Copies per object (``ReplicateConfig.replica_num``).
    prefix
        Prepended to every object name (namespaces deployments on one master).
    timeout
        Seconds a call may take: a read past it is a miss, a call still queued at it is
        cancelled, a started write is waited for (:mod:`kvtier.deadline`).
    threads
        Worker threads for the blocking client calls (bounds this tier's concurrency). Few:
        one client slows down as threads are added (here, 16-block batches at 8 concurrent
        callers moved 0.05-0.10 GB/s on 8 threads and 0.27-0.50 GB/s on 1-2).

    Examples
    --------
    ``mooncake://10.0.0.5:50051?metadata=P2PHANDSHAKE&protocol=tcp&segment=4GiB``
    """

    scheme = "mooncake"
    shared = True  # other stores of the pool read it: private tiers above write through

    def __init__(self, settings: MooncakeSettings, *, replicas: int = 1, prefix: str = "kvt:",
                 timeout: float = 5.0, threads: int = 2, name: str | None = None) -> None:
        super().__init__(name=name)
        self.batch_concurrency = threads
        if replicas < 1:
            raise ConfigError(f"replicas: expected >= 1, got {replicas!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout!r}")
        self.settings = settings
        self.replicas = replicas
        self.prefix = prefix
        self.timeout = timeout
        self.counts: Counter[str] = Counter()
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-mooncake")
        self._client: MooncakeClient | None = None
        self._setup: asyncio.Future[MooncakeClient] | None = None
        self._inflight: dict[bytes, asyncio.Future[Any]] = {}
        self._sizes: dict[bytes, int] = {}
        self._used = 0
        self._slot = _DEFAULT_SLOT

    # ------------------------------------------------------------------ config
    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``mooncake://master-host:port?...``.

        Options: ``metadata`` (``P2PHANDSHAKE`` or a metadata server URL), ``protocol``
        (tcp/rdma), ``device`` (RDMA devices), ``segment`` (memory this client contributes
        to the pool), ``local_buffer``, ``staging`` (registered staging area), ``replicas``,
        ``prefix``, ``local_host`` (address other clients reach this one at; default
        ``$MC_TCP_BIND_ADDRESS`` or this host's name), ``timeout``, ``threads``, ``name``.
        """
        parsed = parse_tier_url(url)
        if parsed.scheme != "mooncake":
            raise ConfigError(f"url: expected mooncake://, got {url!r}")
        if parsed.path not in ("", "/"):
            raise ConfigError("url: mooncake:// takes no path")
        host, sep, port = parsed.netloc.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"url: expected mooncake://master-host:port, got "
                              f"{parsed.netloc!r}")
        opts = merge_options(parsed, options, _OPTIONS)
        protocol = str(opts.get("protocol", "tcp")).lower()
        if protocol not in _PROTOCOLS:
            raise ConfigError(f"protocol: expected one of {_PROTOCOLS}, got {protocol!r}")
        timeout = parse_number(opts.get("timeout", 5.0), "timeout", float, 0.001)
        settings = MooncakeSettings(
            master=parsed.netloc,
            metadata=str(opts.get("metadata", "P2PHANDSHAKE")),
            protocol=protocol,
            devices=str(opts.get("device", "")),
            segment=parse_size(opts.get("segment", 0), "segment"),  # type: ignore[arg-type]
            local_buffer=parse_size(opts.get("local_buffer", 64 << 20),  # type: ignore[arg-type]
                                    "local_buffer"),
            staging=parse_size(opts.get("staging", 64 << 20), "staging"),  # type: ignore[arg-type]
            local_host=str(opts.get("local_host", "")),
        )
        return cls(settings, replicas=parse_number(opts.get("replicas", 1), "replicas", int, 1),
                   prefix=str(opts.get("prefix", "kvt:")), timeout=timeout,
                   threads=parse_number(opts.get("threads", 2), "threads", int, 1),
                   name=str(opts["name"]) if opts.get("name") else None)

    @property
    def capacity(self) -> int | None:
        # The master owns the pool's memory and evicts; this client enforces no budget.
        return None

    @property
    def used(self) -> int:
        """Block bytes this tier wrote and has not deleted (the master's evictions are not
        reported to clients, so this is an upper bound of what this tier still holds)."""
        return self._used

    def _account(self, key: bytes, nbytes: int) -> None:
        self._used += nbytes - (self._sizes.pop(key, 0))
        if nbytes:
            self._sizes[key] = nbytes

    @property
    def client(self) -> MooncakeClient | None:
        """The shared client once the first call set it up (``None`` before and after close)."""
        return self._client

    # ----------------------------------------------------------------- plumbing
    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    async def _started(self) -> MooncakeClient:
        if self._client is not None:
            return self._client
        if self._setup is None:
            # One setup at a time, shared by every caller (none cancels it); it may take
            # minutes against a dead master, so callers wait at most ``timeout`` and later
            # calls find it still running (or done).
            self._setup = asyncio.get_running_loop().run_in_executor(
                self._executor, MooncakeClient.acquire, self.settings, self.timeout)
            self._setup.add_done_callback(self._set_up)
        try:
            async with Deadline.after(self.timeout, f"{self.name} setup"):
                await asyncio.shield(self._setup)
        except DeadlineExceeded:
            self.counts["timeouts"] += 1
            raise TierError(f"{self.name}: setup: no answer in {self.timeout} s") from None
        if self._client is None:
            raise TierError(f"{self.name}: closed during setup")
        return self._client

    def _set_up(self, future: asyncio.Future[MooncakeClient]) -> None:
        self._setup = None  # a failed setup is retried by the next call
        if future.cancelled() or future.exception() is not None:
            return
        client = future.result()
        if self._closed:  # closed while it ran: hand the reference back
            threading.Thread(target=client.release, daemon=True).start()
        else:
            self._client = client

    async def _call(self, what: str, fn: Callable[..., T], *args: Any,
                    writes: Sequence[bytes] | None = None,
                    discard: Callable[[T], object] | None = None) -> T:
        """``fn(*args)`` on this tier's worker threads under :attr:`timeout`, a
        :class:`~kvtier.deadline.Deadline` within the caller's: a call still queued at it is
        cancelled (it never runs); a started read is left to finish alone (it fills memory
        this tier owns; ``discard`` frees what it returns). A write (of keys ``writes``)
        runs after this tier's writes of the same keys still in flight, so an older value
        never lands after a newer one (waiting for them is not having started), and once
        started it is waited for, as it is by a cancelled caller: its thread reads the
        caller's blocks and changes the pool."""
        try:
            async with Deadline.after(self.timeout, f"{self.name} {what}"):
                if writes is None:
                    return await in_thread(fn, *args, what=f"mooncake {what}",
                                           executor=self._executor, wait_started=False,
                                           discard=discard)
                await after_earlier({id(f): f for k in writes
                                     if (f := self._inflight.get(k)) is not None}.values(),
                                    f"mooncake {what} after an earlier write of its keys")
                turn = asyncio.get_running_loop().create_future()
                for key in writes:
                    self._inflight[key] = turn
                try:
                    return await in_thread(fn, *args, what=f"mooncake {what}",
                                           executor=self._executor)
                finally:
                    turn.set_result(None)
                    for key in writes:
                        if self._inflight.get(key) is turn:
                            del self._inflight[key]
        except DeadlineExceeded:
            self.counts["timeouts"] += 1
            raise

    # ----------------------------------------------------------------- contract
    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        client = await self._started()
        return await self._call("get", self._read, client, keys)

    async def _get_into(self, key: bytes, out: Block) -> bool:
        # The thread only fills a staging slot; the copy into ``out`` happens here, so no
        # thread can write into ``out`` after this call gave up on it (and a slot filled
        # after it left is freed when its thread ends).
        client = await self._started()
        frame = await self._call("get", self._fetch, client, key,
                                 discard=partial(self._release, client))
        try:
            if frame is None:
                return False
            block = self._decoded(client, key, self._view(client, frame))
            if block is None:
                return False
            copy_into(block, out)  # checks ``out`` first: a mismatch raises before any write
            return True
        finally:
            self._release(client, frame)

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        client = await self._started()
        codes = await self._call("exists", client.store.batch_is_exist,
                                 [self._name(k) for k in keys])
        failed = sum(1 for c in codes if c < 0)
        if failed:
            self.counts["errors"] += failed
            if failed == len(codes):
                raise TierError(f"{self.name}: batch_is_exist failed ({codes[0]})")
        return [c == 1 for c in codes]

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        client = await self._started()
        last = dict(items)  # one write per key: the last value wins
        codes = await self._call("put", self._write, client, list(last.items()),
                                 writes=list(last))
        for (key, block), code in zip(last.items(), codes, strict=True):
            if code >= 0:
                self._account(key, block.nbytes)
        bad = [(k, c) for k, c in zip(last, codes, strict=True) if c < 0]
        if bad:
            self.counts["errors"] += len(bad)
            raise TierError(f"{self.name}: {len(bad)} of {len(last)} blocks not stored "
                            f"(first: {bad[0][0].hex()} rc={bad[0][1]})")

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        client = await self._started()
        codes = await self._call("delete", client.store.batch_remove,
                                 [self._name(k) for k in keys], True, writes=keys)
        for key, code in zip(keys, codes, strict=True):
            if code == 0 or code == OBJECT_NOT_FOUND:
                self._account(key, 0)
        bad = [c for c in codes if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            self.counts["errors"] += len(bad)
            raise TierError(f"{self.name}: {len(bad)} of {len(keys)} removals failed "
                            f"(rc={bad[0]})")
        return [c == 0 for c in codes]

    async def _aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, client.release)
        # A setup still running releases its client when it ends (``_set_up``).
        self._executor.shutdown(wait=False)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), **self.counts, "replicas": self.replicas,
                "master": self.settings.master}

    # ------------------------------------------------------------ worker threads
    def _write(self, client: MooncakeClient, items: list[tuple[bytes, Block]]) -> list[int]:
        """Stage frames in the registered area and upsert them in one call (blocks)."""
        store, arena = client.store, client.staging
        config = client.replicate_config(self.replicas)
        codes = [0] * len(items)
        staged: list[tuple[int, int, int]] = []  # (item index, offset, frame bytes)
        try:
            for i, (key, block) in enumerate(items):
                frame = encode_frame(block, key=key)
                offset = arena.alloc(frame.nbytes)
                if offset is None:  # larger than the free staging space: copying call
                    codes[i] = store.upsert(self._name(key), frame.to_bytes(), config)
                    continue
                slot = arena.view(offset, frame.nbytes)
                slot[:len(frame.header)] = np.frombuffer(frame.header, np.uint8)
                slot[len(frame.header):] = np.frombuffer(frame.payload, np.uint8)
                staged.append((i, offset, frame.nbytes))
            if staged:
                done = store.batch_upsert_from(
                    [self._name(items[i][0]) for i, _, _ in staged],
                    [arena.base + off for _, off, _ in staged], [n for _, _, n in staged], config)
                for (i, _, _), code in zip(staged, done, strict=True):
                    codes[i] = code
        finally:
            for _, offset, nbytes in staged:
                arena.free(offset, nbytes)
        self._slot = max(self._slot, *(block.nbytes + 4096 for _, block in items))
        return codes

    def _read(self, client: MooncakeClient, keys: Sequence[bytes]) -> list[Block | None]:
        """Fetch frames into staging slots in one call, verify and copy them out (blocks)."""
        store, arena = client.store, client.staging
        names = [self._name(k) for k in keys]
        slot_size = self._slot  # other threads may grow the hint meanwhile
        slots = [arena.alloc(slot_size) for _ in keys]
        results: list[Block | None] = [None] * len(keys)
        try:
            staged = [(i, s) for i, s in enumerate(slots) if s is not None]
            codes: dict[int, int] = {}
            if staged:
                got = store.batch_get_into([names[i] for i, _ in staged],
                                           [arena.base + s for _, s in staged],
                                           [slot_size] * len(staged))
                codes = dict(zip((i for i, _ in staged), got, strict=True))
            for i, key in enumerate(keys):
                code, slot = codes.get(i, BUFFER_TOO_SMALL), slots[i]
                frame: Any
                if code > 0 and slot is not None:
                    frame = arena.view(slot, code)
                elif code == BUFFER_TOO_SMALL:  # no slot, or the slot was too small
                    frame = self._copying_get(client, names[i])
                else:
                    self._count_miss(names[i], code)
                    frame = None
                if frame is not None:
                    block = self._decoded(client, key, frame)
                    results[i] = None if block is None else block.copy()
        finally:
            for slot in slots:
                if slot is not None:
                    arena.free(slot, slot_size)
        return results

    def _fetch(self, client: MooncakeClient, key: bytes) -> _Fetched:
        """One frame into a staging slot (or, when it does not fit, as ``bytes``)."""
        store, arena, name = client.store, client.staging, self._name(key)
        slot_size = self._slot
        slot = arena.alloc(slot_size)
        if slot is not None:
            code = store.get_into(name, arena.base + slot, slot_size)
            if code > 0:
                return slot, slot_size, code
            arena.free(slot, slot_size)
            if code != BUFFER_TOO_SMALL:
                self._count_miss(name, code)
                return None
        return self._copying_get(client, name)

    @staticmethod
    def _view(client: MooncakeClient, fetched: _Fetched) -> Any:
        if isinstance(fetched, tuple):
            return client.staging.view(fetched[0], fetched[2])
        return fetched

    @staticmethod
    def _release(client: MooncakeClient, fetched: _Fetched) -> None:
        if isinstance(fetched, tuple):
            client.staging.free(fetched[0], fetched[1])

    def _copying_get(self, client: MooncakeClient, name: str) -> bytes | None:
        size = client.store.get_size(name)
        if size < 0:
            self._count_miss(name, size)
            return None
        self._slot = max(self._slot, size)  # later reads get slots that fit
        return client.store.get(name) or None

    def _count_miss(self, name: str, code: int) -> None:
        """A negative return code: "not found" is a plain miss, others are counted errors."""
        if code != OBJECT_NOT_FOUND:
            self.counts["errors"] += 1
            log.debug("%s: get %s rc=%d", self.name, name, code)

    def _decoded(self, client: MooncakeClient, key: bytes, frame: Any) -> Block | None:
        try:
            return decode_frame(frame, key=key)
        except CorruptBlockError as exc:
            self.counts["corrupt"] += 1
            log.warning("%s: dropping corrupt object %s: %s", self.name, key.hex(), exc)
            client.store.remove(self._name(key), True)
            return None
