"""Stamps and tombstones on one server (kvtier.peer.versions, docs/peer-protocol.md,
"Stamps and tombstones"): the rule every write follows, the stamps route, the log that
keeps them across restarts, and the previous protocol's clients and servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from kvtier.codec import decode_frame, encode_frame
from kvtier.peer import protocol as proto
from kvtier.peer.client import PeerClient
from kvtier.peer.server import PeerServer
from kvtier.peer.versions import STAMP_HEADER, Versions, parse_stamps
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN, served_dram, start_app

KEY = b"\x07" * 16
OTHER = b"\x08" * 16


def block(i: int) -> np.ndarray:
    return np.full(256, i, dtype=np.uint16)


@pytest.mark.parametrize("data_plane", [True, False])
async def test_a_write_lands_only_if_newer_than_the_block_or_tombstone_held(
        data_plane: bool) -> None:
    async with served_dram(data_plane=data_plane) as (srv, http):
        url = srv.url + proto.block_path(KEY)

        async def put(i: int, stamp: int | None, query: str = "") -> int:
            headers = {} if stamp is None else {STAMP_HEADER: str(stamp)}
            async with http.put(url + query, headers=headers,
                                data=encode_frame(block(i), key=KEY).to_bytes()) as resp:
                return resp.status

        async def held() -> int | None:
            async with http.get(url) as resp:
                if resp.status == 404:
                    return None
                return int(decode_frame(await resp.read(), key=KEY)[0])

        async def delete(stamp: int) -> int:
            async with http.delete(url, headers={STAMP_HEADER: str(stamp)}) as resp:
                return resp.status

        async def stamps() -> list[tuple[int, int]]:
            async with http.post(srv.url + proto.BATCH_STAMPS_PATH,
                                 data=proto.encode_keys([KEY, OTHER])) as resp:
                return proto.decode_stamps(await resp.read(), 2)

        assert await put(1, 10) == 204 and await held() == 1
        assert await put(2, 5) == 204 and await held() == 1  # older: answered, not stored
        assert await stamps() == [(1, 10), (0, 0)]
        assert await delete(7) == 404 and await held() == 1  # older than the block
        assert await delete(20) == 204 and await held() is None
        assert await stamps() == [(2, 20), (0, 0)]
        assert await put(3, None, "?fill=1") == 204 and await held() is None  # a repair
        assert await put(4, 15, "?fill=1") == 204 and await held() is None  # older
        assert await put(5, 30) == 204 and await held() == 5  # newer than the delete
        assert await stamps() == [(1, 30), (0, 0)]
        # A client of before stamps: its plain put is newer than anything held here.
        assert await put(6, None) == 204 and await held() == 6
        assert (await stamps())[0][1] > 30
        async with http.put(url, headers={STAMP_HEADER: "soon"},
                            data=encode_frame(block(7), key=KEY).to_bytes()) as resp:
            assert resp.status == 400 and STAMP_HEADER in await resp.text()
        assert await held() == 6


async def test_batch_writes_carry_one_stamp_each() -> None:
    async with PeerServer(DRAMTier(), token=TOKEN, close_segment=True) as srv:
        client = PeerClient(srv.member_id, token=TOKEN, timeout=5)
        try:
            frames = [(KEY, encode_frame(block(1), key=KEY)),
                      (OTHER, encode_frame(block(1), key=OTHER))]
            await client.put_many(frames, stamps=[100, 200])
            assert await client.stamps_many([KEY, OTHER]) == [(1, 100), (1, 200)]
            newer = [(KEY, encode_frame(block(2), key=KEY)),
                     (OTHER, encode_frame(block(2), key=OTHER))]
            await client.put_many(newer, fill=True, stamps=[150, 150])  # a repair push
            got = [decode_frame(f, key=k)[0] if f is not None else None
                   for k, f in zip([KEY, OTHER], await client.get_many([KEY, OTHER]),
                                   strict=True)]
            assert got == [2, 1]  # newer than KEY's block only
            assert await client.delete_many([KEY, OTHER], stamps=[140, 300]) == [False, True]
            assert await client.stamps_many([KEY, OTHER]) == [(1, 150), (2, 300)]
        finally:
            await client.close()


async def test_a_server_of_before_stamps_reads_as_unknown_stamps() -> None:
    # The previous protocol's server: no stamps route (404), exists answered as before.
    async def exists(request: web.Request) -> web.Response:
        keys = proto.decode_keys(await request.read(), 1024)
        return web.Response(body=proto.encode_flags([k == KEY for k in keys]))

    app = web.Application()
    app.router.add_post(proto.BATCH_EXISTS_PATH, exists)
    runner, member = await start_app(app)
    client = PeerClient(member, token=TOKEN, timeout=5)
    try:
        assert await client.stamps_many([KEY, OTHER]) == [(1, 0), (0, 0)]
    finally:
        await client.close()
        await runner.cleanup()


def test_the_log_keeps_stamps_and_tombstones_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "seg.versions"
    log = Versions(path)
    log.stored(KEY, 10)
    log.stored(OTHER, 11)
    log.deleted(OTHER, 12)
    log.stored(b"gone", 13)
    log.forget(b"gone")
    asyncio.run(log.commit())  # what a write request awaits before its answer; no close
    with open(path, "ab") as out:
        out.write(b"\x01\x02\x03")  # a record cut short by the kill
    again = Versions(path)
    assert again.stamps == {KEY: 10} and again.tombs == {OTHER: (12, 0.0)}
    assert again.clock.next() > 13  # the clock never goes back behind what it wrote
    again.stored(KEY, 20)
    again.close()
    assert Versions(path).stamps == {KEY: 20}


def test_a_tombstone_goes_only_past_its_grace_once_settled() -> None:
    log = Versions(grace=5.0)
    log.deleted(KEY, 10)  # not settled: some owner may still miss it
    log.deleted(OTHER, 10, settled=True)
    settled_at = log.tombs[OTHER][1]
    assert log.expire(settled_at + 10) == 1 and list(log.tombs) == [KEY]
    log.settle(KEY, 10)
    assert log.expire(log.tombs[KEY][1] + 1) == 0 and log.expire(log.tombs[KEY][1] + 6) == 1
    assert log.admits(KEY, 1) is True  # gone past its grace: stamps start over


def test_stamp_headers_parse_strictly() -> None:
    assert parse_stamps("7", 3) == [7, 7, 7]
    assert parse_stamps("1,2,3", 3) == [1, 2, 3]
    assert parse_stamps(None, 2) is None
    for bad in ("", "1,2", "-1", "x", str(1 << 64)):
        with pytest.raises(ValueError, match=STAMP_HEADER):
            parse_stamps(bad, 3)


async def test_tombstones_settle_and_expire_in_a_quiet_pool() -> None:
    # Before: no pass runs in a quiet pool, so no tombstone ever settled or expired.
    from kvtier.peer.repair import AntiEntropy
    from kvtier.peer.tier import PeerTier
    from tests.helpers.peer_helpers import peer_servers, pool_url

    async with peer_servers(2) as servers:
        members = [s.member_id for s in servers]
        for s in servers:
            s.versions.grace = 1.0  # several recheck intervals: both settle before expiry
        repairs = [AntiEntropy(s, PeerTier.from_url(pool_url(members, replicas=2),
                                                    self=s.member_id, local=s.segment),
                               interval=0.2) for s in servers]
        try:
            for repair in repairs:
                await repair.start()
            async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
                await tier.put(KEY, block(1))
                assert await tier.delete(KEY)
            assert all(KEY in s.versions.tombs for s in servers)
            for _ in range(300):
                if not any(s.versions.tombs for s in servers):
                    break
                await asyncio.sleep(0.05)
            assert [len(s.versions.tombs) for s in servers] == [0, 0]
            assert sum(r.counts["tombstones_expired"] for r in repairs) == 2
        finally:
            for repair in repairs:
                await repair.close()
