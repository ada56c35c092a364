"""A minimal HTTP/1.1 client for the read hot path (block GET and batch get).

aiohttp's client copies a response body three times (``recv`` into a new ``bytes``, the
parser's slice of it, then ``b"".join`` of the chunks); at 1-4 MiB blocks that is most of
the client's CPU (see docs/peer-pool.md). Here a :class:`asyncio.BufferedProtocol` receives
the body straight into one preallocated buffer: one copy, from the kernel. It speaks only
what the peer server answers: a status line, headers with ``Content-Length``, a body.
Everything else (writes, health, metrics) keeps using aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

import numpy as np

from kvtier.errors import PeerError

__all__ = ["RawPool"]

_HEAD_MAX = 64 << 10


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._head = bytearray(_HEAD_MAX)
        self._head_len = 0
        self._body: memoryview | None = None
        self._have = 0
        self._status = 0
        self._keep_alive = True
        self._fut: asyncio.Future[tuple[int, memoryview]] | None = None

    # ------------------------------------------------------------- protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(PeerError(f"connection lost: {exc or 'closed by peer'}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is None:
            return memoryview(self._head)[self._head_len :]
        if self._have < self._body.nbytes:
            return self._body[self._have :]
        # Response complete: anything more is stray; buffer_updated() then drops the stream.
        return memoryview(self._head)

    def buffer_updated(self, nbytes: int) -> None:
        if self._fut is None or self._fut.done():
            # Bytes nobody asked for: the stream is out of step, never reuse it.
            self.close()
            return
        if self._body is not None:
            self._have += nbytes
        else:
            self._head_len += nbytes
            self._parse_head()
        if self._body is not None and self._have == self._body.nbytes:
            self._fut.set_result((self._status, self._body))

    def _parse_head(self) -> None:
        end = self._head.find(b"\r\n\r\n", 0, self._head_len)
        if end < 0:
            if self._head_len == _HEAD_MAX:
                self._fail(PeerError("response head too large"))
            return
        lines = bytes(self._head[:end]).split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        length = -1
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length" and value.strip().isdigit():
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                self._keep_alive = False
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() \
                or length < 0:
            self._fail(PeerError(f"malformed response head {lines[0][:80]!r}"))
            return
        extra = self._head_len - (end + 4)
        if extra > length:
            self._fail(PeerError("response longer than its Content-Length"))
            return
        self._status = int(parts[1])
        # np.empty: no zero-fill of a buffer the socket overwrites anyway.
        self._body = np.empty(length, dtype=np.uint8).data.cast("B")
        self._body[:extra] = self._head[end + 4 : self._head_len]
        self._have = extra

    def _fail(self, exc: Exception) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -------------------------------------------------------------- request
    async def request(self, head: bytes, body: Sequence[bytes | memoryview]
                      ) -> tuple[int, memoryview]:
        assert self.transport is not None
        self._head_len, self._body, self._have, self._status = 0, None, 0, 0
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
        return result


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
    """

    def __init__(self, host: str, port: int, *, token: str | None,
                 ssl_context: ssl.SSLContext | None, limit: int) -> None:
        self.host, self.port = host, port
        self._ssl = ssl_context
        self._idle: list[_Conn] = []
        self._sem = asyncio.Semaphore(limit)
        host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._fixed = f"Host: {host_header}\r\n{auth}".encode()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            _Conn, self.host, self.port, ssl=self._ssl,
            server_hostname=self.host if self._ssl is not None else None)
        return conn

    async def request(self, method: str, path: str,
                      body: Sequence[bytes | memoryview] = ()) -> tuple[int, memoryview]:
        """Send one request; returns ``(status, body)``. The caller bounds it with a timeout."""
        length = sum(memoryview(b).nbytes for b in body)
        head = (f"{method} {path} HTTP/1.1\r\n".encode() + self._fixed
                + f"Content-Length: {length}\r\n\r\n".encode())
        async with self._sem:
            while self._idle:
                conn = self._idle.pop()
                if conn.closed:
                    continue
                try:
                    result = await conn.request(head, body)
                except PeerError:
                    # A reused connection the server had just closed (idle timeout): retry
                    # once on a fresh one instead of declaring the peer dead.
                    break
                self._release(conn)
                return result
            conn = await self._connect()
            result = await conn.request(head, body)
            self._release(conn)
            return result

    def _release(self, conn: _Conn) -> None:
        if not conn.closed:
            self._idle.append(conn)

    def close(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
