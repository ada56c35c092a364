"""Rolling upgrade: a client and servers one protocol version apart keep serving.

Protocol 1 servers announce no version; the first of them answered version-1 frames (not
bound to their key). Protocol 2 servers announce ``Kvtier-Protocol: 2`` on every block
answer and answer only key-bound frames. The previous version's side of each exchange is
written here from docs/peer-protocol.md, byte for byte, not with this version's code."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
from aiohttp import web

from kvtier.codec import KEYED_FORMAT_VERSION, decode_frame, encode_frame, parse_header
from kvtier.peer import protocol as proto
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN, served_dram, start_app

KEYS = [bytes([i]) * 16 for i in range(1, 9)]
BLOCKS = {k: np.full(1024, i, dtype=np.uint16) for i, k in enumerate(KEYS)}


@asynccontextmanager
async def old_server(*, announce: int | None = None, bound: bool = False
                     ) -> AsyncIterator[str]:
    """A peer server of another version: answers the blocks above as version-1 frames
    (``bound``: version 2), announcing ``announce`` (``None``: no version header, as
    protocol 1 did)."""
    headers = {} if announce is None else {proto.VERSION_HEADER: str(announce)}

    def frame(key: bytes) -> bytes:
        return encode_frame(BLOCKS[key], key=key if bound else None).to_bytes()

    async def get_block(request: web.Request) -> web.Response:
        key = bytes.fromhex(request.match_info["key"])
        if key not in BLOCKS:
            return web.Response(status=404, text="no such block")
        return web.Response(body=frame(key), headers=headers,
                            content_type=proto.CONTENT_TYPE)

    async def batch_get(request: web.Request) -> web.Response:
        keys = proto.decode_keys(await request.read(), 1024)
        body = b"".join(bytes(b) for b in proto.encode_blocks(
            [(k, encode_frame(BLOCKS[k], key=k if bound else None) if k in BLOCKS else None)
             for k in keys]))
        return web.Response(body=body, headers=headers, content_type=proto.CONTENT_TYPE)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "protocol": announce or 1, "uptime_s": 1e6})

    app = web.Application()
    app.router.add_get(proto.BLOCK_PATH, get_block)
    app.router.add_post(proto.BATCH_GET_PATH, batch_get)
    app.router.add_get(proto.HEALTH_PATH, health)
    runner, member = await start_app(app)
    try:
        yield member
    finally:
        await runner.cleanup()


async def read_all(member: str) -> tuple[list[bool], list[bool]]:
    """Which blocks a client of this version reads from ``member``: one by one and batched."""
    async with PeerTier([member], token=TOKEN, timeout=5) as tier:
        singles = [await tier.get(k) is not None for k in KEYS]
        batch = await tier.get_many(KEYS)
        for key, block in zip(KEYS, batch, strict=True):
            assert block is None or np.array_equal(block, BLOCKS[key])
        return singles, [b is not None for b in batch]


async def test_a_client_reads_a_protocol_1_servers_unbound_frames() -> None:
    # Before: every answer of a server one version back was a miss ("not bound to its key").
    async with old_server() as member:
        assert await read_all(member) == ([True] * 8, [True] * 8)


async def test_a_protocol_2_server_gets_no_downgrade_to_unbound_frames() -> None:
    # A server that announces protocol 2 must answer key-bound frames: unbound ones are
    # misses, as another key's frame would be.
    async with old_server(announce=2) as member:
        assert await read_all(member) == ([False] * 8, [False] * 8)
    async with old_server(announce=2, bound=True) as member:
        assert await read_all(member) == ([True] * 8, [True] * 8)


@pytest.mark.parametrize("data_plane", [True, False])
async def test_block_answers_announce_the_version_on_both_request_paths(
        data_plane: bool) -> None:
    async with served_dram(data_plane=data_plane) as (srv, http):
        await srv.segment.put(KEYS[0], BLOCKS[KEYS[0]])
        base = f"http://{srv.member_id}"
        for method, path, body in (("GET", proto.block_path(KEYS[0]), None),
                                   ("HEAD", proto.block_path(KEYS[0]), None),
                                   ("POST", proto.BATCH_GET_PATH, proto.encode_keys(KEYS))):
            async with http.request(method, base + path, data=body) as resp:
                assert resp.status == 200
                assert resp.headers[proto.VERSION_HEADER] == str(proto.VERSION)


async def test_a_previous_clients_requests_are_served() -> None:
    # The previous client sends no version header and accepts only frames bound to the key
    # it asked for (what protocol 1 clients of the key-bound release did).
    async with PeerServer(DRAMTier(), token=TOKEN, close_segment=True) as srv:
        reader, writer = await asyncio.open_connection(srv.host, srv.port)
        fixed = f"Host: {srv.member_id}\r\nAuthorization: Bearer {TOKEN}\r\n"

        async def ask(method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
            writer.write(f"{method} {path} HTTP/1.1\r\n{fixed}Content-Length: {len(body)}"
                         f"\r\n\r\n".encode() + body)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = int(head.split("content-length:")[1].split("\r\n")[0]) \
                if "content-length:" in head else 0
            return int(head.split()[1]), await reader.readexactly(length)

        key = KEYS[0]
        assert (await ask("PUT", proto.block_path(key),
                          encode_frame(BLOCKS[key], key=key).to_bytes()))[0] == 204
        assert (await ask("PUT", proto.block_path(KEYS[1]),
                          encode_frame(BLOCKS[KEYS[1]]).to_bytes()))[0] == 204  # version 1
        status, frame = await ask("GET", proto.block_path(key))
        assert status == 200 and parse_header(frame).version == KEYED_FORMAT_VERSION
        assert np.array_equal(decode_frame(frame, key=key), BLOCKS[key])
        status, body = await ask("POST", proto.BATCH_GET_PATH, proto.encode_keys(KEYS[:2]))
        entries = proto.decode_blocks(body, 2, 1 << 20)
        assert status == 200 and [k for k, _ in entries] == KEYS[:2]
        for k, f in entries:
            assert f is not None and np.array_equal(decode_frame(f, key=k), BLOCKS[k])
        status, doc = await ask("GET", proto.HEALTH_PATH)
        assert json.loads(doc)["protocol"] == proto.VERSION == 2
        writer.close()


async def test_a_mixed_pool_reads_from_both_versions() -> None:
    # Mid-upgrade: one member still on protocol 1, one on protocol 2, every block on both.
    async with old_server() as old, PeerServer(DRAMTier(), token=TOKEN,
                                               close_segment=True) as new:
        for key, block in BLOCKS.items():
            await new.segment.put(key, block)
        async with PeerTier([old, new.member_id], token=TOKEN, replicas=2, timeout=5) as tier:
            got = await tier.get_many(KEYS)
            assert all(np.array_equal(g, BLOCKS[k]) for k, g in zip(KEYS, got, strict=True))
            assert tier.counts["corrupt"] == 0
