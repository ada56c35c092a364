"""POST /v1/locate on real PeerServers (auth, limits) and the concurrent client's deadline."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from kvtier.peer import protocol as proto
from kvtier.peer.locate import (
    LOCATE_PATH,
    LocalPrefix,
    decode_answer,
    local_tiers,
    locate_prefix,
)
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.store import TieredStore
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier

TOKEN = "locate-test-token"
K = [bytes([i]) * 16 for i in range(1, 9)]
BLOCK = np.arange(64, dtype=np.uint8)


async def _server(tmp: Path, name: str) -> tuple[PeerServer, TieredStore]:
    segment = TieredStore([DRAMTier(1 << 20, name=f"dram-{name}"),
                           LMDBTier(tmp / name, capacity=1 << 22, name=f"lmdb-{name}")])
    server = PeerServer(segment, token=TOKEN, node_id=name, limits=proto.Limits(max_batch=16))
    await server.start()  # serves /v1/locate for its segment's local tiers
    return server, segment


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[list[tuple[PeerServer, TieredStore]]]:
    nodes = [await _server(tmp_path, n) for n in ("a", "b", "c")]
    (_, a), (_, b), _ = nodes
    dram_a, lmdb_a = a.tiers
    for key in K[:2]:
        await dram_a.put(key, BLOCK)
    for key in K[2:4]:
        await lmdb_a.put(key, BLOCK)
    await lmdb_a.put(K[5], BLOCK)  # after a gap: not part of the leading run
    await b.tiers[0].put(K[0], BLOCK)
    yield nodes
    for server, segment in nodes:
        await server.stop()
        await segment.aclose()


async def test_each_member_reports_its_local_leading_run(
        pool: list[tuple[PeerServer, TieredStore]]) -> None:
    members = [server.member_id for server, _ in pool]
    found = await asyncio.wait_for(locate_prefix(members, K, token=TOKEN, deadline=5.0), 10)
    a, b, c = members
    assert found[a] == LocalPrefix(4, "lmdb-a", {"dram-a": 2, "lmdb-a": 2})
    assert found[b] == LocalPrefix(1, "dram-b", {"dram-b": 1})
    assert found[c] == LocalPrefix(0, None, {})


async def test_a_slow_member_is_left_out_not_waited_for(
        pool: list[tuple[PeerServer, TieredStore]]) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="{}")

    app = web.Application()
    app.router.add_post(LOCATE_PATH, slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        members = [pool[0][0].member_id, f"{host}:{port}"]
        found = await asyncio.wait_for(
            locate_prefix(members, K, token=TOKEN, deadline=1.0), 10)
        assert list(found) == [members[0]] and found[members[0]].blocks == 4
    finally:
        release.set()
        await runner.cleanup()


async def test_refuses_unauthenticated_malformed_and_oversized_requests(
        pool: list[tuple[PeerServer, TieredStore]]) -> None:
    server, segment = pool[0]
    url = f"{server.url}{LOCATE_PATH}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = [await t.contains_many(K) for t in segment.tiers]
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=proto.encode_keys(K)) as resp:
            assert resp.status == 401
        async with http.post(url, data=b"\x05\x00\x00\x00\x10", headers=auth) as resp:
            assert resp.status == 400 and "truncated" in await resp.text()
        async with http.post(url, data=proto.encode_keys([b"k" * 16] * 17),
                             headers=auth) as resp:
            assert resp.status == 413
        async with http.post(url, data=proto.encode_keys([]), headers=auth) as resp:
            assert resp.status == 200
            assert decode_answer(await resp.read(), 0)[1] == LocalPrefix(0)
    assert [await t.contains_many(K) for t in segment.tiers] == before


def test_answers_are_validated_and_shared_tiers_are_not_local() -> None:
    with pytest.raises(proto.ProtocolError):
        decode_answer(b'{"node": "a", "blocks": 9, "tier": null, "by_tier": {"x": 9}}', 8)
    with pytest.raises(proto.ProtocolError):
        decode_answer(b'{"node": "a", "blocks": 2, "tier": "x", "by_tier": {"x": 1}}', 8)
    with pytest.raises(proto.ProtocolError):
        decode_answer(b"not json", 8)

    class Tier:
        def __init__(self, scheme: str) -> None:
            self.scheme = scheme

    tiers = [Tier("dram"), Tier("peers"), Tier("lmdb"), Tier("s3")]
    assert [t.scheme for t in local_tiers(tiers)] == ["dram", "lmdb"]


async def test_client_validates_arguments() -> None:
    with pytest.raises(ValueError, match="deadline"):
        await locate_prefix(["127.0.0.1:1"], K, token=None, deadline=0)
    with pytest.raises(TypeError, match="keys"):
        await locate_prefix(["127.0.0.1:1"], ["x"], token=None)  # type: ignore[list-item]
    assert await locate_prefix([], K, token=None) == {}


async def test_a_stalled_body_gets_408_and_bodies_past_the_inflight_budget_503() -> None:
    """/v1/locate reads its body like every other route: the body timeout and the
    in-flight budget apply."""
    limits = proto.Limits(max_block_bytes=1 << 20, max_body_bytes=1 << 20)
    async with PeerServer(DRAMTier(), token=TOKEN, limits=limits, body_timeout=0.3,
                          max_inflight_bytes=1 << 20) as server:
        head = (f"POST {LOCATE_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Length: 100\r\n\r\n").encode()
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(head + b"\x01\x00")  # then nothing more
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert server.body_timeouts == 1 and server.budget.held == 0

        assert server.budget.try_take(server.budget.limit - 50)  # others' bodies in flight
        try:
            async with aiohttp.ClientSession() as http, http.post(
                    f"{server.url}{LOCATE_PATH}", data=proto.encode_keys(K),
                    headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        finally:
            server.budget.give(server.budget.limit - 50)


async def test_infinite_timeout_is_no_limit_not_the_default_deadline() -> None:
    """``timeout=math.inf`` means no limit, as for every other verb (issue 20 bug 6: it was
    the 50 ms default, so a tier slower than that left this node out)."""
    slow = LatencyTier(DRAMTier(), delay=0.15)
    async with TieredStore([slow], node="solo") as store:
        await slow.inner.put(K[0], BLOCK)
        found = await store.locate_prefix(K[:2], timeout=math.inf)
        assert found.nodes == {"solo": LocalPrefix(1, slow.name, {slow.name: 1})}
        assert found.pool == 1


async def test_infinite_timeout_asks_pool_members_within_the_pool_timeout(
        pool: list[tuple[PeerServer, TieredStore]]) -> None:
    members = [server.member_id for server, _ in pool]
    async with TieredStore([PeerTier(members, token=TOKEN, timeout=5)], node="router") as store:
        found = await store.locate_prefix(K, timeout=math.inf)
    assert found.nodes[members[0]].blocks == 4 and found.nodes[members[1]].blocks == 1
