"""PeerTier against misbehaving or refusing peers: auth probed at open, 4xx answers that
leave a peer healthy, a decompression bomb that is one peer's miss, ``ack``/``min_copies``
made true, and ``ack=one`` copies that survive a cancelled put. Real servers on loopback."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest
import xxhash
from aiohttp import web

from kvtier.codec import FLAG_ZSTD
from kvtier.errors import ConfigError, PeerError
from kvtier.peer import protocol as proto
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.store import open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import FailingTier, LatencyTier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.load import Scale
from tests.helpers.peer_helpers import TOKEN, Pool, peer_servers


@pytest.fixture
async def two() -> AsyncIterator[list[PeerServer]]:
    async with peer_servers(2) as servers:
        yield servers


def _url(members: list[str], **opts: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"token": TOKEN, "timeout": 2, **opts}.items())
    return f"peers://{','.join(members)}?{query}"


# ------------------------------------------------------------------ item 3: auth at open
async def test_open_store_with_a_token_every_member_refuses_raises(
        two: list[PeerServer], caplog: pytest.LogCaptureFixture) -> None:
    members = [s.member_id for s in two]
    secret = "not-the-pool-token-123"
    with pytest.raises(ConfigError, match="refused the bearer token") as info:
        await open_store([f"peers://{','.join(members)}?token={secret}&timeout=2"])
    assert secret not in str(info.value)


async def test_open_store_with_unreachable_members_only_warns(
        two: list[PeerServer], caplog: pytest.LogCaptureFixture) -> None:
    # A member that is not listening yet (pools start in any order) is a warning.
    down = "127.0.0.1:9"
    with caplog.at_level(logging.WARNING, logger="kvtier.peer.tier"):
        store = await open_store([_url([two[0].member_id, down])])
    async with store:
        await store.put(key_of(1), sample_block(1))
        assert await store.get(key_of(1)) is not None
    assert "unreachable at open" in caplog.text


# --------------------------------------------------------- item 5: 4xx keeps a peer alive
async def test_a_4xx_answer_does_not_take_the_peer_out(two: list[PeerServer]) -> None:
    small = PeerServer(DRAMTier(), token=TOKEN, limits=proto.Limits(max_block_bytes=4096),
                       close_segment=True)
    await small.start()
    try:
        async with PeerTier.from_url(_url([small.member_id])) as tier:
            await tier.put(key_of(1), sample_block(1, nbytes=1024))
            with pytest.raises(PeerError):
                await tier.put(key_of(2), np.zeros(64 << 10, dtype=np.uint8))  # 413
            assert tier.members.alive(small.member_id)
            assert tier.stats()["member_failures"] == 0
            assert await tier.get(key_of(1)) is not None  # still in the read path
    finally:
        await small.stop()


# ------------------------------------------- item 14: a bomb is one peer's miss, not a crash
def _bomb_frame() -> bytes:
    """A valid-checksum zstd frame declaring 1 TiB of content (the codec's ratio check
    passes with a 32 MiB payload): decoding it raises MemoryError."""
    raw = 1 << 40
    zstd = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", raw)
    zstd += ((1000 << 3) | (1 << 1) | 1).to_bytes(3, "little") + b"\x00"  # one RLE block
    pad = 32 << 20
    payload = zstd + struct.pack("<II", 0x184D2A50, pad) + bytes(pad)  # skippable frame
    head = (b"KVTB" + bytes([1, FLAG_ZSTD, 1, 3]) + struct.pack("<QQQ", raw, len(payload), raw)
            + b"|u1")
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + payload)) + payload


@pytest.fixture
async def bomber() -> AsyncIterator[str]:
    bomb = _bomb_frame()

    async def block(request: web.Request) -> web.Response:
        return web.Response(body=bomb)

    async def batch(request: web.Request) -> web.Response:
        keys = proto.decode_keys(await request.read(), 1024)
        body = struct.pack("<I", len(keys)) + b"".join(
            struct.pack("<H", len(k)) + k + struct.pack("<Q", len(bomb)) + bomb for k in keys)
        return web.Response(body=body)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "uptime_s": 1.0})

    app = web.Application()
    app.router.add_get(proto.BLOCK_PATH, block)
    app.router.add_post(proto.BATCH_GET_PATH, batch)
    app.router.add_get(proto.HEALTH_PATH, health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"{host}:{port}"
    await runner.cleanup()


async def test_a_decompression_bomb_is_a_miss_for_that_peer_only(
        bomber: str, two: list[PeerServer]) -> None:
    healthy = two[0]
    async with PeerTier.from_url(_url([bomber, healthy.member_id], replicas=2)) as tier:
        keys = [k for k in (key_of(i) for i in range(200))
                if tier.members.ring.primary(k) == bomber][:3]
        assert keys
        for i, key in enumerate(keys):
            await healthy.segment.put(key, sample_block(i))
        assert np.array_equal(await tier.get(keys[0]), sample_block(0))  # type: ignore[arg-type]
        assert tier.stats()["corrupt"] == 1
        assert tier.members.alive(bomber)  # bad data is not a transport failure
        got = await tier.get_many(keys)
        assert all(np.array_equal(g, sample_block(i)) for i, g in enumerate(got))  # type: ignore[arg-type]


# --------------------------------------------------------- item 15: ack=all means replicas
async def test_ack_all_raises_when_fewer_than_replicas_copies_were_made() -> None:
    # Two of three owners fail the write (500): a hint stands in for one missing copy at
    # most, so the put raises.
    async with peer_servers(3, lambda: FailingTier(DRAMTier())) as three:
        members = [s.member_id for s in three]
        async with PeerTier.from_url(_url(members, replicas=3, health_interval=60)) as tier:
            await tier.put(key_of(1), sample_block(1))
            for server in three[1:]:
                server.segment.fail = {"put"}  # type: ignore[attr-defined]
            with pytest.raises(PeerError, match="1 of 3 copies"):
                await tier.put(key_of(2), sample_block(2))
            assert tier.stats()["copies_made"] == 3 + 1
            with pytest.raises(PeerError, match="fewer than 3"):
                await tier.put_many([(key_of(3), sample_block(3)),
                                     (key_of(4), sample_block(4))])
            assert tier.stats()["puts_under_replicated"] == 3
        # min_copies=1 accepts one copy and says so in stats.
        async with PeerTier.from_url(_url(members, replicas=3, min_copies=1)) as lenient:
            await lenient.put(key_of(5), sample_block(5))
            assert lenient.stats()["copies_made"] == 1
            assert lenient.stats()["puts_under_replicated"] == 1


# ------------------------------------------- item 10: ack=one copies outlive a cancelled put
async def test_cancelled_ack_one_put_copies_complete_and_flush_waits() -> None:
    async with peer_servers(2, lambda: LatencyTier(DRAMTier(), delay=0.4)) as servers, \
            PeerTier.from_url(_url([s.member_id for s in servers], replicas=2,
                                   ack="one")) as tier:
        put = asyncio.create_task(tier.put(key_of(1), sample_block(1)))
        await asyncio.sleep(0.15)  # both copies in flight, none acknowledged
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        await tier.flush()
        for s in servers:  # the inner DRAM, without the latency wrapper's delay
            assert await s.segment.inner.contains(key_of(1))  # type: ignore[attr-defined]


# ------------------------------- ack=all with one of two owners down (docs/peer-pool.md)
async def test_ack_all_with_an_owner_down_returns_one_copy_and_a_hint_then_both() -> None:
    """What the docs promise for ``ack=all``, ``replicas=2`` with one owner down: every put
    returns holding one copy plus a hint (not both replicas: the docs said so before), and
    once the owner is back the hints make the second copy, with no put of the caller's."""
    pool = Pool()
    a, b = await pool.start(), await pool.start()
    n = 40
    keys = [key_of(i) for i in range(n)]
    try:
        async with PeerTier.from_url(_url([a, b], replicas=2, ack="all",
                                          health_interval=0.05)) as tier:
            port_b = int(b.rpartition(":")[2])
            await pool.stop(b)
            for i, key in enumerate(keys):
                await tier.put(key, sample_block(i))  # acked: raises on fewer copies
            stats = tier.stats()
            # Counted as under-replicated when they returned: one copy of two, and a hint.
            assert stats["hints"] == n and stats["puts_under_replicated"] == n
            assert sum(await pool.servers[a].segment.contains_many(keys)) == n  # one each
            await pool.start(port_b)  # b back (empty): the hints go to it
            scale = Scale()
            for _ in range(int(scale(30) / 0.05)):
                if tier.stats()["hints"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert tier.stats()["hints"] == 0
            assert sum(await pool.servers[b].segment.contains_many(keys)) == n  # the second
    finally:
        await pool.close()
