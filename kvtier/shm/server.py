"""The host daemon's side of ``local://``: an aiohttp app on a Unix socket beside the peer
server of ``kvtier serve --shm NAME``.

It answers engine processes of this host from the daemon's store (its whole ``--tier``
chain) and lends them slots of the shared arena (:mod:`kvtier.shm.leases`); bulk bytes move
by the engines' own copies into and out of that arena. Requests are taken only from
processes of the daemon's own user (``SO_PEERCRED`` on every request; the socket file is
mode 0600 too). Each client process is watched through a pidfd, so the leases of an engine
that dies end the moment it exits.

Concurrency: everything runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from kvtier.errors import ConfigError, KVTierError, ProtocolError
from kvtier.shm import protocol as p
from kvtier.shm.files import SHM_DIR, socket_path
from kvtier.shm.index import PresenceIndex
from kvtier.shm.index_feed import IndexFeed
from kvtier.shm.leases import LeaseTable
from kvtier.shm.metrics import shm_families

if TYPE_CHECKING:
    from kvtier.peer.metrics import Family
    from kvtier.store import TieredStore
    from kvtier.tiers.dram import DRAMTier

__all__ = ["LocalServer"]

log = logging.getLogger("kvtier.shm")
_CRED = struct.Struct("3i")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _peer(request: web.Request) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process at the other end of ``request``'s Unix socket."""
    transport = request.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _CRED.size))
    except OSError:
        return None
    return pid, uid


class LocalServer:
    """Serve ``store`` to engine processes of this host through ``tier``'s shared arena.

    Parameters
    ----------
    store
        The daemon's store; its top tier is ``tier``.
    tier
        A :class:`~kvtier.tiers.dram.DRAMTier` built with ``shm=NAME``.
    lease_ttl
        Seconds a lease lives at most (an engine that stops, not dies, loses its slots
        after it; a dead one at once).
    index_slots
        Entries of the shared presence index engines answer ``contains`` from
        (:mod:`kvtier.shm.index`; 8 bytes each, a power of two). It takes keys while at most
        3/4 full; a key it cannot take is a false negative (a recompute), counted as
        ``index_refused``.
    """

    def __init__(self, store: TieredStore, tier: DRAMTier, *, lease_ttl: float = 10.0,
                 index_slots: int = 1 << 20) -> None:
        shared = tier.shared_file
        if shared is None or tier.arena is None:
            raise ConfigError("--shm: the top tier must be a dram:// tier with a capacity")
        if not lease_ttl > 0:
            raise ConfigError(f"--shm-lease-ttl: expected > 0, got {lease_ttl!r}")
        self.store = store
        self.tier = tier
        self.arena = tier.arena
        self.shared = shared
        self.path = socket_path(shared.name)
        self.leases = LeaseTable(lease_ttl)
        self.index_slots = index_slots
        self.index: PresenceIndex | None = None
        self._feed: IndexFeed | None = None
        self.counts: Counter[str] = Counter()
        self._pins: dict[int, Counter[bytes]] = {}
        self._watched: dict[int, int] = {}  # pid -> pidfd
        self._expiry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        """Listen on the name's socket; returns its path."""
        self._loop = asyncio.get_running_loop()
        # Beside the arena, under its instance id: a new daemon of the name unlinks it.
        self.index = PresenceIndex(
            SHM_DIR / f"kvtier-{self.shared.name}.{self.shared.instance}.index",
            self.index_slots)
        self._feed = IndexFeed(self.store.event_hub, self.index)
        self._feed.start()
        app = web.Application(client_max_size=p.MAX_BODY, middlewares=[self._guard])
        routes = {"/v1/contains": self._contains, "/v1/lookup": self._lookup,
                  "/v1/lease": self._lease, "/v1/release": self._release,
                  "/v1/prepare": self._prepare, "/v1/commit": self._commit,
                  "/v1/delete": self._delete,
                  "/v1/touch": self._touch, "/v1/pin": self._pin, "/v1/unpin": self._unpin}
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        app.router.add_get("/v1/info", self._info)
        app.router.add_get("/v1/stats", self._stats_handler)
        # We hold the name's lock (the arena's), so a socket file left here is a dead
        # daemon's.
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.path)).start()
        os.chmod(self.path, 0o600)
        return str(self.path)

    async def stop(self) -> None:
        """Stop serving; leases end (engines' copies in flight turn into misses)."""
        if self._expiry is not None:
            self._expiry.cancel()
        for pid in list(self._watched):
            self._unwatch(pid)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._tasks:
            await asyncio.gather(*self._tasks)
        for pid in list(self._pins):
            await self._drop_pins(pid)
        if self._feed is not None:
            await self._feed.stop()
        if self.index is not None:
            self.index.close()

    # --------------------------------------------------------------- bookkeeping
    def _watch(self, pid: int) -> bool:
        """Watch ``pid`` so its leases end when it exits; ``False`` if it is already gone."""
        if pid in self._watched:
            return True
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:  # pid 0: a client in a PID namespace this daemon cannot see
            return True  # its leases end at their time bound only
        assert self._loop is not None
        self._watched[pid] = fd
        self._loop.add_reader(fd, self._exited, pid)
        return True

    def _unwatch(self, pid: int) -> None:
        fd = self._watched.pop(pid, None)
        if fd is not None and self._loop is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def _exited(self, pid: int) -> None:
        self._unwatch(pid)
        dropped = self.leases.drop_pid(pid)
        if dropped:
            log.info("client pid %d exited holding %d lease(s); released", pid, dropped)
        if pid in self._pins:
            task = asyncio.ensure_future(self._drop_pins(pid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drop_pins(self, pid: int) -> None:
        pins = self._pins.pop(pid, Counter())
        if pins:
            await self.store.unpin(list(pins.elements()), tier=0)

    def _schedule_expiry(self) -> None:
        if self._expiry is not None or not len(self.leases) or self._loop is None:
            return
        self._expiry = self._loop.call_later(self.leases.ttl, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        following = self.leases.expire()
        if following is not None and self._loop is not None:
            self._expiry = self._loop.call_at(
                self._loop.time() + max(0.0, following - time.monotonic()) + 0.01,
                self._expire)

    # ------------------------------------------------------------------ requests
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        peer = _peer(request)
        if peer is None or peer[1] != os.geteuid():
            self.counts["refused"] += 1
            return web.Response(status=403, text="local clients of the daemon's user only")
        request["pid"] = peer[0]
        try:
            return await handler(request)
        except ProtocolError as exc:
            self.counts["bad_requests"] += 1
            return web.Response(status=400, text=str(exc))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return p.load(await request.read())

    def _answer(self, obj: dict[str, Any]) -> web.Response:
        if self._feed is not None:  # the caller's next index read sees what this call did
            self._feed.sync()
        obj["used"] = self.tier.used
        return web.Response(body=p.dump(obj), content_type="application/json")

    def _late(self, msg: dict[str, Any]) -> bool:
        deadline = msg.get("deadline")
        if deadline is None:
            return False
        if not isinstance(deadline, int | float):
            raise ProtocolError("deadline: expected a number (time.monotonic())")
        return time.monotonic() > deadline

    async def _info(self, request: web.Request) -> web.Response:
        return self._answer({"instance": self.shared.instance, "path": str(self.shared.path),
                             "nbytes": self.shared.nbytes, "pid": os.getpid(),
                             "capacity": self.tier.capacity, "lease_ttl": self.leases.ttl,
                             "index": None if self.index is None else str(self.index.path),
                             "index_slots": self.index_slots})

    def stats(self) -> dict[str, Any]:
        """Leases out, clients, requests refused, the arena's bytes in use and whether its
        background prefault has finished."""
        return {**self.leases.counts(), "expired": self.leases.expired,
                "dropped": self.leases.dropped, **self.counts,
                "arena_used_bytes": self.arena.used_bytes(), "arena_bytes": self.arena.nbytes,
                "capacity": self.tier.capacity, "instance": self.shared.instance,
                "lookup_miss_reasons": self.store.stats().get("lookup_miss_reasons", {}),
                "prefaulted": self.arena.stats()["prefaulted"],
                "index_keys": 0 if self.index is None else self.index.count,
                "index_refused": 0 if self.index is None else self.index.refused,
                "index_resyncs": 0 if self._feed is None else self._feed.resyncs}

    def metric_stats(self) -> dict[str, int]:
        """The figures of the daemon's ``kvtier_shm_*`` families (:mod:`kvtier.shm.metrics`):
        levels of the arena, the leases and the index, and running totals."""
        leases, index, counts = self.leases, self.index, self.counts
        return {**leases.counts(), "arena_bytes": self.arena.nbytes,
                "arena_used_bytes": self.arena.used_bytes(), "attached": len(self._watched),
                "index_entries": 0 if index is None else index.count,
                "index_slots": self.index_slots,
                "leases_granted": leases.granted_reads, "leases_released": leases.released,
                "leases_expired": leases.expired, "leases_dropped": leases.dropped,
                "prepares": leases.granted_writes, "commits": counts["committed"],
                "index_refused": 0 if index is None else index.refused,
                "index_resyncs": 0 if self._feed is None else self._feed.resyncs,
                **{k: counts[k] for k in ("prepare_refused", "commits_superseded", "aborts",
                                          "leased_bytes_granted", "committed_bytes",
                                          "staged", "staged_bytes", "refused",
                                          "bad_requests")}}

    def metric_families(self) -> list[Family]:
        """The ``kvtier_shm_*`` families of ``/metrics``."""
        return shm_families(self.metric_stats())

    async def _stats_handler(self, request: web.Request) -> web.Response:
        return self._answer(self.stats())

    async def _contains(self, request: web.Request) -> web.Response:
        keys = p.parse_keys(await self._body(request))
        return self._answer({"present": await self.store.contains_many(keys)})

    async def _lookup(self, request: web.Request) -> web.Response:
        keys = p.parse_keys(await self._body(request))
        return self._answer({"hit": await self.store.lookup_prefix(keys)})

    async def _lease(self, request: web.Request) -> web.Response:
        msg = await self._body(request)
        keys = p.parse_keys(msg)
        pid = request["pid"]
        if self._late(msg) or not self._watch(pid):
            return self._answer({"instance": self.shared.instance, "slots": [None] * len(keys)})
        blocks = await self.store.get_many(keys)
        granted = []
        slots: list[dict[str, Any] | None] = []
        for key, block in zip(keys, blocks, strict=True):
            held = None if block is None else self._in_arena(block)
            if held is None:
                slots.append(None)
                continue
            offset = self.arena.offset_of(held)
            if offset is None:  # not reached: _in_arena returns arena memory only
                slots.append(None)
                continue
            lease = self.leases.grant_read(pid, key, held, offset)
            granted.append(lease.id)
            self.counts["leased_bytes_granted"] += held.nbytes
            slots.append({"lease": lease.id, "key": key.hex(), "offset": offset,
                          "nbytes": held.nbytes, "dtype": p.describe(held.dtype),
                          "shape": list(held.shape)})
        if request.transport is None or request.transport.is_closing():
            self.leases.release(pid, granted)  # the engine gave up waiting: lend nothing
        self.counts["leased"] += len(granted)
        self._schedule_expiry()
        return self._answer({"instance": self.shared.instance, "slots": slots})

    def _in_arena(self, block: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
        """``block`` where an engine can read it: itself when it lies in the arena, else a
        copy in a staging slot (a heap block: an arena overflow), or ``None`` without one."""
        if self.arena.offset_of(block) is not None:
            return block
        raw = self.arena.allocate(block.nbytes)
        if raw is None:
            return None
        staged = np.ndarray(block.shape, block.dtype, raw)
        np.copyto(staged, block, casting="no")
        self.counts["staged"] += 1
        self.counts["staged_bytes"] += block.nbytes
        return staged

    async def _release(self, request: web.Request) -> web.Response:
        ids = p.parse_ids(await self._body(request))
        return self._answer({"valid": self.leases.release(request["pid"], ids)})

    async def _prepare(self, request: web.Request) -> web.Response:
        msg = await self._body(request)
        entries = msg.get("blocks")
        if not isinstance(entries, list) or len(entries) > p.MAX_KEYS:
            raise ProtocolError(f"blocks: expected a list of at most {p.MAX_KEYS}")
        specs = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ProtocolError(f"blocks[{i}]: expected an object")
            key = p.parse_keys({"keys": [entry.get("key")]})[0]
            dtype, shape = p.parse_dtype(entry.get("dtype")), p.parse_shape(entry.get("shape"))
            specs.append((key, dtype, shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize))
        pid = request["pid"]
        capacity = self.tier.capacity or 0
        slots: list[dict[str, Any] | None] = [None] * len(specs)
        if not self._late(msg) and self._watch(pid):
            fits = [i for i, spec in enumerate(specs) if spec[3] <= capacity]
            short = self._grant_writes(pid, specs, fits, slots)
            if short:
                # The arena's spare room is short of the save: evict now what its commit
                # would evict anyway, so the save is one prepare and one commit, not rounds
                # of them (two calls each, ~60 ms apiece on a loaded host).
                need = sum(specs[i][3] for i in short)
                if await self.tier.evict_ahead(min(need, capacity)):
                    short = self._grant_writes(pid, specs, short, slots)
            self.counts["prepare_refused"] += len(specs) - len(fits) + len(short)
            if request.transport is None or request.transport.is_closing():
                for taken in self.leases.take_writes(pid, [s["lease"] for s in slots if s]):
                    if taken is not None:
                        self.leases.abandon(taken)
                        self.counts["aborts"] += 1
                slots = [None] * len(specs)
        self._schedule_expiry()
        return self._answer({"instance": self.shared.instance, "slots": slots,
                             "capacity": capacity})

    def _grant_writes(self, pid: int, specs: list[tuple[bytes, np.dtype[Any], tuple[int, ...],
                                                     int]],
                      which: list[int], slots: list[dict[str, Any] | None]) -> list[int]:
        """Lend ``pid`` a fresh slot for each of the blocks ``which`` of ``specs`` (into
        ``slots``) while the arena has one; those it had none for."""
        short = []
        for i in which:
            key, dtype, shape, nbytes = specs[i]
            raw = self.arena.allocate(nbytes)
            offset = None if raw is None else self.arena.offset_of(raw)
            if raw is None or offset is None:  # offset: not None, allocate carves the arena
                short.append(i)
                continue
            lease = self.leases.grant_write(pid, key, raw, offset, dtype, shape)
            slots[i] = {"lease": lease.id, "offset": offset, "nbytes": nbytes}
        return short

    async def _commit(self, request: web.Request) -> web.Response:
        msg = await self._body(request)
        ids = p.parse_ids(msg)
        abort = msg.get("abort", False) is True
        taken = self.leases.take_writes(request["pid"], ids)
        items = []
        for lease in taken:
            if lease is None:
                continue
            if abort:
                self.leases.abandon(lease)
                self.counts["aborts"] += 1
            elif self.leases.lands(lease):
                block = np.ndarray(lease.shape, lease.dtype, lease.held)
                block.flags.writeable = False  # the DRAM tier keeps it in its slot, uncopied
                items.append((lease.key, block))
            else:
                self.counts["commits_superseded"] += 1
        error = None
        if items:
            try:
                await self.store.put_many(items)
            except KVTierError as exc:
                error = f"{type(exc).__name__}: {exc}"
        self.counts["committed"] += len(items)
        self.counts["committed_bytes"] += sum(block.nbytes for _, block in items)
        return self._answer({"committed": [lease is not None for lease in taken],
                             "error": error})

    async def _delete(self, request: web.Request) -> web.Response:
        keys = p.parse_keys(await self._body(request))
        for key in keys:
            self.leases.note_delete(key)
        return self._answer({"deleted": await self.store.delete_many(keys)})

    async def _touch(self, request: web.Request) -> web.Response:
        keys = p.parse_keys(await self._body(request))
        await self.tier.touch_chain(keys)
        return self._answer({})

    async def _pin(self, request: web.Request) -> web.Response:
        keys = p.parse_keys(await self._body(request))
        pid = request["pid"]
        if not self._watch(pid):
            return self._answer({})
        await self.store.pin(keys, tier=0)
        self._pins.setdefault(pid, Counter()).update(keys)
        return self._answer({})

    async def _unpin(self, request: web.Request) -> web.Response:
        keys = p.parse_keys(await self._body(request))
        pins = self._pins.get(request["pid"], Counter())
        held = [k for k in keys if pins[k] > 0]  # only this process's own pins
        pins.subtract(held)
        if held:
            await self.store.unpin(held, tier=0)
        return self._answer({})
