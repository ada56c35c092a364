"""PeerTier against real in-process PeerServers on loopback: conformance, pooling, batching."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvtier import open_store
from kvtier.errors import ConfigError
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.registry import tier_from_url
from tests.helpers.peer_helpers import TOKEN, SlowSegments, peer_servers


class TestPeerConformance(SlowSegments, TierConformance):
    bounded = False

    @pytest.fixture(autouse=True)
    async def _servers(self) -> AsyncIterator[None]:
        self.servers: list[PeerServer] = []
        yield
        for server in self.servers:
            await server.stop()

    async def make_tier(self, capacity: int | None) -> Tier:
        # The served segment takes no time until slow_backend slows it down.
        server = PeerServer(LatencyTier(DRAMTier(capacity), delay=0.0), token=TOKEN,
                            close_segment=True)
        await server.start()
        self.servers.append(server)
        return tier_from_url(f"peers://{server.member_id}?token={TOKEN}&timeout=2")


@pytest.fixture
async def pool() -> AsyncIterator[list[PeerServer]]:
    async with peer_servers(3) as servers:
        yield servers


def _url(servers: list[PeerServer], **opts: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"token": TOKEN, "timeout": 2, **opts}.items())
    return f"peers://{','.join(s.member_id for s in servers)}?{query}"


def _held(server: PeerServer) -> int:
    return len(server.segment)  # type: ignore[arg-type]


async def test_replicas_land_on_distinct_owners(pool: list[PeerServer]) -> None:
    tier = tier_from_url(_url(pool, replicas=2))
    assert isinstance(tier, PeerTier)
    async with tier:
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(60)])
        await tier.put(key_of(1000), sample_block(1000))
        assert sum(_held(s) for s in pool) == 61 * 2
        assert all(_held(s) > 0 for s in pool)
        for i in (0, 17, 59):
            owners = tier.members.ring.owners(key_of(i), 2)
            holders = [s.member_id for s in pool if await s.segment.get(key_of(i)) is not None]
            assert sorted(holders) == sorted(owners)


async def test_two_nodes_read_each_others_blocks(pool: list[PeerServer]) -> None:
    """The P2P pooling claim: node A's blocks are readable by node B and vice versa."""
    a_server, b_server = pool[0], pool[1]
    url = _url(pool, replicas=1)
    node_a = PeerTier.from_url(url, self=a_server.member_id, local=a_server.segment)
    node_b = PeerTier.from_url(url, self=b_server.member_id, local=b_server.segment)
    async with node_a, node_b:
        await node_a.put_many([(key_of(i), sample_block(i)) for i in range(40)])
        await node_a.put(key_of(40), sample_block(40))
        # Node A's own keys went straight into its segment: its server saw no request.
        assert sum(a_server.requests.values()) == 0
        owned_by_a = [i for i in range(41)
                      if node_a.members.ring.primary(key_of(i)) == a_server.member_id]
        assert owned_by_a
        assert all([await a_server.segment.contains(key_of(i)) for i in owned_by_a])
        await node_b.put_many([(key_of(100 + i), sample_block(100 + i)) for i in range(40)])
        got_b = await node_b.get_many([key_of(i) for i in range(40)])
        got_a = await node_a.get_many([key_of(100 + i) for i in range(40)])
        assert all(g is not None and g.tobytes() == sample_block(i).tobytes()
                   for i, g in enumerate(got_b))
        assert all(g is not None and g.tobytes() == sample_block(100 + i).tobytes()
                   for i, g in enumerate(got_a))
        one = await node_b.get(key_of(3))
        assert one is not None and one.tobytes() == sample_block(3).tobytes()
        assert await node_a.contains_many([key_of(5), key_of(105), key_of(999)]) == \
            [True, True, False]


async def test_batch_is_one_request_per_owner(pool: list[PeerServer]) -> None:
    tier = PeerTier.from_url(_url(pool))
    async with tier:
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(30)])
        before = {s.member_id: sum(s.requests.values()) for s in pool}
        got = await tier.get_many([key_of(i) for i in range(30)])
        assert all(g is not None for g in got)
        assert await tier.contains_many([key_of(i) for i in range(30)]) == [True] * 30
        for s in pool:
            assert sum(s.requests.values()) - before[s.member_id] == 2


async def test_store_get_many_into_a_peer_top_tier_is_one_request_per_owner(
        pool: list[PeerServer]) -> None:
    # A store whose top tier is the pool (no DRAM above it) once asked each key separately:
    # 30 round trips where a batch needs one per owner.
    async with open_store([_url(pool)]) as store:
        await store.put_many([(key_of(i), sample_block(i)) for i in range(30)])
        await store.flush()
        before = {s.member_id: sum(s.requests.values()) for s in pool}
        outs = [np.empty_like(sample_block(i)) for i in range(30)]
        assert await store.get_many_into([key_of(i) for i in range(30)], outs) == [True] * 30
        assert all(o.tobytes() == sample_block(i).tobytes() for i, o in enumerate(outs))
        for s in pool:
            assert sum(s.requests.values()) - before[s.member_id] <= 1


async def test_compressed_puts_roundtrip(pool: list[PeerServer]) -> None:
    tier = PeerTier.from_url(_url(pool, compress="zstd:3"))
    block = np.zeros((64, 128), dtype="<f2")
    block[::3] = 1.5
    async with tier:
        await tier.put(key_of(1), block)
        await tier.put_many([(key_of(2), block), (key_of(3), block)])
        for k in (1, 2, 3):
            got = await tier.get(key_of(k))
            assert got is not None and got.dtype == block.dtype and np.array_equal(got, block)
    assert sum(s.bytes_in for s in pool) < 3 * block.nbytes // 4


async def test_ack_one_returns_and_copies_complete(pool: list[PeerServer]) -> None:
    tier = PeerTier.from_url(_url(pool, replicas=3, ack="one"))
    block = sample_block(7)
    async with tier:
        await tier.put(key_of(7), block)
        block[:] = 0  # the caller reuses its buffer at once
        await tier.flush()
    for s in pool:
        got = await s.segment.get(key_of(7))
        assert got is not None and got.tobytes() == sample_block(7).tobytes()


async def test_delete_reaches_every_copy(pool: list[PeerServer]) -> None:
    tier = PeerTier.from_url(_url(pool, replicas=2))
    async with tier:
        await tier.put(key_of(1), sample_block(1))
        assert await tier.delete(key_of(1)) is True
        assert [await s.segment.contains(key_of(1)) for s in pool] == [False] * 3
        assert await tier.delete(key_of(1)) is False


@pytest.mark.parametrize("url", [
    "peers://", "peers://h1", "peers://h1:7070?replicas=0", "peers://h1:7070?ack=some",
    "peers://h1:7070?timeout=-1", "peers://h1:7070?compress=lz4", "peers://h1:7070?bogus=1",
    "peers://h1:7070?self=h9:7070", "peers+dns://a:1,b:2", "peers://::1:7070",
    "peers://h1:7070/path", "peers://h1:7070?token=env:KVTIER_NO_SUCH_VAR",
    "peers://h1:7070?timeout=nan", "peers://h1:7070?health_interval=nan",
])
def test_bad_urls_rejected(url: str) -> None:
    with pytest.raises(ConfigError):
        tier_from_url(url)


def test_url_options_parsed() -> None:
    tier = tier_from_url("peers://h1:7070,[::1]:7071?replicas=2&self=h1:7070&timeout=0.25"
                         "&ack=one&compress=zstd:5&vnodes=64&health_interval=1")
    assert isinstance(tier, PeerTier)
    assert tier.members.members == ("[::1]:7071", "h1:7070")
    assert (tier.replicas, tier.timeout, tier.ack, tier.compress_level) == (2, 0.25, "one", 5)
    assert tier.members.ring.vnodes == 64 and tier.capacity is None


async def test_read_path_survives_server_restart_on_same_port() -> None:
    """Pooled keep-alive connections closed by the server are retried, not a dead peer."""
    first = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await first.start()
    port = first.port
    tier = PeerTier.from_url(f"peers://{first.member_id}?token={TOKEN}&timeout=2")
    async with tier:
        await tier.put(key_of(1), sample_block(1))
        assert await tier.get_many([key_of(1), key_of(2)]) is not None
        assert await tier.get(key_of(1)) is not None
        await first.stop()
        second = PeerServer(DRAMTier(), token=TOKEN, port=port, close_segment=True)
        await second.start()
        try:
            await second.segment.put(key_of(1), sample_block(1))
            got = await tier.get(key_of(1))
            assert got is not None and got.tobytes() == sample_block(1).tobytes()
            assert tier.members.alive(second.member_id) and tier.counts["errors"] == 0
        finally:
            await second.stop()


@pytest.mark.parametrize("answer", [
    b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\nno length",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nKVTB", b"HTTP/1.1 500 Oops\r\n"
    b"Content-Length: 0\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nKVTB",
])
async def test_malformed_answers_are_misses(answer: bytes) -> None:
    import asyncio

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tier = PeerTier.from_url(f"peers://127.0.0.1:{port}?token={TOKEN}&timeout=0.3")
    async with server, tier:
        assert await tier.get(key_of(1)) is None
        assert await tier.get_many([key_of(1), key_of(2)]) == [None, None]


async def test_read_buffers_are_reused_only_when_nothing_holds_them() -> None:
    async with PeerServer(DRAMTier(), token=TOKEN, close_segment=True) as server:
        tier = PeerTier.from_url(f"peers://{server.member_id}?token={TOKEN}&timeout=5")
        async with tier:
            keys = [bytes([i]) * 16 for i in range(3)]
            blocks = [np.full(1 << 20, i + 1, dtype=np.uint8) for i in range(3)]
            await tier.put_many(list(zip(keys, blocks, strict=True)))
            buffers = tier.members.client(server.member_id)._raw.buffers
            held = [await tier.get(keys[0]), *(await tier.get_many(keys[1:]))]
            for _ in range(3):  # held arrays pin their buffers: these reads must not take them
                await tier.get(keys[2])
                await tier.get_many(keys[:2])
            reused = buffers.reused
            assert all(h is not None and np.array_equal(h, b)
                       for h, b in zip(held, blocks, strict=True))
            del held
            for _ in range(3):  # released buffers come back
                got = await tier.get(keys[0])
                assert got is not None and np.array_equal(got, blocks[0])
            assert buffers.reused > reused
