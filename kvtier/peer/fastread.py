"""A minimal HTTP/1.1 client for the hot paths (block GET and PUT, batch get).

aiohttp's client copies a response body three times (``recv`` into a new ``bytes``, the
parser's slice of it, then ``b"".join`` of the chunks); at 1-4 MiB blocks that is most of
the client's CPU (see docs/peer-pool.md). Here a :class:`asyncio.BufferedProtocol` receives
the body straight into one preallocated buffer: one copy, from the kernel.

Response heads are parsed by ``httptools`` (llhttp, the parser aiohttp itself builds on);
only the body bypasses it. Whatever cannot be framed safely by one ``Content-Length`` is
refused: ``Transfer-Encoding``, a missing, repeated or malformed ``Content-Length``, interim
(1xx) answers, and a length above the caller's limit (checked before anything is allocated).
HTTP/1.0 answers and ``Connection: close`` end the connection after the response. A request
body goes out as the caller's buffers, never joined. Everything else (batch writes, health,
metrics) keeps using aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn, cast

import httptools

from kvtier.errors import PeerError
from kvtier.peer import protocol as proto
from kvtier.peer.buffers import BodyBuffers

__all__ = ["Answer", "RawPool"]

_HEAD_MAX = 64 << 10
_VERSION_HEADER = proto.VERSION_HEADER.lower().encode()


class Answer(NamedTuple):
    """One answer: its status, its body, and the protocol version the server announced
    (:func:`kvtier.peer.protocol.version_of`)."""

    status: int
    body: memoryview
    version: int


class _Refused(Exception):
    """Raised from a parser callback: the response cannot be framed safely."""


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive connection; one request at a time.

    States: idle (no request outstanding: any byte that arrives is stray and ends the
    connection), head (bytes go to ``httptools``, which also hands over the first body bytes
    that shared a read with the head), body (bytes land straight in the body buffer).
    """

    def __init__(self, buffers: BodyBuffers) -> None:
        self.buffers = buffers
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # Head bytes are fed to the parser as they arrive, so one scratch buffer serves every
        # read of the head (and, never empty, every stray read of an idle connection).
        self._scratch = bytearray(_HEAD_MAX)
        self._parser: httptools.HttpResponseParser | None = None
        self._head_bytes = 0
        self._max_body = 0
        self._length = -1
        self._framing_error = ""
        self._message_done = False
        self._body: memoryview | None = None
        self._have = 0
        self._status = 0
        self._keep_alive = True
        self._version: bytes | None = None
        self._fut: asyncio.Future[tuple[int, memoryview]] | None = None
        self._on_length: Callable[[int], None] | None = None

    # ------------------------------------------------------------- protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport's methods without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(PeerError(f"connection lost: {exc or 'closed by peer'}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None and self._parser is None and self._have < self._body.nbytes:
            return self._body[self._have :]
        # Head, or no response expected: never an empty buffer (asyncio treats one as fatal).
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._fut is None or self._fut.done():
            # Bytes nobody asked for: the stream is out of step, never reuse it.
            self.close()
            return
        if self._parser is not None:
            self._feed_head(self._parser, nbytes)
        else:
            self._have += nbytes
        self._maybe_done()

    # ----------------------------------------------------------------- head
    def _feed_head(self, parser: httptools.HttpResponseParser, nbytes: int) -> None:
        self._head_bytes += nbytes
        try:
            parser.feed_data(memoryview(self._scratch)[:nbytes])
        except (httptools.HttpParserError, _Refused) as exc:
            self._fail(PeerError(f"bad response: {self._framing_error or exc}"))
            return
        if self._body is None and self._head_bytes > _HEAD_MAX:
            self._fail(PeerError("response head too large"))
        elif self._body is not None:
            # The head is done: the rest of the body bypasses the parser.
            self._parser = None

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length":
            # llhttp already refuses repeated or non-numeric values.
            self._length = int(value)
        elif lower == _VERSION_HEADER:
            self._version = value
        elif lower == b"transfer-encoding":
            self._refuse("Transfer-Encoding is not supported (a Content-Length is required)")

    def on_headers_complete(self) -> None:
        parser = self._parser
        if parser is None:
            self._refuse("head after the response ended")
        status = parser.get_status_code()
        if status < 200:
            self._refuse(f"interim status {status}")
        if status in (204, 304) and self._length < 0:
            self._length = 0  # a status that never has a body (aiohttp sends no length for it)
        if self._length < 0:
            self._refuse(f"status {status} without Content-Length")
        if self._length > self._max_body:
            self._refuse(f"Content-Length {self._length} exceeds this client's limit of "
                         f"{self._max_body} bytes")
        self._status = status
        if self._on_length is not None:
            self._on_length(self._length)
        self._keep_alive = parser.should_keep_alive()  # HTTP/1.0: close by default
        self._body = self.buffers.take(self._length)
        self._have = 0

    def on_body(self, data: bytes) -> None:
        # Body bytes that arrived in the same read as the head (at most _HEAD_MAX of them).
        if self._body is None:
            self._refuse("body before the head")
        end = self._have + len(data)
        self._body[self._have : end] = data
        self._have = end

    def on_message_complete(self) -> None:
        self._message_done = True

    def on_message_begin(self) -> None:
        if self._message_done:
            self._refuse("response longer than its Content-Length")

    def _refuse(self, why: str) -> NoReturn:
        self._framing_error = why
        raise _Refused(why)

    # -------------------------------------------------------------- outcome
    def _maybe_done(self) -> None:
        if self._fut is None or self._fut.done() or self._body is None \
                or self._have != self._body.nbytes:
            return
        self._fut.set_result((self._status, self._body))
        # The caller's now: an idle connection must not pin the buffer.
        self._body, self._parser = None, None

    def _fail(self, exc: Exception) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        self._body, self._parser = None, None
        if self.transport is not None:
            self.transport.close()

    # -------------------------------------------------------------- request
    async def request(self, head: bytes, body: Sequence[bytes | memoryview],
                      max_body: int, on_length: Callable[[int], None] | None = None
                      ) -> Answer:
        if self.transport is None or self.closed:
            raise PeerError("connection is closed")
        self._on_length = on_length
        self._parser = httptools.HttpResponseParser(self)
        self._head_bytes, self._max_body, self._length = 0, max_body, -1
        self._framing_error, self._message_done = "", False
        self._body, self._have, self._status, self._keep_alive = None, 0, 0, True
        self._version = None
        self._fut = asyncio.get_running_loop().create_future()
        self.transport.write(head)
        for buf in body:
            self.transport.write(buf)
        try:
            result = await self._fut
        except BaseException:
            self.close()  # cancelled or failed mid-response: the stream is out of step
            raise
        if not self._keep_alive:
            self.close()
        return Answer(*result, proto.version_of(self._version))


class RawPool:
    """Keep-alive connections to one peer, at most ``limit`` in use at once.

    Parameters
    ----------
    host, port
        The peer's address.
    token
        Bearer token (``None``: no ``Authorization`` header).
    ssl_context
        Client TLS context, or ``None`` for plain TCP.
    limit
        Most connections in use at once.
    buffer_budget
        Most bytes of response buffers kept for reuse (see :class:`BodyBuffers`).
    buffers
        Response buffers shared with other pools (``buffer_budget`` is then unused).
    server_hostname
        Name the peer's TLS certificate must carry (default: ``host``).
    """

    def __init__(self, host: str, port: int, *, token: str | None,
                 ssl_context: ssl.SSLContext | None, limit: int,
                 buffer_budget: int = 256 << 20, server_hostname: str | None = None,
                 buffers: BodyBuffers | None = None) -> None:
        self.host, self.port = host, port
        self.buffers = buffers if buffers is not None else BodyBuffers(buffer_budget)
        self.connections_made = 0
        self._ssl = ssl_context
        self._server_hostname = server_hostname or host
        self._idle: list[_Conn] = []
        self._sem = asyncio.Semaphore(limit)
        host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._fixed = f"Host: {host_header}\r\n{auth}".encode()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Conn(self.buffers), self.host, self.port, ssl=self._ssl,
            server_hostname=self._server_hostname if self._ssl is not None else None)
        self.connections_made += 1
        return conn

    async def request(self, method: str, path: str, body: Sequence[bytes | memoryview] = (),
                      *, max_body: int, on_length: Callable[[int], None] | None = None,
                      extra: str = "") -> Answer:
        """Send one request; returns its answer. The caller bounds it with a timeout;
        ``on_length`` is called with the answer's ``Content-Length`` once its head is read;
        ``extra`` holds more header lines (each ending in CRLF).

        Raises
        ------
        PeerError
            If the answer cannot be framed safely or declares more than ``max_body`` bytes.
        """
        length = sum(memoryview(b).nbytes for b in body)
        head = (f"{method} {path} HTTP/1.1\r\n".encode() + self._fixed
                + f"{extra}Content-Length: {length}\r\n\r\n".encode())
        async with self._sem:
            while self._idle:
                conn = self._idle.pop()
                if conn.closed:
                    continue
                try:
                    result = await conn.request(head, body, max_body, on_length)
                except PeerError:
                    # A reused connection the server had just closed (idle timeout): retry
                    # once on a fresh one instead of declaring the peer dead.
                    break
                self._release(conn)
                return result
            conn = await self._connect()
            result = await conn.request(head, body, max_body, on_length)
            self._release(conn)
            return result

    def _release(self, conn: _Conn) -> None:
        if not conn.closed:
            self._idle.append(conn)

    def close(self) -> None:
        """Close every idle connection and drop the held buffers."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        self.buffers.clear()
