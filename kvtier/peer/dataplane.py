"""The data plane: block GET, HEAD and PUT and batch get served straight off the socket.

aiohttp's per-request machinery (request and response objects, routing, three middlewares,
a handler task) costs ~80-100 us a request, a quarter of the server's CPU for a 1 MiB GET
(profiled in docs/performance.md, "Peer GETs"). :class:`DataPlaneProtocol` is what a
:class:`~kvtier.peer.server.PeerServer` connection starts as. It parses each request head
with ``httptools`` (llhttp, a maintained parser) and serves the hot requests itself: the
answer goes out as its header and the stored block's own buffer, and a PUT body is received
by the kernel straight into the buffer the frame is decoded from.

Everything else is aiohttp's: a request that is not a plain, authorized HTTP/1.1 block or
batch-get request (another route, a query string, ``Transfer-Encoding``, ``Expect``,
``Upgrade``, ``Connection: close``, HTTP/1.0, a repeated framing header, a missing or
repeated ``Host``, more than 32 header lines, a head that does not parse or passes 8 KiB, a
body over its limit or past the in-flight budget) makes this
protocol hand the connection to aiohttp's handler at that request's first byte, and the
connection stays there. Requests are served one at a time, so that point is always a
request boundary. So every refusal (401, 413, 503 busy, 400 for a bad key) and every other
route keeps one implementation, aiohttp's; what the data plane answers itself are outcomes
of serving (200, 204, 404, and the failure statuses of
:meth:`~kvtier.peer.server.PeerServer.failure`).

Memory per connection is what its request needs: a connection owns no receive buffer (every
read lands in one scratch buffer per server and is copied out at once, so an idle or
unauthenticated connection costs only the bytes it sent), a PUT body is received into a
pooled buffer (:class:`~kvtier.peer.buffers.BodyBuffers`) and must keep
``min_body_rate`` on average, so a dripping body is refused (408) instead of holding the
in-flight budget.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import httptools
from aiohttp.http_parser import SINGLETON_HEADERS

from kvtier.errors import KVTierError
from kvtier.keys import key_from_hex
from kvtier.peer import protocol as proto
from kvtier.peer.answers import TEXT, answer_head
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.versions import STAMP_HEADER

if TYPE_CHECKING:
    from kvtier.peer.server import PeerServer

__all__ = ["DataPlaneProtocol"]

# Heads the data plane takes: well within aiohttp's limits (8190 bytes a line, 128 header
# lines), so that aiohttp, which gets every other head, alone decides what is too large.
_HEAD_MAX = 8 << 10
_HEADERS_MAX = 32
RECV_SCRATCH = 256 << 10  # per server: every read of a head (or of pipelined requests)
_PENDING_MAX = 1 << 20  # bytes queued behind a request in progress before reading pauses
_BLOCKS_PREFIX = proto.API_PREFIX.encode() + b"/blocks/"
_BATCH_GET = proto.BATCH_GET_PATH.encode()
_STAMP = STAMP_HEADER.lower().encode()
_HEX = frozenset(b"0123456789abcdef")
# Headers that must appear at most once: what aiohttp refuses to see twice (400), and the
# bearer token.
_SINGLE = frozenset(h.encode() for h in SINGLETON_HEADERS) | {b"authorization"}
_VERSION_LINE = f"{proto.VERSION_HEADER}: {proto.VERSION}\r\n".encode()
_WRITE_SLICE = 1 << 20  # see PeerServer._send: a drain per slice, not per 256 KiB
_JOIN_MAX = 64 << 10  # leading buffers up to this many bytes are joined with the head


class _Head:
    """httptools callbacks: the URL and the headers of one request head."""

    __slots__ = ("complete", "count", "headers", "keep_alive", "parser", "repeated", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.count = 0
        self.repeated = False
        self.complete = False
        self.keep_alive = False
        self.parser: httptools.HttpRequestParser | None = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.count += 1
        if name in self.headers and name in _SINGLE:
            self.repeated = True
        self.headers[name] = value

    def on_headers_complete(self) -> None:
        self.complete = True
        # Read now: llhttp resets its connection flags once a message without a body ends.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()


class _Request:
    """A request the data plane serves: which, and the body it carries."""

    __slots__ = ("body", "have", "key", "kind", "method", "reserved", "stamp")

    def __init__(self, kind: str, method: str, key: bytes, length: int,
                 stamp: int | None = None) -> None:
        self.kind, self.method, self.key, self.stamp = kind, method, key, stamp
        self.body: memoryview | None = None
        self.have = 0
        self.reserved = length


class DataPlaneProtocol(asyncio.BufferedProtocol):
    """One connection of a :class:`~kvtier.peer.server.PeerServer`, served here until a
    request needs aiohttp (see the module docstring).

    Parameters
    ----------
    server
        The server whose segment, limits, budget and counters this connection uses.
    fallback
        Makes aiohttp's protocol for this connection (the ``aiohttp.web.Server``).
    bodies
        Reusable PUT body buffers, shared by the server's connections.
    scratch
        The server's receive buffer for heads, shared by its connections: a read lands in it
        and is copied out before the next read (the event loop calls ``get_buffer`` and
        ``buffer_updated`` back to back), so a connection holds only the bytes it sent.
    """

    def __init__(self, server: PeerServer, fallback: Callable[[], asyncio.BaseProtocol],
                 bodies: BodyBuffers, scratch: memoryview) -> None:
        self._server = server
        self._fallback = fallback
        self._bodies = bodies
        self._transport: asyncio.Transport | None = None
        self._scratch = scratch
        self._pending = bytearray()
        self._request: _Request | None = None  # set from its head to the end of its answer
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # None while a request is in progress
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_seen = 0  # bytes of the body at its last progress, and when that was
        self._body_progress = 0.0
        self._body_started = 0.0
        self._drained: asyncio.Future[None] | None = None
        self._reading = True
        self._stopping = False
        self.handed_off = False

    # ------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport's methods without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        if self._server.stopping:  # made before the server began to stop, connected after
            transport.close()
            return
        self._server.dataplane_connections.add(self)
        loop = asyncio.get_running_loop()
        self._idle_since = loop.time()
        self._idle = loop.call_later(self._server.idle_timeout, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.dataplane_connections.discard(self)
        self._cancel_timers()
        request = self._request
        if request is not None and self._task is None:
            # Gone while its body was arriving: nothing was stored, nobody to answer.
            self._server.client_gone += 1
            self._count(request, 499)
            self._finish(request)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("client closed the connection"))
            self._drained.exception()  # retrieved here when no writer waits for it

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        request = self._request
        if request is not None and request.body is not None and self._task is None:
            return request.body[request.have :]  # the kernel writes the body in place
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        request = self._request
        if request is not None and request.body is not None and self._task is None:
            request.have += nbytes
            if request.have == request.body.nbytes:
                self._start(request)
            return
        self._pending += self._scratch[:nbytes]
        if self._request is None:
            self._next()
            if not self._pending:
                self._pending = bytearray()  # what a burst of pipelined heads grew goes
        elif len(self._pending) > _PENDING_MAX and self._transport is not None:
            self._transport.pause_reading()  # a client pipelining far ahead waits
            self._reading = False

    def eof_received(self) -> bool:
        return False  # close: a half-closed client sends no more requests

    # ----------------------------------------------------------------- requests
    def _next(self) -> None:
        """Take the next request out of the pending bytes, if its head is complete."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        pending = self._pending
        if pending and pending[0] in b"\r\n":  # empty lines before a request are ignored
            del pending[: len(pending) - len(pending.lstrip(b"\r\n"))]  # (RFC 9112 2.2)
        if not pending:
            return
        end = pending.find(b"\r\n\r\n", 0, _HEAD_MAX + 1)
        if end < 0:
            if len(pending) > _HEAD_MAX or b"\n\n" in pending:
                self._hand_off()  # aiohttp answers a head it cannot take
            return
        end += 4
        if end > _HEAD_MAX:
            self._hand_off()
            return
        head = _Head()
        parser = head.parser = httptools.HttpRequestParser(head)
        try:
            parser.feed_data(bytes(pending[:end]))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._hand_off()  # aiohttp answers what it cannot parse, or an upgrade
            return
        request = self._route(parser, head)
        if request is None:
            self._hand_off()
            return
        del pending[:end]
        self._idle_since = None
        self._request = request
        if request.reserved == 0:
            self._start(request)
            return
        body = request.body = self._bodies.take(request.reserved)
        request.have = min(len(pending), body.nbytes)
        body[: request.have] = pending[: request.have]
        del pending[: request.have]
        if request.have == body.nbytes:
            self._start(request)
        else:
            now = asyncio.get_running_loop().time()
            self._body_seen, self._body_progress, self._body_started = request.have, now, now
            self._arm_body_check(now)

    def _route(self, parser: httptools.HttpRequestParser, head: _Head) -> _Request | None:
        """The request if the data plane serves it, else ``None`` (aiohttp's then)."""
        headers = head.headers
        if (not head.complete or head.repeated or head.count > _HEADERS_MAX
                or b"host" not in headers or parser.get_http_version() != "1.1"
                or not head.keep_alive or b"transfer-encoding" in headers
                or b"expect" in headers or b"upgrade" in headers):
            return None
        server = self._server
        token = server.auth_header
        if token is not None and not hmac.compare_digest(headers.get(b"authorization", b""),
                                                         token):
            return None
        length_text = headers.get(b"content-length", b"0")
        if not length_text.isdigit() or len(length_text) > 18:
            return None
        length = int(length_text)
        method = parser.get_method().decode("latin-1")
        url = head.url
        if url.startswith(_BLOCKS_PREFIX):
            hexkey = url[len(_BLOCKS_PREFIX):]
            if not hexkey or not _HEX.issuperset(hexkey):
                return None
            try:
                key = key_from_hex(hexkey.decode("ascii"))
            except KVTierError:
                return None
            if method in ("GET", "HEAD") and length == 0:
                return _Request("get", method, key, 0)
            stamp = headers.get(_STAMP)
            if stamp is not None and not (stamp.isdigit() and len(stamp) <= 19):
                return None  # aiohttp's parser names what is wrong with it (400)
            if method == "PUT" and 0 < length <= server.limits.max_frame_bytes \
                    and server.budget.try_take_quietly(length):
                return _Request("put", method, key, length,
                                None if stamp is None else int(stamp))
            return None
        if url == _BATCH_GET and method == "POST" and 0 < length <= server.key_list_limit() \
                and server.budget.try_take_quietly(length):
            return _Request("batch", method, b"", length)
        return None

    def _hand_off(self) -> None:
        """Give the connection to aiohttp from the first byte of the pending request."""
        transport = self._transport
        if transport is None:
            return
        self._cancel_timers()
        self.handed_off = True
        self._server.dataplane_connections.discard(self)
        self._server.handoffs += 1
        handler = cast(asyncio.Protocol, self._fallback())
        data, self._pending = bytes(self._pending), bytearray()
        transport.set_protocol(handler)
        if not self._reading:
            transport.resume_reading()
        handler.connection_made(transport)
        if self._drained is not None and not self._drained.done():
            handler.pause_writing()  # the transport's buffer is still over its high mark
        if data:
            handler.data_received(data)

    def _start(self, request: _Request) -> None:
        self._cancel_body_timer()
        self._task = asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: _Request) -> None:
        server = self._server
        status = 500
        try:
            try:
                if request.kind == "get":
                    status = await self._get(request)
                elif request.kind == "put":
                    status = await self._put(request)
                else:
                    status = await self._batch_get(request)
            except ConnectionResetError:
                raise
            except Exception as exc:
                status, text, headers = server.failure(exc, request.method,
                                                       self._route_of(request))
                if status != 499:  # 499: the client is gone (counted), nobody to answer
                    await self._answer(status, [text.encode()], TEXT,
                                       close=headers.get("Connection") == "close")
        except ConnectionResetError:
            server.client_gone += 1
            status = 499
        finally:
            self._count(request, status)
            self._finish(request)
            self._task = None
            self._after_answer()

    async def _get(self, request: _Request) -> int:
        server = self._server
        head_only = request.method == "HEAD"
        block = await server.segment.get(request.key)
        if block is None:
            await self._answer(404, [b"no such block"], TEXT, head_only=head_only)
            return 404
        if server.holder is not None:  # placement=local: a read begins its age again
            server.holder.touched((request.key,))
        frame = server.frames.encode(request.key, block)  # bound to its key
        del block
        server.bytes_out += await self._answer(200, frame.buffers, proto.CONTENT_TYPE,
                                               head_only=head_only, extra=_VERSION_LINE)
        return 200

    def _take_body(self, request: _Request) -> memoryview:
        """The request's received body, handed over (and counted) once."""
        body, request.body = request.body, None
        if body is None:
            raise RuntimeError(f"a {request.method} is served only once its body arrived")
        self._server.bytes_in += body.nbytes
        return body

    async def _put(self, request: _Request) -> int:
        server = self._server
        body = self._take_body(request)
        if server.holder is not None:  # placement=local: spare copies here go first
            await server.holder.make_room(body.nbytes)
        async with server.write_order.turn((request.key,)):
            block = await server.decode(request.key, body)
            del body
            stored = await server.put_stamped(request.key, block, request.stamp, False)
        if stored:  # else what this server holds is newer (kvtier.peer.versions)
            server.stored((request.key,))
            await server.versions.commit()  # answered once its stamp is in the log
            if server.holder is not None:  # placement=local: registered before the answer
                await server.holder.stored((request.key,))
        transport = self._transport
        if transport is None or transport.is_closing():
            server.puts_abandoned += 1
        await self._answer(204, [], "")
        return 204

    async def _batch_get(self, request: _Request) -> int:
        server = self._server
        body = self._take_body(request)
        keys = proto.decode_keys(body, server.limits.max_batch)
        del body
        answer = await server.batch_get_answer(keys)
        request.reserved += answer.reserved
        server.bytes_out += await self._answer(200, answer.buffers, proto.CONTENT_TYPE,
                                               extra=_VERSION_LINE)
        return 200

    # ------------------------------------------------------------------- answers
    async def _answer(self, status: int, buffers: Sequence[bytes | memoryview],
                      content_type: str, *, head_only: bool = False,
                      close: bool = False, extra: bytes = b"") -> int:
        """Write an answer (``extra``: more header lines); the body bytes sent (0 for
        HEAD, whose answer is the GET's head without its body)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client closed the connection")
        total = sum(memoryview(b).nbytes for b in buffers)
        if close:
            self._stopping = True
        head = answer_head(status, content_type, total, close=close, extra=extra)
        if head_only:
            transport.write(head)
            return 0
        # One send for the head and every buffer up to the first large one (a frame
        # header, or a whole small answer): a send costs more than copying a few KiB.
        views = [memoryview(b).cast("B") for b in buffers]
        small = joined = 0
        while small < len(views) and joined + views[small].nbytes <= _JOIN_MAX:
            joined += views[small].nbytes
            small += 1
        transport.write(b"".join([head, *views[:small]]) if small else head)
        for view in views[small:]:
            for off in range(0, view.nbytes, _WRITE_SLICE):
                if transport.is_closing():  # gone mid-answer: writing on only logs warnings
                    raise ConnectionResetError("client closed the connection")
                transport.write(view[off : off + _WRITE_SLICE])
                if self._drained is not None and not self._drained.done():
                    await self._drain(transport)
        return total

    async def _drain(self, transport: asyncio.Transport) -> None:
        """Wait for the client to take the answer; one that takes no byte of it for
        ``body_timeout`` seconds loses the connection (it holds a task and in-flight budget)."""
        drained = self._drained
        while drained is not None and not drained.done():
            before = transport.get_write_buffer_size()
            try:
                async with asyncio.timeout(self._server.body_timeout):
                    await asyncio.shield(drained)
            except TimeoutError:
                if transport.get_write_buffer_size() >= before:
                    transport.abort()
                    raise ConnectionResetError("client stopped reading its answer") from None
            drained = self._drained

    def _after_answer(self) -> None:
        self._request = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._stopping:
            transport.close()
            return
        if not self._reading:
            transport.resume_reading()
            self._reading = True
        self._idle_since = asyncio.get_running_loop().time()
        self._next()

    def _finish(self, request: _Request) -> None:
        request.body = None
        self._server.budget.give(request.reserved)
        request.reserved = 0

    def _count(self, request: _Request, status: int) -> None:
        self._server.requests[(self._route_of(request), request.method, status)] += 1

    @staticmethod
    def _route_of(request: _Request) -> str:
        # Metric labels: the same as aiohttp's canonical routes.
        return proto.BATCH_GET_PATH if request.kind == "batch" else proto.BLOCK_PATH

    # -------------------------------------------------------------------- timers
    def _idle_check(self) -> None:
        """Close the connection once it has had no complete request head for
        ``idle_timeout`` seconds. One timer per connection that re-arms itself: a timer
        per request cost ~8 us of a 64 KiB GET's ~85 us of server CPU."""
        loop = asyncio.get_running_loop()
        since, timeout = self._idle_since, self._server.idle_timeout
        if since is not None and loop.time() - since >= timeout:
            self._idle = None
            if self._transport is not None:
                self._transport.close()
            return
        self._idle = loop.call_at((loop.time() if since is None else since) + timeout,
                                  self._idle_check)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _arm_body_check(self, now: float) -> None:
        """Check the body again when it would have stalled or fallen below the rate floor."""
        server = self._server
        when = min(self._body_progress + server.body_timeout,
                   server.body_rate_deadline(self._body_started, self._body_seen,
                                             0 if self._request is None
                                             else self._request.reserved))
        self._body_timer = asyncio.get_running_loop().call_at(max(when, now), self._check_body)

    def _check_body(self) -> None:
        """Refuse the body with 408 once ``body_timeout`` passes without a byte of it, or
        once it falls below ``min_body_rate`` on average (a dripping client would otherwise
        hold its in-flight budget for as long as it likes)."""
        self._body_timer = None
        request = self._request
        if request is None or request.body is None or self._task is not None:
            return
        server = self._server
        now = asyncio.get_running_loop().time()
        if request.have != self._body_seen:
            self._body_seen, self._body_progress = request.have, now
        stalled = now >= self._body_progress + server.body_timeout
        too_slow = now >= server.body_rate_deadline(self._body_started, request.have,
                                                    request.reserved)
        if not stalled and not too_slow:
            self._arm_body_check(now)
            return
        status, text, _ = server.failure(server.body_timeout_error(too_slow and not stalled),
                                         request.method, self._route_of(request))
        self._count(request, status)
        self._finish(request)
        self._request = None
        if self._transport is not None:
            body = text.encode()
            self._transport.write(answer_head(status, TEXT, len(body), close=True) + body)
            self._transport.close()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_idle()
        self._cancel_body_timer()

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, grace: float) -> None:
        """Let the request in progress finish (at most ``grace`` seconds), then close."""
        self._stopping = True
        task = self._task
        if task is not None:
            try:
                async with asyncio.timeout(grace):
                    await asyncio.shield(task)
            except TimeoutError:
                pass
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
