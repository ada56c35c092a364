"""A minimal HTTP/1.1 client for the hot paths (block GET and PUT, batch get).

aiohttp's client copies a response body three times (``recv`` into a new ``bytes``, the
parser's slice of it, then ``b"".join`` of the chunks); at 1-4 MiB blocks that is most of
the client's CPU (see docs/peer-pool.md). Here a :class:`asyncio.BufferedProtocol` receives
the body straight into one preallocated buffer: one copy, from the kernel. It speaks only
what the peer server answers: a status line, headers with ``Content-Length`` (absent only on
a 204), a body. A request body goes out as the caller's buffers, never joined. Everything
else (batch writes, health, metrics) keeps using aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier.errors import PeerError

__all__ = ["RawPool"]

_HEAD_MAX = 64 << 10
# Bodies at least this large go into reusable buffers; smaller ones are cheap to allocate.
_REUSE_MIN = 256 << 10
Buffer = npt.NDArray[np.uint8]


def _refs(held: list[Buffer], i: int) -> int:
    return sys.getrefcount(held[i])


# What _refs() reports for a buffer only ``held`` references, measured rather than assumed
# (interpreters differ in the temporary references they count).
_ALONE = _refs([np.empty(1, dtype=np.uint8)], 0)


class BodyBuffers:
    """Response body buffers, reused once nothing references them any more.

    A fresh multi-MiB buffer costs a page fault per 4 KiB page when the socket first writes
    it, which at 16-64 MiB batch answers is a large part of the read. Every body (and every
    array decoded from it) is a view of its buffer, and any live view keeps a reference to
    it, so a buffer whose only reference is this list is provably unused: a caller's array
    never changes under it. At most ``budget`` bytes are held; the oldest go first.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.reused = 0
        self._held: list[Buffer] = []

    def take(self, length: int) -> memoryview:
        """A writable buffer of exactly ``length`` bytes (contents undefined)."""
        if length < _REUSE_MIN:
            # np.empty: no zero-fill of a buffer the socket overwrites anyway.
            return np.empty(length, dtype=np.uint8).data.cast("B")
        best = -1
        for i in range(len(self._held)):
            size = self._held[i].nbytes
            if size >= length and _refs(self._held, i) == _ALONE \
                    and (best < 0 or size < self._held[best].nbytes):
                best = i
        if best >= 0:
            self.reused += 1
            buf = self._held.pop(best)
        else:
            buf = np.empty(length, dtype=np.uint8)
        self._held.append(buf)
        while sum(b.nbytes for b in self._held) > self.budget:
            self._held.pop(0)
        return buf.data.cast("B")[:length]


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, buffers: BodyBuffers) -> None:
        self.buffers = buffers
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
            self._body = None  # the caller's now: an idle connection must not pin the buffer

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
        if len(parts) >= 2 and parts[1] in (b"204", b"304") and length < 0:
            length = 0  # a status that never has a body (and aiohttp sends no length for it)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() \
                or length < 0:
            self._fail(PeerError(f"malformed response head {lines[0][:80]!r}"))
            return
        extra = self._head_len - (end + 4)
        if extra > length:
            self._fail(PeerError("response longer than its Content-Length"))
            return
        self._status = int(parts[1])
        self._body = self.buffers.take(length)
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
    buffer_budget
        Most bytes of response buffers kept for reuse (see :class:`BodyBuffers`).
    """

    def __init__(self, host: str, port: int, *, token: str | None,
                 ssl_context: ssl.SSLContext | None, limit: int,
                 buffer_budget: int = 256 << 20) -> None:
        self.host, self.port = host, port
        self.buffers = BodyBuffers(buffer_budget)
        self._ssl = ssl_context
        self._idle: list[_Conn] = []
        self._sem = asyncio.Semaphore(limit)
        host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._fixed = f"Host: {host_header}\r\n{auth}".encode()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Conn(self.buffers), self.host, self.port, ssl=self._ssl,
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
