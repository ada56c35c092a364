"""Memory a cache hit lands in is mapped before the hit: the peer tier's reserved answer
buffers (``recv_reserve``) and the vLLM connector's staging area. A fresh multi-MiB buffer
pays a page fault per 4 KiB on its first write, which cost more than the copy itself on the
benchmark VM; these tests pin that the warm memory is taken, kept, and never handed to two
users at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import StagingArea, _warm_answer_buffers
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN
from tests.helpers.vllm_fakes import BLOCK, FakeEngine, Request


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_reserved_buffers_are_mapped_taken_first_and_kept_through_idle() -> None:
    async def run() -> None:
        pool = BodyBuffers(budget=64 << 20, linger=0.05)
        before = _rss_kib()
        await pool.reserve(8 << 20, 2)
        after = _rss_kib()
        assert after - before >= 15 << 10, "reserved buffers were not faulted in (KiB)"
        assert pool.reserved_bytes == 16 << 20 and pool.held_bytes == 0
        first = pool.take(6 << 20)
        second = pool.take(8 << 20)
        assert pool.reused == 2 and pool.held_bytes == 0  # both from the reserve
        third = pool.take(1 << 20)  # both reserved buffers are in use: a new one
        assert pool.reused == 2 and pool.held_bytes == 1 << 20
        del first, second, third
        await asyncio.sleep(0.2)  # past linger: held buffers go, reserved ones stay
        assert pool.held_bytes == 0 and pool.reserved_bytes == 16 << 20
        pool.clear()
        assert pool.reserved_bytes == 16 << 20
        again = pool.take(8 << 20)
        assert pool.reused == 3
        del again

    asyncio.run(run())


def test_a_reserved_buffer_still_referenced_is_not_taken_again() -> None:
    async def run() -> None:
        pool = BodyBuffers(budget=64 << 20)
        await pool.reserve(1 << 20, 1)
        held = np.frombuffer(pool.take(1 << 20), np.uint8)
        held[:] = 7
        other = np.frombuffer(pool.take(1 << 20), np.uint8)
        other[:] = 9
        assert np.all(held == 7)  # the second body did not land on the first's memory

    asyncio.run(run())


async def test_peer_tier_reserves_answer_buffers_at_open_and_reads_into_them() -> None:
    async with PeerServer(DRAMTier(), token=TOKEN, close_segment=True) as server:
        url = f"peers://{server.member_id}?token={TOKEN}&timeout=5&recv_reserve=8MiB"
        tier = PeerTier.from_url(url)
        await tier.open()
        async with tier:
            assert tier.stats()["answer_buffers_reserved"] == 8 << 20
            keys = [bytes([i]) * 16 for i in range(3)]
            blocks = [np.full(1 << 20, i + 1, dtype=np.uint8) for i in range(3)]
            await tier.put_many(list(zip(keys, blocks, strict=True)))
            got = await tier.get_many(keys)
            assert all(g is not None and np.array_equal(g, b)
                       for g, b in zip(got, blocks, strict=True))
            assert tier.stats()["answer_buffers_reused"] >= 1


def test_recv_reserve_is_validated() -> None:
    with pytest.raises(ConfigError, match="recv_reserve"):
        PeerTier.from_url(f"peers://127.0.0.1:1?token={TOKEN}&recv_reserve=lots")
    with pytest.raises(ConfigError, match="recv_reserve"):
        PeerTier(["127.0.0.1:1"], token=TOKEN, recv_reserve=-1)


def test_connector_reserves_answer_buffers_only_for_peer_tiers_that_did_not_choose() -> None:
    options = _warm_answer_buffers(["dram://?capacity=1GiB", "peers://h1:1,h2:2?token=t",
                                    "peers+dns://pool:7070", "peers://h3:3?recv_reserve=0",
                                    "file:///kv"], 16 << 20)
    assert set(options) == {"peers://h1:1,h2:2?token=t", "peers+dns://pool:7070"}
    assert all(o["recv_reserve"] >= 2 * (16 << 20) for o in options.values())
    assert _warm_answer_buffers(["peers://h1:1"], 0) == {}


# ---------------------------------------------------------------- staging area
def _fresh(log: list[int]) -> Callable[[int], np.ndarray]:
    def new(count: int) -> np.ndarray:
        log.append(count)
        return np.empty((count, 64), np.uint8)
    return new


def test_staging_rows_come_back_oldest_first_once_their_transfer_ended() -> None:
    area = StagingArea(np.empty((8, 64), np.uint8))
    fresh: list[int] = []
    a_rows = area.take(4, _fresh(fresh))
    a_done: concurrent.futures.Future[None] = concurrent.futures.Future()
    a_scattered = [False]
    area.hold(a_rows, a_done, lambda: a_scattered[0])
    b_rows = area.take(3, _fresh(fresh))
    b_done: concurrent.futures.Future[None] = concurrent.futures.Future()
    area.hold(b_rows, b_done)
    assert not np.shares_memory(a_rows, b_rows)
    assert fresh == [] and np.shares_memory(b_rows, area.rows)
    c_rows = area.take(2, _fresh(fresh))  # 7 of 8 rows held: a fresh array
    assert fresh == [2] and not np.shares_memory(c_rows, area.rows)
    a_done.set_result(None)  # ended, but a load's rows are not scattered yet: still held
    assert not np.shares_memory(area.take(2, _fresh(fresh)), area.rows) and fresh == [2, 2]
    a_scattered[0] = True
    d_rows = area.take(2, _fresh(fresh))  # wraps to the rows a gave back
    area.hold(d_rows, concurrent.futures.Future())
    assert fresh == [2, 2] and np.shares_memory(d_rows, a_rows)
    e_rows = area.take(2, _fresh(fresh))  # rows 2-3 are free, between d and b
    area.hold(e_rows, concurrent.futures.Future())
    assert fresh == [2, 2] and np.shares_memory(e_rows, a_rows)
    assert not np.shares_memory(e_rows, d_rows)
    area.take(1, _fresh(fresh))  # full
    assert fresh == [2, 2, 1]


def test_a_failed_or_abandoned_transfer_keeps_its_rows_and_the_area_maps_new_ones() -> None:
    area = StagingArea(np.empty((4, 64), np.uint8))
    fresh: list[int] = []
    old = area.rows
    a_rows = area.take(2, _fresh(fresh))
    a_done: concurrent.futures.Future[None] = concurrent.futures.Future()
    area.hold(a_rows, a_done)
    b_rows = area.take(2, _fresh(fresh))
    b_done: concurrent.futures.Future[None] = concurrent.futures.Future()
    area.hold(b_rows, b_done)
    a_done.cancel()  # abandoned: the store's thread may still be using its rows
    assert not np.shares_memory(area.take(2, _fresh(fresh)), old) and fresh == [2]
    b_done.set_exception(RuntimeError("failed"))
    rows = area.take(4, _fresh(fresh))  # nothing holds rows now: a new array
    assert fresh == [2] and np.shares_memory(rows, area.rows) and not np.shares_memory(rows, old)


def test_engine_loads_and_saves_reuse_their_staging_areas(tmp_path: Path) -> None:
    shared = {"tiers": ["dram://?capacity=4MiB", f"file://{tmp_path / 'pool'}"],
              "model": "tiny-test"}
    prompt = [(13 * i + 7) % 997 + 1 for i in range(22)]
    a = FakeEngine(shared)
    b = FakeEngine(shared)
    try:
        a.prefill(Request("a-1", prompt), [3, 9, 4, 10, 5, 11])
        a.finish(Request("a-1", prompt))
        other = [(7 * i + 3) % 991 + 1 for i in range(22)]
        a.prefill(Request("a-2", other), [12, 13, 14, 15, 16, 17])
        a.finish(Request("a-2", other))
        saves = a.worker._worker.save_staging
        assert saves is not None and saves.fresh == 0
        for n, ids in enumerate(([20, 2, 21, 1, 22, 0], [23, 24, 25, 26, 27, 28])):
            ext, _, errors = b.prefill(Request(f"b-{n}", prompt if n == 0 else other), ids)
            assert ext == 5 * BLOCK and errors == set()
            b.finish(Request(f"b-{n}", prompt if n == 0 else other))
        loads = b.worker._worker.staging
        assert loads is not None and loads.fresh == 0
        assert b.block_bytes(23) == a.block_bytes(12)  # the second load, same rows: right bytes
    finally:
        b.close()
        a.close()


async def test_server_batch_put_bodies_land_in_reserved_then_reused_buffers() -> None:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, body_reserve=8 << 20)
    async with server:
        assert server._bodies.reserved_bytes == 8 << 20
        tier = PeerTier.from_url(f"peers://{server.member_id}?token={TOKEN}&timeout=5")
        async with tier:
            for round_ in range(3):
                items = [(bytes([round_, i]) * 8, np.full(1 << 20, i + round_, np.uint8))
                         for i in range(3)]  # a 3 MiB batch PUT: fits a 4 MiB reserved one
                await tier.put_many(items)
                got = await tier.get_many([k for k, _ in items])
                assert all(g is not None and np.array_equal(g, b)
                           for g, (_, b) in zip(got, items, strict=True))
            # Every body was taken from the pool (the reserved buffers), none mapped anew.
            assert server._bodies.reused >= 3 and server._bodies.held_bytes == 0


def test_body_reserve_is_validated() -> None:
    with pytest.raises(ConfigError, match="body_reserve"):
        PeerServer(DRAMTier(), token=TOKEN, body_reserve=-1)
