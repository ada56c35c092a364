"""``PeerClient``: the HTTP client of one peer (one aiohttp session, a bounded connection pool).

Every call is bounded by a time budget that grows with the bytes it moves: the client's
``timeout`` plus the request's bytes, and the answer's, at ``min_rate`` bytes per second
(:class:`TimeBudget`); an answer's declared length extends the budget as soon as its head
arrives. Any failure to get an answer (refused, reset,
timeout, 5xx, 401) is raised as :class:`kvtier.errors.PeerError` so the tier can treat that
peer as a miss and take it out of the read path. Redirects are never followed (a ``3xx`` is a
failed call: the pool's bearer token goes only to the member it was configured for), error
messages name the exception type and text, never request headers, and every answer's
declared length is checked against this client's own limits before a buffer is allocated.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import payload as aio_payload
from aiohttp.abc import AbstractStreamWriter

from kvtier.codec import EncodedFrame
from kvtier.errors import PeerError, PeerStatusError
from kvtier.peer import protocol as proto
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.directory import (
    ADDED_QUERY,
    AGE_QUERY,
    DIR_LOOKUP_PATH,
    DIR_UPDATE_PATH,
    SUPERSEDED_QUERY,
    decode_holders,
    encode_superseded,
    encode_update,
    holders_cap,
)
from kvtier.peer.fastread import RawPool
from kvtier.peer.versions import STAMP_HEADER, format_stamps, write_stamp
from kvtier.redact import mask_secrets

__all__ = ["DEFAULT_MIN_RATE", "BuffersPayload", "PeerClient", "PeerTimeoutError",
           "PeerUnreachableError", "TimeBudget"]

# Most bytes of an answer that carries no block (a PUT's 204, an error text).
_SMALL_ANSWER_BYTES = 64 << 10
# Per entry of a batch get answer, besides the frame: u16 key length, key, u64 frame length.
_BATCH_ENTRY_OVERHEAD = 2 + 128 + 8


class PeerTimeoutError(PeerError):
    """A peer did not answer within the request's time budget (it may only be busy)."""


class PeerUnreachableError(PeerError):
    """A peer refused the connection: nothing listens on its port."""


#: Bytes per second a request is assumed to move at least (``min_rate=`` of a pool URL).
DEFAULT_MIN_RATE = 64 << 20
# Frame size a batch get expects per key before any frame was seen (a small KV block).
_FIRST_FRAME_GUESS = 64 << 10
# Most entries of a write sent with one stamp each: their header stays well under the
# 8 KiB a header line may take (21 bytes a stamp).
_STAMPS_PER_REQUEST = 256


def _stamp_headers(stamps: Sequence[int] | None, fill: bool) -> dict[str, str]:
    """The stamp header of a write: ``stamps`` if given, else (a plain write) the stamp of
    the client write in progress (:data:`kvtier.peer.versions.write_stamp`), else none."""
    if stamps is None:
        stamp = None if fill else write_stamp.get()
        return {} if stamp is None else {STAMP_HEADER: str(stamp)}
    return {STAMP_HEADER: format_stamps(list(stamps))} if stamps else {}


class TimeBudget:
    """How long one request may take: ``timeout + bytes / min_rate``.

    ``bytes`` counts what is sent plus what is expected back. A batch get's answer is
    expected to hold ``frame_bytes`` per key, the largest frame this pool recently sent or
    received (64 KiB before the first; it decays by 1/16 per smaller frame seen), until the
    answer's head declares its length. One budget is shared by the clients of a pool.

    Parameters
    ----------
    timeout
        Seconds allowed for a request that moves no bytes (the floor).
    min_rate
        Bytes per second a member is assumed to move at least.
    """

    def __init__(self, timeout: float, min_rate: float = DEFAULT_MIN_RATE) -> None:
        self.timeout = timeout
        self.min_rate = min_rate
        self.frame_bytes = _FIRST_FRAME_GUESS

    def seen(self, frame_bytes: int) -> None:
        """Note the size of one frame sent or received."""
        self.frame_bytes = max(frame_bytes, self.frame_bytes - (self.frame_bytes >> 4))

    def seconds(self, nbytes: int) -> float:
        """The budget of a request moving ``nbytes`` bytes."""
        return self.timeout + nbytes / self.min_rate


def _describe(exc: BaseException) -> str:
    """An exception as text for a PeerError: type and message, never its repr (aiohttp's
    reprs carry the request, headers included) and never a secret."""
    return mask_secrets(f"{type(exc).__name__}: {exc}")


class BuffersPayload(aio_payload.Payload):
    """A request body sent as several buffers in order, without joining them."""

    def __init__(self, buffers: Sequence[bytes | memoryview]) -> None:
        super().__init__(tuple(buffers), content_type=proto.CONTENT_TYPE)
        self._buffers = tuple(buffers)
        self._size = sum(memoryview(b).nbytes for b in self._buffers)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._buffers).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        for buf in self._buffers:
            await writer.write(buf)

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        await self.write(writer)


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body of ``resp``, refusing one that declares or grows past ``cap`` bytes."""
    if resp.content_length is not None and resp.content_length > cap:
        raise PeerError(f"answer of {resp.content_length} bytes exceeds this client's limit "
                        f"of {cap} bytes")
    parts, have = [], 0
    while chunk := await resp.content.readany():
        have += len(chunk)
        if have > cap:
            raise PeerError(f"answer exceeds this client's limit of {cap} bytes")
        parts.append(chunk)
    return b"".join(parts)


class PeerClient:
    """Client of one peer.

    Parameters
    ----------
    member
        The peer's member id, ``host:port`` (``[v6addr]:port`` for IPv6).
    token
        Bearer token, or ``None`` for a server run with ``--insecure-no-auth``.
    timeout
        Seconds allowed for one request that moves no bytes, connection included (see
        ``budget``).
    ssl_context
        Client TLS context (``None``: plain HTTP).
    pool_limit
        Most concurrent connections to this peer.
    limits
        The server's limits, used to split batches; ``limits.max_frame_bytes`` also bounds
        what this client accepts as one block's answer.
    tls_server_name
        Name the peer's certificate must carry, when it is not the member's host (members of
        ``peers+dns://`` are IP addresses).
    max_answer_bytes
        Largest batch get answer this client accepts (checked before allocating).
    budget
        The time budget rule, shared by a pool's clients (default: ``timeout`` plus bytes
        at :data:`DEFAULT_MIN_RATE`).
    buffers
        Answer buffers shared by a pool's clients (default: this client's own).
    """

    def __init__(self, member: str, *, token: str | None, timeout: float,
                 ssl_context: ssl.SSLContext | None = None, pool_limit: int = 64,
                 limits: proto.Limits | None = None, tls_server_name: str | None = None,
                 max_answer_bytes: int = 2 << 30, budget: TimeBudget | None = None,
                 buffers: BodyBuffers | None = None) -> None:
        self.member = member
        self.base_url = f"{'https' if ssl_context else 'http'}://{member}"
        self.timeout = timeout
        self.budget = budget or TimeBudget(timeout)
        self.limits = limits or proto.Limits()
        self.max_answer_bytes = max_answer_bytes
        # The protocol version the member's last block answer announced: a member of the
        # previous version may answer frames not bound to their key (see frames.py).
        self.protocol = proto.VERSION
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._server_hostname = tls_server_name if ssl_context is not None else None
        host, _, port = member.rpartition(":")
        # Block GET/PUT and batch get take the one-copy path; everything else uses aiohttp.
        self._raw = RawPool(host.strip("[]"), int(port), token=token, ssl_context=ssl_context,
                            limit=pool_limit, server_hostname=tls_server_name,
                            buffers=buffers)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool_limit, ssl=ssl_context or False,
                                           enable_cleanup_closed=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout),
            headers=self._headers,
            auto_decompress=False,
            raise_for_status=False,
        )

    async def close(self) -> None:
        """Close the session and its connections."""
        self._raw.close()
        await self._session.close()

    async def _read(self, method: str, path: str, body: Sequence[bytes | memoryview] = (),
                    missing: int | None = None, ok: int = 200,
                    max_body: int = _SMALL_ANSWER_BYTES,
                    expect: int = 0, headers: dict[str, str] | None = None
                    ) -> memoryview | None:
        """A hot-path request through :class:`RawPool`: the body, or ``None`` if missing.

        Its budget covers the bytes sent and ``expect`` bytes of answer, and grows to the
        answer's declared length once its head arrives."""
        sent = sum(memoryview(b).nbytes for b in body)
        loop = asyncio.get_running_loop()
        start = loop.time()
        limit = self.budget.seconds(sent + expect)
        try:
            async with asyncio.timeout(limit) as deadline:
                def on_length(length: int) -> None:
                    nonlocal limit
                    if length > expect:
                        limit = self.budget.seconds(sent + length)
                        deadline.reschedule(start + limit)
                status, data, version = await self._raw.request(
                    method, path, body, max_body=max_body, on_length=on_length,
                    extra="".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()))
        except TimeoutError:
            raise PeerTimeoutError(f"peer {self.member}: {method} timed out after "
                                   f"{limit:.3g}s") from None
        except ConnectionRefusedError as exc:
            raise PeerUnreachableError(f"peer {self.member}: {method} failed: "
                                       f"{_describe(exc)}") from None
        except OSError as exc:
            raise PeerError(f"peer {self.member}: {method} failed: {_describe(exc)}") from None
        except PeerError as exc:
            raise PeerError(f"peer {self.member}: {method} failed: {exc}") from None
        if status == missing:
            return None
        if status == 200:  # an answer of frames (block or batch get) announces the version
            self.protocol = version
        if status != ok:
            text = bytes(data[:200]).decode("utf-8", "replace").strip()
            raise PeerStatusError(f"peer {self.member}: {method} {path[:60]} -> {status} {text}",
                                  status)
        return data

    async def _request(self, method: str, path: str, *, body: Any = None,
                       ok: tuple[int, ...] = (200, 204), missing: int | None = None,
                       limit_s: float | None = None, nbytes: int = 0,
                       headers: dict[str, str] | None = None) -> bytes | None:
        """One request moving about ``nbytes`` bytes (budget: :class:`TimeBudget`, or
        ``limit_s``); returns the body, ``None`` for the ``missing`` status, else raises."""
        limit = self.budget.seconds(nbytes) if limit_s is None else limit_s
        try:
            async with asyncio.timeout(limit):
                async with self._session.request(method, self.base_url + path, data=body,
                                                 allow_redirects=False, headers=headers,
                                                 server_hostname=self._server_hostname,
                                                 ) as resp:
                    if resp.status == missing:
                        return None
                    if resp.status not in ok:
                        text = (await resp.content.read(200)).decode("utf-8", "replace")
                        raise PeerStatusError(f"peer {self.member}: {method} {path[:60]} -> "
                                              f"{resp.status} {text.strip()}", resp.status)
                    return await _read_capped(resp, self._answer_cap(path))
        except TimeoutError:
            raise PeerTimeoutError(f"peer {self.member}: {method} timed out after "
                                   f"{limit:.3g}s") from None
        except aiohttp.ClientConnectorError as exc:
            error = PeerUnreachableError \
                if isinstance(exc.os_error, ConnectionRefusedError) else PeerError
            raise error(f"peer {self.member}: {method} failed: {_describe(exc)}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise PeerError(f"peer {self.member}: {method} failed: {_describe(exc)}") from None

    def _answer_cap(self, path: str) -> int:
        path = path.partition("?")[0]
        if path in (proto.BATCH_EXISTS_PATH, proto.BATCH_DELETE_PATH):
            return 4 + self.limits.max_batch  # a flag list
        if path == proto.BATCH_STAMPS_PATH:
            return 4 + 9 * self.limits.max_batch
        if path in (DIR_LOOKUP_PATH, DIR_UPDATE_PATH):
            return holders_cap(self.limits.max_batch)
        return 16 * _SMALL_ANSWER_BYTES  # health document, metrics text, delete answers

    # ------------------------------------------------------------------ blocks
    async def get(self, key: bytes) -> memoryview | None:
        """The block's frame (unverified), or ``None`` when the peer does not hold it."""
        frame = await self._read("GET", proto.block_path(key), missing=404,
                                 max_body=self.limits.max_frame_bytes,
                                 expect=self.budget.frame_bytes)
        if frame is not None:
            self.budget.seen(frame.nbytes)
        return frame

    async def put(self, key: bytes, frame: EncodedFrame, *, fill: bool = False,
                  stamp: int | None = None) -> None:
        """Store one frame (``fill``: only if the peer does not hold ``key``; ``stamp``: the
        write's, default the client write's in progress, see :func:`_stamp_headers`)."""
        self.budget.seen(frame.nbytes)
        path = proto.block_path(key)
        await self._read("PUT", f"{path}?{proto.FILL_QUERY}" if fill else path, frame.buffers,
                         ok=204, headers=_stamp_headers(None if stamp is None else [stamp],
                                                        fill))

    async def delete(self, key: bytes) -> bool:
        """Delete one block; whether it was present."""
        return await self._request("DELETE", proto.block_path(key), missing=404,
                                   headers=_stamp_headers(None, False)) is not None

    def _chunks(self, n: int) -> list[slice]:
        step = self.limits.max_batch
        return [slice(i, i + step) for i in range(0, n, step)]

    async def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Frames (unverified views) in the order of ``keys``; ``None`` for missing ones."""
        out: list[memoryview | None] = []
        for part in self._chunks(len(keys)):
            chunk = keys[part]
            most = 4 + len(chunk) * (_BATCH_ENTRY_OVERHEAD + self.limits.max_frame_bytes)
            body = await self._read("POST", proto.BATCH_GET_PATH, [proto.encode_keys(chunk)],
                                    max_body=min(most, self.max_answer_bytes),
                                    expect=len(chunk) * self.budget.frame_bytes)
            try:
                entries = proto.decode_blocks(body or b"", len(chunk),
                                              self.limits.max_frame_bytes)
            except proto.ProtocolError as exc:
                raise PeerError(f"peer {self.member}: bad batch get answer: {exc}") from None
            if [k for k, _ in entries] != list(chunk):
                raise PeerError(f"peer {self.member}: batch get answered other keys")
            frames = [frame for _, frame in entries]
            for frame in frames:
                if frame is not None:
                    self.budget.seen(frame.nbytes)
            out += frames
        return out

    async def put_many(self, items: Sequence[tuple[bytes, EncodedFrame]], *,
                       fill: bool = False, stamps: Sequence[int] | None = None) -> None:
        """Store frames, split into requests that respect the batch and body limits
        (``fill``: only those the peer does not hold; ``stamps``: one per item, default
        the client write's in progress, see :func:`_stamp_headers`)."""
        start, size = 0, 4
        path = f"{proto.BATCH_PUT_PATH}?{proto.FILL_QUERY}" if fill else proto.BATCH_PUT_PATH
        most = self.limits.max_batch if stamps is None else \
            min(self.limits.max_batch, _STAMPS_PER_REQUEST)
        for i, (key, frame) in enumerate(items):
            entry = 2 + len(key) + 8 + frame.nbytes
            if i > start and (i - start >= most or size + entry > self.limits.max_body_bytes):
                await self._put_batch(items[start:i], path, _stamp_headers(
                    None if stamps is None else stamps[start:i], fill))
                start, size = i, 4
            size += entry
        if start < len(items):
            await self._put_batch(items[start:], path, _stamp_headers(
                None if stamps is None else stamps[start:], fill))

    async def _put_batch(self, items: Sequence[tuple[bytes, EncodedFrame]], path: str,
                         headers: dict[str, str] | None = None) -> None:
        for _, frame in items:
            self.budget.seen(frame.nbytes)
        body = BuffersPayload(proto.encode_blocks(list(items)))
        await self._request("POST", path, body=body, nbytes=body.size or 0, headers=headers)

    async def _flags(self, path: str, keys: Sequence[bytes],
                     stamps: Sequence[int] | None = None) -> list[bool]:
        out: list[bool] = []
        step = self.limits.max_batch if stamps is None else \
            min(self.limits.max_batch, _STAMPS_PER_REQUEST)
        for start in range(0, len(keys), step):
            chunk = keys[start:start + step]
            headers = _stamp_headers(None if stamps is None else stamps[start:start + step],
                                     path != proto.BATCH_DELETE_PATH)
            body = await self._request("POST", path, body=proto.encode_keys(chunk), ok=(200,),
                                       headers=headers)
            out += proto.decode_flags(body or b"", len(chunk))
        return out

    async def stamps_many(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """``(kind, stamp)`` of each key on the peer: kind 0 absent, 1 a block, 2 a
        tombstone (see :mod:`kvtier.peer.versions`). A peer of before stamps (no such
        route) answers as holding its blocks at stamp 0, unknown."""
        out: list[tuple[int, int]] = []
        for part in self._chunks(len(keys)):
            chunk = keys[part]
            try:
                body = await self._request("POST", proto.BATCH_STAMPS_PATH, ok=(200,),
                                           body=proto.encode_keys(chunk))
            except PeerStatusError as exc:
                if exc.status not in (404, 405):
                    raise
                out += [(1 if held else 0, 0) for held in await self.exists_many(chunk)]
                continue
            out += proto.decode_stamps(body or b"", len(chunk))
        return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the peer holds."""
        return await self._flags(proto.BATCH_EXISTS_PATH, keys)

    async def delete_many(self, keys: Sequence[bytes], *,
                          stamps: Sequence[int] | None = None) -> list[bool]:
        """Delete ``keys`` (``stamps``: one per key, default the client write's in
        progress); which were present."""
        return await self._flags(proto.BATCH_DELETE_PATH, keys, stamps)

    async def forward(self, items: Sequence[tuple[bytes, EncodedFrame]], age: float) -> None:
        """Hand the peer last copies evicted elsewhere (``placement=local``): a batch put
        that fills holes only, with the blocks' ``age`` in seconds (``?fill=1&age=``)."""
        if not (age >= 0 and math.isfinite(age)):
            raise ValueError(f"age: expected a finite number >= 0, got {age!r}")
        path = f"{proto.BATCH_PUT_PATH}?{proto.FILL_QUERY}&{AGE_QUERY}={age:.3f}"
        await self._put_batch(list(items), path)

    async def dir_lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key in the peer's holder directory (``placement=local``)."""
        out: list[list[str]] = []
        for part in self._chunks(len(keys)):
            chunk = keys[part]
            body = await self._request("POST", DIR_LOOKUP_PATH, body=proto.encode_keys(chunk),
                                       ok=(200,))
            out += decode_holders(body or b"", len(chunk))
        return out

    async def dir_update(self, holder: str, add: Sequence[bytes], remove: Sequence[bytes]
                         ) -> list[list[str]]:
        """Tell the peer's holder directory that ``holder`` holds ``add`` and no longer holds
        ``remove``; returns, per removed key, the holders left there."""
        step = self.limits.max_batch
        left: list[list[str]] = []
        for start in range(0, max(len(add), len(remove), 1), step):
            part = remove[start:start + step]
            body = await self._request("POST", DIR_UPDATE_PATH, ok=(200,), body=encode_update(
                holder, add[start:start + step], part))
            left += decode_holders(body or b"", len(part))
        return left

    async def dir_register(self, holder: str, add: Sequence[bytes]) -> list[list[str]]:
        """Tell the peer's holder directory that ``holder`` holds ``add``; returns, per key,
        its holders there after the update (``?added=1``)."""
        out: list[list[str]] = []
        for part in self._chunks(len(add)):
            chunk = add[part]
            body = await self._request("POST", f"{DIR_UPDATE_PATH}?{ADDED_QUERY}", ok=(200,),
                                       body=encode_update(holder, chunk, ()))
            out += decode_holders(body or b"", len(chunk))
        return out

    async def drop_superseded(self, keys: Sequence[bytes], stamps: Sequence[int],
                              digests: Sequence[int]) -> list[bool]:
        """Drop the peer's copies of ``keys`` older than ``stamps`` whose content differs
        from ``digests`` (:func:`~kvtier.peer.directory.frame_digest`; one each per key),
        leaving no tombstone (``placement=local``: values a newer write elsewhere
        superseded); which were dropped."""
        out: list[bool] = []
        step = min(self.limits.max_batch, _STAMPS_PER_REQUEST)
        for start in range(0, len(keys), step):
            part = slice(start, start + step)
            body = await self._request(
                "POST", f"{proto.BATCH_DELETE_PATH}?{SUPERSEDED_QUERY}", ok=(200,),
                body=encode_superseded(keys[part], digests[part]),
                headers={STAMP_HEADER: format_stamps(list(stamps[part]))})
            out += proto.decode_flags(body or b"", len(keys[part]))
        return out

    async def health(self, limit_s: float | None = None) -> dict[str, Any]:
        """The peer's ``/v1/health`` document (``limit_s`` overrides the timeout)."""
        body = await self._request("GET", proto.HEALTH_PATH, ok=(200,), limit_s=limit_s)
        try:
            doc = json.loads(body or b"")
        except ValueError as exc:
            raise PeerError(f"peer {self.member}: bad health document: {exc}") from None
        if not isinstance(doc, dict):
            raise PeerError(f"peer {self.member}: health document is not an object")
        return doc

    async def metrics(self) -> str:
        """The peer's ``/metrics`` text."""
        body = await self._request("GET", proto.METRICS_PATH, ok=(200,))
        return (body or b"").decode("utf-8", "replace")
