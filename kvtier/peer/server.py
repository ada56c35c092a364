"""``PeerServer``: serves this node's segment (a TieredStore or a single tier) to the pool.

HTTP/1.1 under ``/v1`` with binary bodies; the routes, limits and status codes are documented
in docs/peer-protocol.md. Every request is authenticated with a bearer token (constant-time
compare) unless the server is explicitly started without auth. Client input never causes a
5xx: bad keys, frames and bodies are 400, oversized ones 413, and nothing is stored unless the
whole request is valid.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from aiohttp import web

from kvtier.codec import FLAG_ZSTD, decode_frame, encode_frame, parse_header
from kvtier.errors import (
    BlockTooLargeError,
    ConfigError,
    CorruptBlockError,
    InvalidKeyError,
    TierFullError,
)
from kvtier.keys import key_from_hex
from kvtier.peer import protocol as proto
from kvtier.peer.locate import LOCATE_PATH, make_locate_handler, segment_answer

__all__ = ["PeerServer", "Segment"]

log = logging.getLogger("kvtier.peer.server")
Block = npt.NDArray[np.generic]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Decompressing anything, or checksumming a payload larger than this, inline would stall
# other requests (a 1 MiB checksum takes ~0.1 ms, less than the hop to a worker thread).
_INLINE_DECODE_BYTES = 1 << 20
_WRITE_SLICE = 256 << 10


class Segment(Protocol):
    """What the server needs from the store it exposes (TieredStore and Tier both fit)."""

    async def get(self, key: bytes) -> Block | None: ...
    async def put(self, key: bytes, value: object) -> None: ...
    async def delete(self, key: bytes) -> bool: ...
    async def get_many(self, keys: Sequence[bytes]) -> list[Block | None]: ...
    async def put_many(self, items: Iterable[tuple[bytes, object]]) -> None: ...
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
    """

    def __init__(self, segment: Segment, *, token: str | None, host: str = "127.0.0.1",
                 port: int = 0, node_id: str | None = None, limits: proto.Limits | None = None,
                 ssl_context: ssl.SSLContext | None = None, insecure_no_auth: bool = False,
                 close_segment: bool = False) -> None:
        if token is None and not insecure_no_auth:
            raise ConfigError("token: a bearer token is required (or pass insecure_no_auth=True)")
        if token is not None and not token:
            raise ConfigError("token: must not be empty")
        self.segment = segment
        self.limits = limits or proto.Limits()
        self.host, self.port = host, port
        self.node_id = node_id
        self._token = None if token is None else f"Bearer {token}".encode()
        self._ssl = ssl_context
        self._close_segment = close_segment
        self._runner: web.AppRunner | None = None
        self._started = time.monotonic()
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.corrupt_frames = 0
        self.client_gone = 0
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
        app.router.add_get(proto.HEALTH_PATH, self._health)
        app.router.add_get(proto.METRICS_PATH, self._metrics)
        app.router.add_post(LOCATE_PATH, make_locate_handler(segment_answer(self.segment), node=lambda: self.node_id or "", limits=self.limits))  # noqa: E501
        return app

    async def start(self) -> tuple[str, int]:
        """Bind and start serving; returns the bound ``(host, port)``."""
        if self._runner is not None:
            raise RuntimeError("PeerServer already started")
        # A refused body is drained for at most 1 s (not aiohttp's 10 s) before closing.
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                               shutdown_timeout=10.0, lingering_time=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, ssl_context=self._ssl,
                           backlog=512, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._started = time.monotonic()
        host, port = runner.addresses[0][:2]
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

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, then close the segment if owned."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
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
            self.requests[(route, request.method, status)] += 1

    @web.middleware
    async def _guard_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except (BlockTooLargeError, proto.LimitExceededError) as exc:
            raise _error(web.HTTPRequestEntityTooLarge, str(exc), max_size=0,
                         actual_size=0) from None
        except (InvalidKeyError, proto.ProtocolError, CorruptBlockError) as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from None
        except TierFullError as exc:
            raise _error(web.HTTPInsufficientStorage, str(exc)) from None
        except ConnectionError:
            # The client went away mid-request (e.g. a truncated body): nobody to answer.
            self.client_gone += 1
            return web.Response(status=499, text="client closed request")
        except Exception:
            # A bug or a failing segment, never a client error: log it and stay up.
            log.exception("peer server: %s %s failed", request.method, request.path)
            raise _error(web.HTTPServiceUnavailable, "internal error, see server log") from None

    @web.middleware
    async def _auth_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._token is not None:
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, self._token):
                raise web.HTTPUnauthorized(text="missing or wrong bearer token",
                                           headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # -------------------------------------------------------------------- bodies
    async def _read_body(self, request: web.Request, limit: int) -> bytes | memoryview:
        length = request.content_length
        if length is not None and length > limit:
            raise _error(web.HTTPRequestEntityTooLarge, f"body of {length} bytes exceeds {limit}",
                         max_size=limit, actual_size=length)
        if length is not None:
            return await self._read_exactly(request, length)
        body = await request.read()
        if len(body) > limit:
            raise _error(web.HTTPRequestEntityTooLarge, f"body exceeds {limit} bytes",
                         max_size=limit, actual_size=len(body))
        self.bytes_in += len(body)
        return body

    async def _read_exactly(self, request: web.Request, length: int) -> memoryview:
        """The body of a request with a ``Content-Length`` (already checked against the limit),
        copied chunk by chunk into one buffer of that size: ``request.read()`` would copy it
        into a growing bytearray and then once more into ``bytes``."""
        # np.empty: no zero-fill of memory the body overwrites anyway.
        body = np.empty(length, dtype=np.uint8).data.cast("B")
        have = 0
        while have < length:
            chunk, _ = await request.content.readchunk()
            if not chunk:
                break
            end = have + len(chunk)
            if end > length:  # the HTTP parser stops at Content-Length; never trust it blindly
                raise proto.ProtocolError(f"body: longer than its Content-Length {length}")
            body[have:end] = chunk
            have = end
        if have != length:
            raise ConnectionResetError(f"body: {have} of {length} bytes before end of stream")
        self.bytes_in += length
        return body

    async def _decode(self, key: bytes, frame: bytes | memoryview) -> Block:
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
        response = web.StreamResponse(status=status, headers={"Content-Type": proto.CONTENT_TYPE})
        response.content_length = total
        try:
            await response.prepare(request)
            if request.method != "HEAD":
                for buf in buffers:
                    view = memoryview(buf)
                    # Slices: asyncio copies whatever the socket does not take at once into
                    # its own buffer, so a 4 MiB write would mostly be copied; a slice mostly
                    # goes straight to the kernel.
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
        frame = encode_frame(block, key=key)  # bound to its key: the client verifies it
        return await self._send(request, frame.buffers)

    async def _put_block(self, request: web.Request) -> web.StreamResponse:
        key = key_from_hex(request.match_info["key"])
        body = await self._read_body(request, self.limits.max_frame_bytes)
        block = await self._decode(key, body)
        await self.segment.put(key, block)
        return web.Response(status=204)

    async def _delete_block(self, request: web.Request) -> web.StreamResponse:
        key = key_from_hex(request.match_info["key"])
        if await self.segment.delete(key):
            return web.Response(status=204)
        raise web.HTTPNotFound(text="no such block")

    async def _read_keys(self, request: web.Request) -> list[bytes]:
        limit = 4 + self.limits.max_batch * (2 + 128)
        body = await self._read_body(request, min(limit, self.limits.max_body_bytes))
        return proto.decode_keys(body, self.limits.max_batch)

    async def _batch_get(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        blocks = await self.segment.get_many(keys) if keys else []
        items = [(k, None if b is None else encode_frame(b, key=k)) for k, b in zip(keys, blocks,
                                                                             strict=True)]
        return await self._send(request, proto.encode_blocks(items))

    async def _batch_put(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request, self.limits.max_body_bytes)
        entries = proto.decode_blocks(body, self.limits.max_batch, self.limits.max_frame_bytes)
        # Every frame is verified before anything is stored: a bad batch changes nothing.
        decoded: list[tuple[bytes, object]] = []
        for key, frame in entries:
            if frame is None:
                raise proto.ProtocolError(f"body: block {key.hex()} has an empty frame")
            decoded.append((key, await self._decode(key, frame)))
        if decoded:
            await self.segment.put_many(decoded)
        return web.Response(status=204)

    async def _batch_exists(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        flags = await self.segment.contains_many(keys) if keys else []
        return await self._send(request, [proto.encode_flags(flags)])

    async def _batch_delete(self, request: web.Request) -> web.StreamResponse:
        keys = await self._read_keys(request)
        flags = [await self.segment.delete(k) for k in keys]
        return await self._send(request, [proto.encode_flags(flags)])

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
            "protocol": 1,
            "capacity": capacity,
            "used": sum(int(t.get("used") or 0) for t in tiers),
            "blocks": sum(int(t.get("blocks") or 0) for t in tiers),
            "uptime_s": round(time.monotonic() - self._started, 3),
            "tiers": [{k: t.get(k) for k in ("scheme", "name", "capacity", "used", "blocks")}
                      for t in tiers],
            "limits": {"max_block_bytes": self.limits.max_block_bytes,
                       "max_batch": self.limits.max_batch,
                       "max_body_bytes": self.limits.max_body_bytes},
        }

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.health())

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=self.metrics_text(), content_type="text/plain",
                            charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    def metrics_text(self) -> str:
        """Prometheus text exposition of request counters and segment statistics."""
        lines = ["# HELP kvtier_peer_requests_total Requests served, by route, method, status.",
                 "# TYPE kvtier_peer_requests_total counter"]
        for (route, method, status), n in sorted(self.requests.items()):
            lines.append(f'kvtier_peer_requests_total{{route="{_esc(route)}",method='
                         f'"{_esc(method)}",status="{status}"}} {n}')
        for name, value, kind, text in (
            ("kvtier_peer_received_bytes_total", self.bytes_in, "counter", "Body bytes read."),
            ("kvtier_peer_sent_bytes_total", self.bytes_out, "counter", "Body bytes sent."),
            ("kvtier_peer_corrupt_frames_total", self.corrupt_frames, "counter",
             "Frames refused for a bad header or checksum."),
            ("kvtier_peer_client_gone_total", self.client_gone, "counter",
             "Responses not delivered because the client had disconnected."),
            ("kvtier_peer_uptime_seconds", round(time.monotonic() - self._started, 3), "gauge",
             "Seconds since start."),
        ):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        tiers = _tier_stats(self.segment)
        fields = sorted({k for t in tiers for k, v in t.items()
                         if isinstance(v, int | float) and not isinstance(v, bool)})
        for field in fields:
            metric = f"kvtier_store_{field}"
            lines.append(f"# TYPE {metric} gauge")
            for i, t in enumerate(tiers):
                sample = t.get(field)
                if isinstance(sample, int | float) and not isinstance(sample, bool):
                    lines.append(f'{metric}{{tier="{i}",scheme="{_esc(str(t.get("scheme")))}"}} '
                                 f"{sample}")
        return "\n".join(lines) + "\n"


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _error(cls: type[web.HTTPException], text: str, **kwargs: Any) -> web.HTTPException:
    return cls(text=text, **kwargs)

