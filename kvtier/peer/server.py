"""``PeerServer``: serves this node's segment (a TieredStore or a single tier) to the pool.

HTTP/1.1 under ``/v1`` with binary bodies; the routes, limits and status codes are documented
in docs/peer-protocol.md. Every request is authenticated with a bearer token (constant-time
compare) unless the server is explicitly started without auth. Client input never causes a
5xx: bad keys, frames and bodies are 400, oversized ones 413, and nothing is stored unless the
whole request is valid.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence, Set
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
from aiohttp import web

from kvtier.codec import FLAG_ZSTD, decode_frame, parse_header
from kvtier.errors import BlockTooLargeError, ConfigError, CorruptBlockError
from kvtier.keys import key_from_hex
from kvtier.peer import protocol as proto
from kvtier.peer.answers import BatchAnswer, batch_get_answer, failure_of
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.dataplane import RECV_SCRATCH, DataPlaneProtocol
from kvtier.peer.directory import (
    ADDED_QUERY,
    AGE_QUERY,
    DIR_LOOKUP_PATH,
    DIR_UPDATE_PATH,
    MAX_MEMBER_BYTES,
    SUPERSEDED_QUERY,
    Directory,
    decode_superseded,
    decode_update,
    encode_holders,
    frame_digest,
    parse_age,
)
from kvtier.peer.guards import (
    AcceptErrorFilter,
    BodyBudget,
    RefuseProtocol,
    connection_limit,
    raise_open_files_limit,
)
from kvtier.peer.headercache import FrameHeaders
from kvtier.peer.holder import spare_copies
from kvtier.peer.locate import LOCATE_PATH, make_locate_handler, segment_answer
from kvtier.peer.metrics import (
    Family,
    local_families,
    render,
    repair_families,
    segment_families,
)
from kvtier.peer.versions import STAMP_HEADER, Versions, parse_stamps
from kvtier.peer.writeorder import WriteOrder

if TYPE_CHECKING:
    from kvtier.peer.holder import LocalHolder

__all__ = ["PeerServer", "Segment"]

log = logging.getLogger("kvtier.peer.server")
Block = npt.NDArray[np.generic]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Decompressing anything, or checksumming a payload larger than this, inline would stall
# other requests (a 1 MiB checksum takes ~0.1 ms, less than the hop to a worker thread).
_INLINE_DECODE_BYTES = 1 << 20
# Answer payloads go out in writes of at most this size (see PeerServer._send).
_WRITE_SLICE = 1 << 20
# The setting a block PUT body is bounded by (a frame: the block plus its header).
_MAX_FRAME_NAME = "max_block_bytes plus the frame header, kvtier serve --max-block-bytes"
# ... and a key-list body (batch get, exists, delete, locate).
_KEY_LIST_NAME = "max_batch keys, kvtier serve --max-batch, within --max-body"
# Request metrics are keyed by method: any other method a client invents counts as OTHER
# (the key is taken before auth, so it must not grow with what strangers send).
_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE"})
# A body must arrive at min_body_rate on average, measured from this many seconds after its
# head (a connection's first round trips and TCP slow start are not held against it).
BODY_RATE_GRACE = 1.0


class Segment(Protocol):
    """What the server needs from the store it exposes (TieredStore and Tier both fit)."""

    async def get(self, key: bytes) -> Block | None: ...
    async def put(self, key: bytes, value: object) -> None: ...
    async def delete(self, key: bytes) -> bool: ...
    async def get_many(self, keys: Sequence[bytes]) -> list[Block | None]: ...
    async def put_many(self, items: Iterable[tuple[bytes, object]]) -> object: ...  # result unused
    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...
    async def aclose(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...


def _tier_stats(segment: Segment) -> list[dict[str, Any]]:
    stats = segment.stats()
    tiers = stats.get("tiers")
    return list(tiers) if isinstance(tiers, list) else [stats]


class PeerServer:
    """An aiohttp server exposing ``segment`` to peers.

    Parameters
    ----------
    segment
        The local store (``TieredStore``) or tier whose blocks this node serves.
    token
        Bearer token every request must carry; ``None`` requires ``insecure_no_auth=True``.
    host, port
        Bind address (loopback by default; port 0 picks a free port, see :attr:`address`).
    node_id
        This node's member id, reported by ``/v1/health``.
    limits
        Block, batch and body limits (:class:`kvtier.peer.protocol.Limits`).
    ssl_context
        Server-side TLS context (set ``verify_mode=CERT_REQUIRED`` for mutual TLS).
    insecure_no_auth
        Serve without a token (only for trusted test networks).
    close_segment
        Whether :meth:`stop` also closes ``segment`` (flushing write-back queues).
    max_inflight_bytes
        Bytes of request bodies and batch answers held at once, server-wide (at least the
        largest body); a request past it is refused with ``503`` and ``Retry-After``
        before anything is allocated.
    repair_reserve_bytes
        The share of ``max_inflight_bytes`` only repair writes (``?fill=1`` puts: read
        repair, hinted handoff, anti-entropy) may take, so they are admitted while client
        requests get ``503``. Default: an eighth of the budget, less where a client body
        of ``max_body_bytes`` would not fit beside it; at most ``max_inflight_bytes -
        max_body_bytes``.
    idle_timeout
        Seconds a connection may sit idle, or take to send a request head, before it is
        closed.
    body_timeout
        Seconds a request body may go without a byte arriving before it is refused (408).
    min_body_rate
        Bytes per second a request body must arrive at on average, from
        ``BODY_RATE_GRACE`` (1 s) after its head; a slower body is refused with ``408``, so
        a client dripping its body cannot hold the in-flight budget. ``0`` turns the floor
        off (``body_timeout`` still bounds the gap between bytes).
    max_connections
        Open connections served at once; more are answered ``503`` and closed. Clamped at
        :meth:`start` to the open-files limit less a reserve (see
        :func:`~kvtier.peer.guards.connection_limit`), so that past the cap a connection is
        still accepted and answered ``503`` instead of reset.
    data_plane
        Serve block GET/HEAD/PUT and batch get with :class:`~kvtier.peer.dataplane.
        DataPlaneProtocol` (every other request, and every refusal, is aiohttp's either
        way); ``False`` serves everything through aiohttp.
    versions
        The stamps and tombstones of the blocks served (:class:`~kvtier.peer.versions.
        Versions`; default: in memory only). Give one with a ``path`` to keep them across
        restarts of a persistent segment.
    body_reserve
        Bytes of PUT body buffers faulted in at :meth:`start` and kept, as two buffers of
        half the size (default 0: buffers are mapped on demand and dropped after an idle
        period). A body that fits one lands in memory already mapped; a fresh 16 MiB buffer
        cost 15-60 ms of page faults on the benchmark VM, on a core the client's engine
        shares when both run on one host.

    Notes
    -----
    :meth:`start` raises the process's soft open-files limit to the hard limit and
    rate-limits the event loop's accept-error log (both process-wide).
    """

    def __init__(self, segment: Segment, *, token: str | None, host: str = "127.0.0.1",
                 port: int = 0, node_id: str | None = None, limits: proto.Limits | None = None,
                 ssl_context: ssl.SSLContext | None = None, insecure_no_auth: bool = False,
                 close_segment: bool = False, max_inflight_bytes: int = 1 << 30,
                 repair_reserve_bytes: int | None = None,
                 idle_timeout: float = 15.0, body_timeout: float = 10.0,
                 min_body_rate: float = 256 << 10, max_connections: int = 4096,
                 data_plane: bool = True, body_reserve: int = 0,
                 versions: Versions | None = None) -> None:
        if token is None and not insecure_no_auth:
            raise ConfigError("token: a bearer token is required (or pass insecure_no_auth=True)")
        if token is not None and not token:
            raise ConfigError("token: must not be empty")
        self.segment = segment
        self.limits = limits or proto.Limits()
        if not idle_timeout > 0 or not body_timeout > 0:
            raise ConfigError("idle_timeout, body_timeout: expected > 0 seconds")
        if not min_body_rate >= 0 or min_body_rate == float("inf"):
            raise ConfigError(f"min_body_rate: expected >= 0 bytes/s, got {min_body_rate!r}")
        if max_connections < 1:
            raise ConfigError(f"max_connections: expected >= 1, got {max_connections!r}")
        if body_reserve < 0:
            raise ConfigError(f"body_reserve: expected >= 0 bytes, got {body_reserve!r}")
        self.body_reserve = body_reserve
        if max_inflight_bytes < self.limits.max_body_bytes:
            raise ConfigError(f"max_inflight_bytes: expected >= max_body_bytes "
                              f"({self.limits.max_body_bytes}), got {max_inflight_bytes!r}")
        client_room = max_inflight_bytes - self.limits.max_body_bytes
        if repair_reserve_bytes is None:
            repair_reserve_bytes = min(max_inflight_bytes // 8, client_room)
        if not 0 <= repair_reserve_bytes <= client_room:
            raise ConfigError(f"repair_reserve_bytes: expected 0 to max_inflight_bytes less "
                              f"max_body_bytes ({client_room}), got {repair_reserve_bytes!r}")
        self.budget = BodyBudget(max_inflight_bytes, repair_reserve_bytes)
        self._reserved: dict[int, int] = {}  # budget bytes held, by id(request)
        self.idle_timeout = idle_timeout
        self.body_timeout = body_timeout
        self.min_body_rate = min_body_rate
        self.max_connections = max_connections
        self.connection_limit = max_connections  # clamped by start()
        self.host, self.port = host, port
        self.node_id = node_id
        self.auth_header = None if token is None else f"Bearer {token}".encode()
        self.data_plane = data_plane
        self.dataplane_connections: set[DataPlaneProtocol] = set()
        self._bodies = BodyBuffers(budget=64 << 20)  # PUT bodies (data plane and batch PUT)
        self._scratch = memoryview(bytearray(RECV_SCRATCH))  # every data-plane read of a head
        self._ssl = ssl_context
        self._close_segment = close_segment
        self._runner: web.AppRunner | None = None
        #: Set once :meth:`stop` began: connections made from then on are refused.
        self.stopping = False
        self._listener: asyncio.Server | None = None
        self._started = time.monotonic()
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.corrupt_frames = 0
        self.client_gone = 0
        self.puts_abandoned = 0  # stored, but the client had given up before the answer
        self.body_timeouts = 0
        self.connections_refused = 0
        self.batch_truncated = 0
        self.handoffs = 0  # data-plane connections handed to aiohttp
        # The keys stored through this server (an insertion-ordered set; only when tracked).
        self.stored_keys: dict[bytes, None] = {}
        self._track_keys = False
        self._write_watches: list[set[bytes]] = []  # see watch_writes
        #: The holder entries this member keeps as a directory owner (placement=local).
        self.directory = Directory()
        #: This member's side of placement=local (set by LocalHolder.attach), else None.
        self.holder: LocalHolder | None = None
        #: The anti-entropy counters of this node (set by :class:`kvtier.peer.repair.AntiEntropy`),
        #: exposed in ``/metrics`` as ``kvtier_peer_repair_*``.
        self.repair_stats: Callable[[], dict[str, Any]] | None = None
        #: The host daemon's ``kvtier_shm_*`` families (set while ``kvtier serve --shm``
        #: serves engines: :meth:`kvtier.shm.server.LocalServer.metric_families`).
        self.shm_families: Callable[[], list[Family]] | None = None
        self._accept_filter: AcceptErrorFilter | None = None
        self.frames = FrameHeaders()  # answers of unchanged blocks skip the checksum pass
        self.write_order = WriteOrder()  # a PUT its client gave up on never lands late
        #: Block stamps and tombstones: a write lands only if newer (kvtier.peer.versions).
        self.versions = versions or Versions()
        #: Whether a tombstone's grace period starts when it is written: no anti-entropy
        #: will tell this server that the other owners hold it (AntiEntropy clears it).
        self.settle_tombstones = True
        self.app = self._build_app()

    # ----------------------------------------------------------------- lifecycle
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              middlewares=[self._metrics_mw, self._guard_mw, self._auth_mw])
        app.router.add_get(proto.BLOCK_PATH, self._get_block)
        app.router.add_put(proto.BLOCK_PATH, self._put_block)
        app.router.add_delete(proto.BLOCK_PATH, self._delete_block)
        app.router.add_post(proto.BATCH_GET_PATH, self._batch_get)
        app.router.add_post(proto.BATCH_PUT_PATH, self._batch_put)
        app.router.add_post(proto.BATCH_EXISTS_PATH, self._batch_exists)
        app.router.add_post(proto.BATCH_DELETE_PATH, self._batch_delete)
        app.router.add_post(proto.BATCH_STAMPS_PATH, self._batch_stamps)
        app.router.add_post(DIR_LOOKUP_PATH, self._dir_lookup)
        app.router.add_post(DIR_UPDATE_PATH, self._dir_update)
        app.router.add_get(proto.HEALTH_PATH, self._health)
        app.router.add_get(proto.METRICS_PATH, self._metrics)
        app.router.add_post(LOCATE_PATH, make_locate_handler(segment_answer(self.segment), node=lambda: self.node_id or "", limits=self.limits, read_body=self._read_body))  # noqa: E501
        return app

    async def start(self) -> tuple[str, int]:
        """Bind and start serving; returns the bound ``(host, port)``."""
        if self._runner is not None:
            raise RuntimeError("PeerServer already started")
        self.stopping = False
        soft, _ = raise_open_files_limit()
        self.connection_limit = connection_limit(self.max_connections, soft)
        if self.body_reserve and not self._bodies.reserved_bytes:
            await self._bodies.reserve(self.body_reserve // 2, 2)
        self._accept_filter = AcceptErrorFilter.install()
        # A refused body is drained for at most 1 s (not aiohttp's 10 s) before closing.
        # keepalive_timeout also bounds the time to receive a request head: aiohttp's timer
        # runs from the end of the last answer (or the accept) until a full head arrived.
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                               shutdown_timeout=10.0, lingering_time=1.0,
                               keepalive_timeout=self.idle_timeout)
        await runner.setup()
        # Our own listener instead of a TCPSite: its protocol factory enforces the
        # connection cap before aiohttp builds a handler.
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._protocol, self.host, self.port, ssl=self._ssl, backlog=512,
                reuse_address=True)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._started = time.monotonic()
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.host, self.port = str(host), int(port)
        if self.node_id is None:
            self.node_id = self.member_id
        return self.host, self.port

    @property
    def member_id(self) -> str:
        """``host:port`` as peers name this node (IPv6 hosts in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"{'https' if self._ssl else 'http'}://{self.member_id}"

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server if self._runner is not None else None
        if server is None or self.stopping or self._open_connections() >= self.connection_limit:
            self.connections_refused += 1
            return RefuseProtocol()
        if self.data_plane:
            return DataPlaneProtocol(self, server, self._bodies, self._scratch)
        return server()

    def track_keys(self) -> None:
        """Record the keys stored through this server in :attr:`stored_keys` (for the
        anti-entropy pass, which prunes what the segment no longer holds)."""
        self._track_keys = True

    def stored(self, keys: Iterable[bytes]) -> None:
        """Note keys stored through this server (kept only after :meth:`track_keys`). Every
        write calls this right after its write-order turn ends, before any other task runs."""
        if not self._track_keys and not self._write_watches:
            return
        keys = tuple(keys)
        if self._track_keys:
            for key in keys:
                self.stored_keys[key] = None
        for watch in self._write_watches:
            watch.update(keys)

    @contextlib.contextmanager
    def watch_writes(self) -> Iterator[set[bytes]]:
        """A set that collects every key stored through this server while the block runs
        (what :meth:`drop_copies` must keep)."""
        watch: set[bytes] = set()
        self._write_watches.append(watch)
        try:
            yield watch
        finally:
            # By identity: list.remove compares sets by value, and would take another
            # watch holding the same keys (two empty ones are equal).
            self._write_watches[:] = [w for w in self._write_watches if w is not watch]

    async def drop_copies(self, keys: Sequence[bytes], keep: Set[bytes]) -> list[bytes]:
        """Delete this node's copies of ``keys``, except those in ``keep`` (a
        :meth:`watch_writes` set: keys written since the caller checked them); returns the
        keys dropped. Runs in the keys' write-order turn, so a write that arrived before it
        has either finished (and is in ``keep``) or lands after it."""
        dropped = []
        async with self.write_order.turn(keys):
            for key in keys:
                if key in keep:
                    continue
                self.stored_keys.pop(key, None)
                self.frames.forget(key)
                if await self.segment.delete(key):
                    dropped.append(key)
                    self.versions.forget(key)  # a spare copy, not a delete: no tombstone
            self.versions.flush()
        return dropped

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, then close the segment if owned."""
        # From here on a connection the listener accepted before it closed (its protocol
        # made, or connected, only now) is refused: left open it would serve from the closed
        # segment, and a client's pooled connection would keep reaching this stopped server
        # after a new one took the port.
        self.stopping = True
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        while self.dataplane_connections:
            await asyncio.gather(*(conn.shutdown(10.0)
                                   for conn in list(self.dataplane_connections)))
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._bodies.clear()
        await self.versions.aclose()
        if self._close_segment:
            await self.segment.aclose()

    async def __aenter__(self) -> PeerServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---------------------------------------------------------------- middleware
    @web.middleware
    async def _metrics_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        info = request.match_info.route.resource
        route = info.canonical if info is not None else "unmatched"
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.budget.give(self._reserved.pop(id(request), 0))
            method = request.method if request.method in _METHODS else "OTHER"
            self.requests[(route, method, status)] += 1

    @web.middleware
    async def _guard_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:
            status, text, headers = self.failure(exc, request.method, request.path)
            return web.Response(status=status, text=text, headers=headers)

    def failure(self, exc: Exception, method: str, path: str) -> tuple[int, str, dict[str, str]]:
        """The answer to a request that raised ``exc``: status, text and extra headers
        (counted and, for a server-side failure, logged); the mapping is
        :func:`kvtier.peer.answers.failure_of`, for aiohttp's routes and the data plane's."""
        failure = failure_of(exc, self.body_timeout)
        if failure.kind == "timeout":
            self.body_timeouts += 1
        elif failure.kind == "gone":
            self.client_gone += 1
        elif failure.kind == "server":
            # A bug or a failing segment, never a client error: log it and stay up.
            log.error("peer server: %s %s failed", method, path, exc_info=exc)
        return failure.status, failure.text, {"Connection": "close"} if failure.close else {}

    @web.middleware
    async def _auth_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.auth_header is not None:
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, self.auth_header):
                raise web.HTTPUnauthorized(text="missing or wrong bearer token",
                                           headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # -------------------------------------------------------------------- bodies
    def _reserve(self, request: web.Request, nbytes: int) -> None:
        """Take ``nbytes`` of the in-flight budget for this request (given back when the
        request ends, by the metrics middleware), or refuse it with 503."""
        if not self.budget.try_take(nbytes, repair=_fills(request)):
            raise _error(web.HTTPServiceUnavailable,
                         f"server busy: {self.budget.held} of {self.budget.limit} in-flight "
                         f"body bytes taken; retry", headers={"Retry-After": "1"})
        self._reserved[id(request)] = self._reserved.get(id(request), 0) + nbytes

    async def _read_body(self, request: web.Request, limit: int,
                         limit_name: str = _KEY_LIST_NAME) -> bytes | memoryview:
        """The request body, at most ``limit`` bytes (``limit_name``: the setting behind it,
        named in the 413 so the client's error says which limit to change)."""
        length = request.content_length
        if length is not None and length > limit:
            raise _error(web.HTTPRequestEntityTooLarge,
                         f"body of {length} bytes exceeds {limit} ({limit_name})",
                         max_size=limit, actual_size=length)
        # Reserve before a byte is allocated; a chunked body may grow to the limit.
        self._reserve(request, limit if length is None else length)
        if length is not None:
            return await self._read_exactly(request, length)
        async with asyncio.timeout(self.body_timeout):
            body = await request.read()
        if len(body) > limit:
            raise _error(web.HTTPRequestEntityTooLarge,
                         f"body exceeds {limit} bytes ({limit_name})",
                         max_size=limit, actual_size=len(body))
        self.bytes_in += len(body)
        return body

    async def _read_exactly(self, request: web.Request, length: int) -> memoryview:
        """The body of a request with a ``Content-Length`` (already checked against the limit),
        copied chunk by chunk into one buffer of that size: ``request.read()`` would copy it
        into a growing bytearray and then once more into ``bytes``."""
        # No zero-fill of memory the body overwrites anyway: a pooled buffer (reused once
        # nothing references it, dropped after an idle period) or a reserved warm one.
        body = self._bodies.take(length)
        have = 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            while have < length:
                gap_end = loop.time() + self.body_timeout
                rate_end = self.body_rate_deadline(started, have, length)
                try:
                    async with asyncio.timeout_at(min(gap_end, rate_end)):
                        chunk, _ = await request.content.readchunk()
                except TimeoutError:
                    raise self.body_timeout_error(rate_end < gap_end) from None
                if not chunk:
                    break
                end = have + len(chunk)
                if end > length:  # the HTTP parser stops at Content-Length; never trust it
                    raise proto.ProtocolError(f"body: longer than its Content-Length {length}")
                body[have:end] = chunk
                have = end
        except BaseException:
            # The exception's traceback holds this frame, and aiohttp keeps the exception
            # on the request's stream, which the frame references: a cycle that would pin
            # the whole buffer until a full GC. Drop the buffer before it forms.
            del body
            raise
        if have != length:
            del body
            raise ConnectionResetError(f"body: {have} of {length} bytes before end of stream")
        self.bytes_in += length
        return body

    def body_rate_deadline(self, started: float, have: int, length: int) -> float:
        """The loop time by which a body of ``length`` bytes that started arriving at
        ``started`` and holds ``have`` bytes must hold more: it keeps, on average from
        ``BODY_RATE_GRACE`` seconds after its head, ``min_body_rate`` or, while the
        in-flight budget is more than half held, its share of the budget's bandwidth
        (:meth:`~kvtier.peer.guards.BodyBudget.required_rate`)."""
        rate = self.budget.required_rate(length, self.min_body_rate)
        if not rate:
            return float("inf")
        return started + BODY_RATE_GRACE + have / rate

    def body_timeout_error(self, too_slow: bool) -> TimeoutError:
        """The error a stalled (``too_slow=False``) or too slow body is refused with."""
        if too_slow:
            return TimeoutError(f"body arrived at under min_body_rate "
                                f"{self.min_body_rate:.0f} bytes/s, or under its share of "
                                "the in-flight budget while that was more than half held")
        return TimeoutError(f"no body bytes for {self.body_timeout} s")

    async def decode(self, key: bytes, frame: bytes | memoryview) -> Block:
        """The block in ``frame``, verified under ``key`` (large or compressed frames are
        decoded in a worker thread)."""
        view = memoryview(frame)
        try:
            head = parse_header(view)
        except CorruptBlockError:
            self.corrupt_frames += 1
            raise
        if head.raw_size > self.limits.max_block_bytes:
            raise BlockTooLargeError(f"block of {head.raw_size} bytes exceeds max_block_bytes "
                                     f"{self.limits.max_block_bytes}")
        try:
            if head.flags & FLAG_ZSTD or view.nbytes - head.header_len > _INLINE_DECODE_BYTES:
                return await asyncio.to_thread(decode_frame, view, key=key)
            return decode_frame(view, key=key)
        except CorruptBlockError:
            self.corrupt_frames += 1
            raise

    async def _send(self, request: web.Request, buffers: Sequence[bytes | memoryview],
                    status: int = 200) -> web.StreamResponse:
        # Header and payload go out as separate writes: the payload is never joined/copied.
        total = sum(memoryview(b).nbytes for b in buffers)
        response = web.StreamResponse(status=status, headers={
            "Content-Type": proto.CONTENT_TYPE, proto.VERSION_HEADER: str(proto.VERSION)})
        response.content_length = total
        try:
            await response.prepare(request)
            if request.method != "HEAD":
                for buf in buffers:
                    view = memoryview(buf)
                    # Slices: asyncio copies whatever the socket does not take at once into
                    # its own buffer, so a 64 MiB write would mostly be copied; but every
                    # write also costs a drain (a loop turn), and at 256 KiB slices those
                    # cost more than the copy (server CPU per 1 MiB GET: ~470 us at 256 KiB,
                    # ~390 us in one write, on asyncio and uvloop alike).
                    for off in range(0, view.nbytes, _WRITE_SLICE):
                        await response.write(view[off : off + _WRITE_SLICE])
                self.bytes_out += total
            await response.write_eof()
        except ConnectionResetError:
            # The client gave up (its deadline passed): nothing to answer, nothing to log.
            self.client_gone += 1
        return response

    # -------------------------------------------------------------------- routes
    async def _get_block(self, request: web.Request) -> web.StreamResponse:
        key = key_from_hex(request.match_info["key"])
        block = await self.segment.get(key)
        if block is None:
            raise web.HTTPNotFound(text="no such block")
        if self.holder is not None:  # placement=local: a read begins its age again
            self.holder.touched((key,))
        frame = self.frames.encode(key, block)  # bound to its key: the client verifies it
        return await self._send(request, frame.buffers)

    async def _put_block(self, request: web.Request) -> web.StreamResponse:
        key = key_from_hex(request.match_info["key"])
        body = await self._read_body(request, self.limits.max_frame_bytes,
                                     _MAX_FRAME_NAME)
        stamps = _stamps(request, 1)
        if self.holder is not None and not _fills(request):  # placement=local: spare
            await self.holder.make_room(len(body))  # copies here go before a needed one
        async with self.write_order.turn((key,)):
            block = await self.decode(key, body)
            del body
            stamp = None if stamps is None else stamps[0]
            with spare_copies(_fills(request)):  # placement=local: spares never displace
                landed = await self.put_stamped(key, block, stamp, _fills(request))
            if not landed:
                return web.Response(status=204)  # the value (or delete) held here is newer
        self.stored((key,))
        await self.versions.commit()  # answered once its stamp is in the log
        if self.holder is not None:
            await self.holder.stored((key,), spare=_fills(request))
        self._note_abandoned(request)
        return web.Response(status=204)

    async def admit(self, items: Sequence[tuple[bytes, int | None]], fill: bool
                    ) -> list[int | None]:
        """The stamp each write of ``(key, stamp or None)`` lands with, or ``None`` where
        what this server holds is newer (see :mod:`kvtier.peer.versions`). A write without
        a stamp is a client's of before stamps (it gets this server's clock) or, with
        ``fill``, a repair that fills holes only: stamp 0, and only where the key has no
        block and no tombstone."""
        versions = self.versions
        out: list[int | None] = []
        check: list[int] = []  # writes that land only if the segment lacks the key
        for i, (key, stamp) in enumerate(items):
            if stamp is None:
                if not fill:
                    out.append(versions.clock.next())
                    continue
                verdict = versions.admits_fill(key)
                stamp = 0
            else:
                verdict = versions.admits(key, stamp)
            out.append(stamp if verdict is not False else None)
            if verdict is None:
                check.append(i)
        if check:
            present = await self.segment.contains_many([items[i][0] for i in check])
            for i, here in zip(check, present, strict=True):
                if here:
                    out[i] = None
        return out

    async def put_stamped(self, key: bytes, block: object, stamp: int | None, fill: bool
                          ) -> bool:
        """Store one block if :meth:`admit` lets it land (call in the key's write-order
        turn); whether it was stored."""
        (landed,) = await self.admit([(key, stamp)], fill)
        if landed is None:
            return False
        await self.segment.put(key, block)
        self.versions.stored(key, landed)
        self.versions.flush()
        return True

    async def delete_stamped(self, key: bytes, stamp: int | None) -> bool:
        """Delete ``key`` and leave its tombstone, unless a newer put stored it (call in
        the key's write-order turn); whether a block was deleted."""
        versions = self.versions
        stamp = versions.clock.next() if stamp is None else stamp
        if versions.stamps.get(key, 0) > stamp:
            return False  # put again after this delete was issued
        found = await self.segment.delete(key)
        versions.deleted(key, stamp, settled=self.settle_tombstones)
        return found

    def _note_abandoned(self, request: web.Request) -> None:
        # Stored anyway (the block is valid), but the client gave up waiting: count it, so a
        # timeout set too low for this server shows up in its metrics.
        if request.transport is None or request.transport.is_closing():
            self.puts_abandoned += 1

    async def _delete_block(self, request: web.Request) -> web.StreamResponse:
        key = key_from_hex(request.match_info["key"])
        stamps = _stamps(request, 1)
        self.stored_keys.pop(key, None)
        self.frames.forget(key)
        async with self.write_order.turn((key,)):
            found = await self.delete_stamped(key, None if stamps is None else stamps[0])
        await self.versions.commit()  # answered once its tombstone is in the log
        if found and self.holder is not None:
            await self.holder.deleted((key,))
        if found:
            return web.Response(status=204)
        raise web.HTTPNotFound(text="no such block")

    def key_list_limit(self) -> int:
        """Most bytes of a key-list body."""
        return min(4 + self.limits.max_batch * (2 + 128), self.limits.max_body_bytes)

    async def _read_keys(self, request: web.Request) -> list[bytes]:
        body = await self._read_body(request, self.key_list_limit(), _KEY_LIST_NAME)
        return proto.decode_keys(body, self.limits.max_batch)

    async def _batch_get(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        answer = await self.batch_get_answer(keys)
        self._reserved[id(request)] = self._reserved.get(id(request), 0) + answer.reserved
        return await self._send(request, answer.buffers)

    async def batch_get_answer(self, keys: Sequence[bytes]) -> BatchAnswer:
        """The batch get answer for ``keys`` (:func:`kvtier.peer.answers.batch_get_answer`);
        the caller gives its ``reserved`` budget bytes back once the answer is sent."""
        answer = await batch_get_answer(self.segment.get_many, self.frames, keys, self.limits,
                                        self.budget)
        self.batch_truncated += answer.truncated
        if self.holder is not None:  # placement=local: a read begins its age again
            self.holder.touched(keys)
        return answer

    async def _batch_put(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request, self.limits.max_body_bytes,
                                     "max_body_bytes, kvtier serve --max-body")
        entries = proto.decode_blocks(body, self.limits.max_batch, self.limits.max_frame_bytes)
        stamps = _stamps(request, len(entries))
        age = parse_age(request.query.get(AGE_QUERY))  # a forwarded last copy's age
        # placement=local: a fill without an age (a read's copy home, a repair push) is a
        # spare copy, which never displaces a last copy; spare copies here go before a
        # needed one.
        spare = _fills(request) and age is None
        if self.holder is not None and not spare:
            await self.holder.make_room(len(body))
        async with self.write_order.turn(k for k, _ in entries):
            # Every frame is verified before anything is stored: a bad batch changes nothing.
            decoded: list[tuple[bytes, object]] = []
            for key, frame in entries:
                if frame is None:
                    raise proto.ProtocolError(f"body: block {key.hex()} has an empty frame")
                decoded.append((key, await self.decode(key, frame)))
            del body, entries
            if self.holder is not None and age is not None:
                self.holder.refuse_forwards([k for k, _ in decoded])
            # A write lands only where it is newer than what is held here.
            landed = await self.admit([(k, None if stamps is None else stamps[i])
                                       for i, (k, _) in enumerate(decoded)], _fills(request))
            decoded = [item for item, stamp in zip(decoded, landed, strict=True)
                       if stamp is not None]
            if decoded:
                with spare_copies(spare):
                    await self.segment.put_many(decoded)
                for (key, _), stamp in zip(decoded, (s for s in landed if s is not None),
                                           strict=True):
                    self.versions.stored(key, stamp)
        if decoded:
            self.stored(k for k, _ in decoded)
            await self.versions.commit()
            if self.holder is not None:
                await self.holder.stored([k for k, _ in decoded], age, spare)
            self._note_abandoned(request)
        return web.Response(status=204)

    async def _batch_exists(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        flags = await self.segment.contains_many(keys) if keys else []
        return await self._send(request, [proto.encode_flags(flags)])

    async def _batch_delete(self, request: web.Request) -> web.StreamResponse:
        if request.query.get(SUPERSEDED_QUERY.partition("=")[0]) is not None:
            return await self._drop_superseded(request)
        keys = await self._read_keys(request)
        stamps = _stamps(request, len(keys))
        for key in keys:
            self.stored_keys.pop(key, None)
            self.frames.forget(key)
        async with self.write_order.turn(keys):
            flags = [await self.delete_stamped(k, None if stamps is None else stamps[i])
                     for i, k in enumerate(keys)]
        await self.versions.commit()
        if self.holder is not None and any(flags):
            await self.holder.deleted([k for k, f in zip(keys, flags, strict=True) if f])
        return await self._send(request, [proto.encode_flags(flags)])

    async def _drop_superseded(self, request: web.Request) -> web.StreamResponse:
        """placement=local: drop the copies older than a client's write that landed on
        another member, where their content differs (``?superseded=1``, see
        :meth:`kvtier.peer.client.PeerClient.drop_superseded`)."""
        body = await self._read_body(request, self.key_list_limit() + 8 * self.limits.max_batch,
                                     _KEY_LIST_NAME)
        keys, digests = decode_superseded(body, self.limits.max_batch)
        stamps = _stamps(request, len(keys))
        if stamps is None:
            raise proto.ProtocolError(f"{SUPERSEDED_QUERY}: needs the stamps of the newer write")
        async with self.write_order.turn(keys):
            flags = [await self._drop_older(k, s, d)
                     for k, s, d in zip(keys, stamps, digests, strict=True)]
            self.versions.flush()
        if self.holder is not None and any(flags):
            await self.holder.deleted([k for k, f in zip(keys, flags, strict=True) if f])
        return await self._send(request, [proto.encode_flags(flags)])

    async def _drop_older(self, key: bytes, stamp: int, digest: int) -> bool:
        """Drop this server's copy of ``key`` if it is older than ``stamp`` and its content
        differs from ``digest`` (an equal block is a copy of the newer write: it stays); no
        tombstone, the key lives on elsewhere. Whether it was dropped (call in its turn)."""
        if self.versions.stamps.get(key, 0) > stamp:
            return False
        block = await self.segment.get(key)
        if block is None or frame_digest(self.frames.encode(key, block).header) == digest:
            return False
        self.frames.forget(key)
        if not await self.segment.delete(key):
            return False
        self.stored_keys.pop(key, None)
        self.versions.forget(key)
        return True

    async def _batch_stamps(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        return await self._send(request, [proto.encode_stamps(await self.stamps_of(keys))])

    async def stamps_of(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """``(kind, stamp)`` of each key (:meth:`kvtier.peer.versions.Versions.state`)."""
        present = await self.segment.contains_many(keys) if keys else []
        return [self.versions.state(k, p) for k, p in zip(keys, present, strict=True)]

    async def _dir_lookup(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        return await self._send(request, [encode_holders(self.directory.lookup(keys))])

    async def _dir_update(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request, 2 + MAX_MEMBER_BYTES + 2 * self.key_list_limit())
        holder, add, remove = decode_update(body, self.limits.max_batch)
        left = self.directory.update(holder, add, remove)
        if request.query.get(ADDED_QUERY.partition("=")[0]) is not None:
            left = self.directory.lookup(add) + left  # the holders of each added key first
        return await self._send(request, [encode_holders(left)])

    def health(self) -> dict[str, Any]:
        """The ``/v1/health`` document."""
        from kvtier import __version__

        tiers = _tier_stats(self.segment)
        caps = [t.get("capacity") for t in tiers]
        capacity = None if any(c is None for c in caps) else sum(int(c or 0) for c in caps)
        return {
            "status": "ok",
            "node_id": self.node_id,
            "version": __version__,
            "protocol": proto.VERSION,
            "capacity": capacity,
            "used": sum(int(t.get("used") or 0) for t in tiers),
            "blocks": sum(int(t.get("blocks") or 0) for t in tiers),
            "uptime_s": round(time.monotonic() - self._started, 3),
            "tiers": [{k: t.get(k) for k in ("scheme", "name", "capacity", "used", "blocks")}
                      for t in tiers],
            "limits": {"max_block_bytes": self.limits.max_block_bytes,
                       "max_batch": self.limits.max_batch,
                       "max_body_bytes": self.limits.max_body_bytes},
            **({} if self.holder is None else {"evict_age": self.holder.evict_age()}),
        }

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.health())

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body, content_type = render(self.metric_families())
        return web.Response(body=body, headers={"Content-Type": content_type})

    def metrics_text(self) -> str:
        """The ``/metrics`` exposition (Prometheus text format)."""
        return render(self.metric_families())[0].decode()

    def metric_families(self) -> list[Family]:
        """Request counters, server resource counters and the segment's statistics."""
        requests = Family("kvtier_peer_requests", "counter",
                          "Requests served, by route, method, status.",
                          ("route", "method", "status"))
        for (route, method, status), n in sorted(self.requests.items()):
            requests.add(n, route, method, str(status))
        out = [requests]
        accept_suppressed = self._accept_filter.total_suppressed if self._accept_filter else 0
        for name, kind, value, text in (
            ("kvtier_peer_received_bytes", "counter", self.bytes_in, "Body bytes read."),
            ("kvtier_peer_sent_bytes", "counter", self.bytes_out, "Body bytes sent."),
            ("kvtier_peer_corrupt_frames", "counter", self.corrupt_frames,
             "Frames refused for a bad header or checksum."),
            ("kvtier_peer_client_gone", "counter", self.client_gone,
             "Responses not delivered because the client had disconnected."),
            ("kvtier_peer_puts_abandoned", "counter", self.puts_abandoned,
             "Puts stored after their client had given up (timed out or disconnected)."),
            ("kvtier_peer_body_timeouts", "counter", self.body_timeouts,
             "Requests refused because their body stalled."),
            ("kvtier_peer_busy_refusals", "counter", self.budget.refused,
             "Requests refused with 503 because the in-flight body budget was taken."),
            ("kvtier_peer_reserve_admissions", "counter",
             self.budget.reserve_admissions,
             "Repair writes (?fill=1) admitted into the in-flight budget's repair reserve."),
            ("kvtier_peer_connections_refused", "counter", self.connections_refused,
             "Connections refused at the connection cap."),
            ("kvtier_peer_batch_truncated", "counter", self.batch_truncated,
             "Batch get answers cut short at the body limit or the in-flight budget."),
            ("kvtier_peer_dataplane_handoffs", "counter", self.handoffs,
             "Connections the data plane handed to aiohttp (a request it does not serve)."),
            ("kvtier_peer_accept_errors_suppressed", "counter", accept_suppressed,
             "Accept-error log records suppressed by the rate limit (process-wide)."),
            ("kvtier_peer_inflight_bytes", "gauge", self.budget.held,
             "Body and answer bytes held by requests in flight."),
            ("kvtier_peer_connections", "gauge", self._open_connections(),
             "Open client connections."),
            ("kvtier_peer_uptime_seconds", "gauge", round(time.monotonic() - self._started, 3),
             "Seconds since start."),
        ):
            family = Family(name, kind, text)  # type: ignore[arg-type]
            family.add(value)
            out.append(family)
        shm = [] if self.shm_families is None else self.shm_families()
        return out + repair_families(self.repair_stats) + local_families(
            None if self.holder is None else self.holder.stats) + shm + \
            segment_families(self.segment.stats())

    def _open_connections(self) -> int:
        server = self._runner.server if self._runner is not None else None
        aiohttp_connections = 0 if server is None else len(server.connections)
        return aiohttp_connections + len(self.dataplane_connections)


def _fills(request: web.Request) -> bool:
    """Whether a PUT only fills holes (``?fill=1``, see :data:`protocol.FILL_QUERY`): a repair
    write. The data plane hands any request with a query to
    aiohttp, so only these routes see it."""
    name, _, value = proto.FILL_QUERY.partition("=")
    writes = request.method == "PUT" or request.path == proto.BATCH_PUT_PATH
    return writes and request.query.get(name) == value


def _stamps(request: web.Request, count: int) -> list[int] | None:
    """The write's stamps (:data:`~kvtier.peer.versions.STAMP_HEADER`), one per entry;
    ``None`` without the header. A malformed one is a ProtocolError (400)."""
    try:
        return parse_stamps(request.headers.get(STAMP_HEADER), count)
    except ValueError as exc:
        raise proto.ProtocolError(str(exc)) from None


def _error(cls: type[web.HTTPException], text: str, **kwargs: Any) -> web.HTTPException:
    return cls(text=text, **kwargs)

