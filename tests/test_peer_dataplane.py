"""The peer server's data plane (kvtier/peer/dataplane.py): the hot requests are served off
the socket, everything else is handed to aiohttp at a request boundary, and the guards
(budget, body timeout, idle timeout, connection cap, metrics) hold on both paths.

Requests are written as raw bytes on one keep-alive connection, so that what the server
sees (pipelining, split heads, a body that stalls) is exactly what the test wrote."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvtier.codec import encode_frame
from kvtier.peer.protocol import Limits
from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN

AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()
KEY = b"\x01\x02\x03\x04"
BLOCK = np.arange(4096, dtype=np.uint16)


@pytest.fixture
async def server() -> AsyncIterator[PeerServer]:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, idle_timeout=5.0,
                     body_timeout=0.3, max_inflight_bytes=8 << 20,
                     limits=Limits(max_block_bytes=1 << 20, max_batch=8, max_body_bytes=4 << 20))
    await srv.start()
    yield srv
    await srv.stop()


class Conn:
    """One raw client connection and a reader of whole answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, server: PeerServer) -> Conn:
        return cls(*await asyncio.open_connection(server.host, server.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        async with asyncio.timeout(10):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:] if line)}
            length = 0 if head_only else int(headers.get("content-length", "0"))
            body = await self.reader.readexactly(length)
        return status, headers, body

    async def closed_by_server(self, within: float = 10.0) -> bool:
        async with asyncio.timeout(within):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


def put_request(key: bytes, frame: bytes, auth: bytes = AUTH) -> bytes:
    return (f"PUT /v1/blocks/{key.hex()} HTTP/1.1\r\nHost: x\r\n".encode() + auth
            + f"Content-Length: {len(frame)}\r\n\r\n".encode() + frame)


def get_request(key: bytes, method: str = "GET", auth: bytes = AUTH) -> bytes:
    return f"{method} /v1/blocks/{key.hex()} HTTP/1.1\r\nHost: x\r\n".encode() + auth + b"\r\n"


def frame_of(block: np.ndarray, key: bytes = KEY) -> bytes:
    return encode_frame(block, key=key).to_bytes()


def on_data_plane(server: PeerServer) -> int:
    return len(server.dataplane_connections)


async def test_block_requests_stay_on_the_data_plane(server: PeerServer) -> None:
    conn = await Conn.open(server)
    await conn.send(put_request(KEY, frame_of(BLOCK)))
    assert (await conn.answer())[0] == 204
    await conn.send(get_request(KEY))
    status, headers, body = await conn.answer()
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    assert body == frame_of(BLOCK)
    await conn.send(get_request(KEY, "HEAD"))
    status, headers, _ = await conn.answer(head_only=True)
    assert status == 200 and int(headers["content-length"]) == len(frame_of(BLOCK))
    await conn.send(get_request(b"\x09"))
    assert (await conn.answer())[0] == 404
    assert on_data_plane(server) == 1 and server.handoffs == 0
    assert server.requests[("/v1/blocks/{key}", "PUT", 204)] == 1
    assert server.requests[("/v1/blocks/{key}", "GET", 200)] == 1
    assert server.requests[("/v1/blocks/{key}", "HEAD", 200)] == 1
    assert server.requests[("/v1/blocks/{key}", "GET", 404)] == 1
    assert server.bytes_in == server.bytes_out == len(frame_of(BLOCK))
    conn.close()


async def test_pipelined_requests_across_a_hand_off_are_answered_in_order(
        server: PeerServer) -> None:
    """A PUT, a health request (aiohttp's) and a GET in one write: the connection moves to
    aiohttp exactly at the second request's first byte, and all three answers come back in
    order."""
    conn = await Conn.open(server)
    health = b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n"
    await conn.send(put_request(KEY, frame_of(BLOCK)) + health + get_request(KEY))
    assert (await conn.answer())[0] == 204
    status, _, body = await conn.answer()
    assert status == 200 and b'"status": "ok"' in body.replace(b'":"', b'": "')
    status, _, body = await conn.answer()
    assert status == 200 and body == frame_of(BLOCK)
    assert on_data_plane(server) == 0  # handed off for good
    assert server.handoffs == 1
    assert "kvtier_peer_dataplane_handoffs_total 1.0" in server.metrics_text()
    conn.close()


async def test_heads_split_byte_by_byte_and_pipelined_gets(server: PeerServer) -> None:
    await server.segment.put(KEY, BLOCK)
    conn = await Conn.open(server)
    for byte in get_request(KEY):
        await conn.send(bytes([byte]))
    status, _, body = await conn.answer()
    assert status == 200 and body == frame_of(BLOCK)
    await conn.send(b"\r\n" + get_request(KEY) * 3)  # an empty line before a request is legal
    for _ in range(3):
        status, _, body = await conn.answer()
        assert status == 200 and body == frame_of(BLOCK)
    assert on_data_plane(server) == 1
    conn.close()


async def test_a_body_in_small_pieces_is_stored_whole(server: PeerServer) -> None:
    block = np.arange(200_000, dtype=np.uint8)
    request = put_request(KEY, frame_of(block))
    conn = await Conn.open(server)
    for off in range(0, len(request), 7919):
        await conn.send(request[off : off + 7919])
    assert (await conn.answer())[0] == 204
    stored = await server.segment.get(KEY)
    assert stored is not None and np.array_equal(stored, block)
    assert server.budget.held == 0
    conn.close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (put_request(KEY, frame_of(BLOCK), auth=b""), 401),
    (put_request(KEY, frame_of(BLOCK), auth=b"Authorization: Bearer wrong\r\n"), 401),
    (put_request(b"\x05", frame_of(BLOCK)), 400),  # frame bound to another key
    (get_request(KEY).replace(KEY.hex().encode(), b"ABCD"), 400),  # uppercase hex
    (get_request(KEY).replace(KEY.hex().encode(), b"abc"), 400),  # odd length
    (b"PUT /v1/blocks/01 HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"Content-Length: 9999999\r\n\r\n", 413),
    (b"PUT /v1/blocks/01 HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 4\r\n"
     b"Content-Length: 5\r\n\r\nabcd", 400),
    (b"DELETE /v1/blocks/01020304 HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n", 404),
    (b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n", 404),
])
async def test_refusals_are_aiohttps_and_change_nothing(
        server: PeerServer, request_bytes: bytes, status: int) -> None:
    conn = await Conn.open(server)
    await conn.send(request_bytes)
    assert (await conn.answer())[0] == status
    assert await server.segment.get(KEY) is None and await server.segment.get(b"\x05") is None
    assert server.budget.held == 0
    conn.close()


async def test_a_corrupt_frame_is_400_on_the_data_plane(server: PeerServer) -> None:
    frame = bytearray(frame_of(BLOCK))
    frame[-1] ^= 0xFF
    conn = await Conn.open(server)
    await conn.send(put_request(KEY, bytes(frame)))
    assert (await conn.answer())[0] == 400
    assert server.corrupt_frames == 1 and await server.segment.get(KEY) is None
    await conn.send(get_request(KEY))  # the connection still serves
    assert (await conn.answer())[0] == 404
    assert on_data_plane(server) == 1 and server.budget.held == 0
    conn.close()


async def test_a_put_past_the_inflight_budget_is_refused_with_retry_after(
        server: PeerServer) -> None:
    taken = server.budget.limit - server.budget.repair_reserve - 100  # the client share
    assert server.budget.try_take(taken)
    conn = await Conn.open(server)
    await conn.send(put_request(KEY, frame_of(BLOCK)))
    status, headers, _ = await conn.answer()
    assert status == 503 and headers["retry-after"] == "1"
    assert server.budget.refused == 1  # counted once, by the path that refused it
    assert await server.segment.get(KEY) is None
    server.budget.give(taken)
    conn.close()


async def test_a_stalled_body_is_408_and_stores_nothing(server: PeerServer) -> None:
    frame = frame_of(BLOCK)
    conn = await Conn.open(server)
    await conn.send(put_request(KEY, frame)[: -len(frame) // 2])
    status, headers, _ = await conn.answer()
    assert status == 408 and headers["connection"] == "close"
    assert await conn.closed_by_server()
    assert server.body_timeouts == 1 and server.budget.held == 0
    assert server.requests[("/v1/blocks/{key}", "PUT", 408)] == 1
    assert await server.segment.get(KEY) is None


async def test_a_client_gone_mid_body_frees_its_budget(server: PeerServer) -> None:
    frame = frame_of(BLOCK)
    conn = await Conn.open(server)
    await conn.send(put_request(KEY, frame)[: -100])
    for _ in range(100):
        if server.budget.held:
            break
        await asyncio.sleep(0.01)
    assert server.budget.held == len(frame)
    conn.close()
    for _ in range(200):
        if server.client_gone:
            break
        await asyncio.sleep(0.01)
    assert server.client_gone == 1 and server.budget.held == 0
    assert server.requests[("/v1/blocks/{key}", "PUT", 499)] == 1
    assert await server.segment.get(KEY) is None


async def test_an_idle_connection_is_closed() -> None:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, idle_timeout=0.2)
    await srv.start()
    try:
        conn = await Conn.open(srv)
        await conn.send(b"GET /v1/blo")  # a head that never completes
        assert await conn.closed_by_server()
        assert on_data_plane(srv) == 0
    finally:
        await srv.stop()


async def test_data_plane_connections_count_toward_the_cap() -> None:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, max_connections=2)
    await srv.start()
    try:
        first, second = await Conn.open(srv), await Conn.open(srv)
        for conn in (first, second):
            await conn.send(get_request(KEY))
            assert (await conn.answer())[0] == 404
        third = await Conn.open(srv)
        status, _, body = await third.answer()
        assert status == 503 and b"too many connections" in body
        assert srv.connections_refused == 1
        for conn in (first, second, third):
            conn.close()
    finally:
        await srv.stop()


async def test_batch_get_on_the_data_plane(server: PeerServer) -> None:
    from test_peer_protocol import key_list, parse_block_list

    await server.segment.put(KEY, BLOCK)
    body = key_list([KEY, b"\x07", KEY])
    conn = await Conn.open(server)
    await conn.send(b"POST /v1/batch/get HTTP/1.1\r\nHost: x\r\n" + AUTH
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    status, _, answer = await conn.answer()
    assert status == 200
    assert parse_block_list(answer) == [(KEY, frame_of(BLOCK)), (b"\x07", b""), (KEY, b"")]
    assert on_data_plane(server) == 1 and server.budget.held == 0
    assert server.requests[("/v1/batch/get", "POST", 200)] == 1
    conn.close()


async def test_stop_lets_a_request_in_progress_finish() -> None:
    class SlowGet(DRAMTier):
        async def get(self, key: bytes) -> np.ndarray | None:  # type: ignore[override]
            started.set()
            await asyncio.sleep(0.2)
            return await super().get(key)

    started = asyncio.Event()
    srv = PeerServer(SlowGet(), token=TOKEN, close_segment=True)
    await srv.start()
    await srv.segment.put(KEY, BLOCK)
    conn = await Conn.open(srv)
    await conn.send(get_request(KEY))
    await started.wait()
    await srv.stop()
    status, _, body = await conn.answer()
    assert status == 200 and body == frame_of(BLOCK)
    assert await conn.closed_by_server()


async def test_with_the_data_plane_off_aiohttp_serves_everything() -> None:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, data_plane=False)
    await srv.start()
    try:
        conn = await Conn.open(srv)
        await conn.send(put_request(KEY, frame_of(BLOCK)) + get_request(KEY))
        assert (await conn.answer())[0] == 204
        assert (await conn.answer())[2] == frame_of(BLOCK)
        assert on_data_plane(srv) == 0
        conn.close()
    finally:
        await srv.stop()


async def test_an_upgrade_request_is_answered_by_aiohttp(server: PeerServer) -> None:
    conn = await Conn.open(server)
    await conn.send(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + AUTH
                    + b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    status, _, body = await conn.answer()
    assert status == 200 and b"node_id" in body
    conn.close()


async def test_a_client_that_stops_reading_loses_its_connection_and_budget() -> None:
    from test_peer_protocol import key_list

    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, body_timeout=0.3,
                     limits=Limits(max_block_bytes=4 << 20, max_batch=16,
                                   max_body_bytes=64 << 20))
    await srv.start()
    try:
        keys = [bytes([i]) for i in range(8)]
        for key in keys:
            await srv.segment.put(key, np.full(4 << 20, 7, dtype=np.uint8))
        conn = await Conn.open(srv)
        body = key_list(keys)
        await conn.send(b"POST /v1/batch/get HTTP/1.1\r\nHost: x\r\n" + AUTH
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conn.writer.transport.pause_reading()  # takes nothing of the 32 MiB answer
        for _ in range(500):
            if srv.client_gone:
                break
            await asyncio.sleep(0.02)
        assert srv.client_gone == 1 and srv.budget.held == 0
        assert srv.requests[("/v1/batch/get", "POST", 499)] == 1
        conn.close()
    finally:
        await srv.stop()


@pytest.mark.parametrize("request_bytes", [
    get_request(KEY).replace(b"HTTP/1.1", b"HTTP/1.0"),
    get_request(KEY).replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"),
])
async def test_a_last_request_is_answered_then_the_connection_closes(
        server: PeerServer, request_bytes: bytes) -> None:
    await server.segment.put(KEY, BLOCK)
    conn = await Conn.open(server)
    await conn.send(request_bytes)
    status, _, body = await conn.answer()
    assert status == 200 and body == frame_of(BLOCK)
    assert await conn.closed_by_server(within=2.0)  # at once, not at the 5 s idle timeout


async def test_a_flood_of_empty_lines_is_skipped_in_one_step(server: PeerServer) -> None:
    await server.segment.put(KEY, BLOCK)
    conn = await Conn.open(server)
    await conn.send(b"\r\n" * 100_000 + get_request(KEY))
    status, _, body = await conn.answer()
    assert status == 200 and body == frame_of(BLOCK)
    assert on_data_plane(server) == 1
    conn.close()
