"""Memory a cache hit lands in is mapped before the hit: the peer tier's reserved answer
buffers (``recv_reserve``) and the vLLM connector's staging area. A fresh multi-MiB buffer
pays a page fault per 4 KiB on its first write, which cost more than the copy itself on the
benchmark VM; these tests pin that the warm memory is taken, kept, and never handed to two
users at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import StagingArea, _Load, _warm_answer_buffers
from kvtier.integrations.vllm_plan import BlockPlan
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN


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
def _load(rows: np.ndarray) -> _Load:
    plan = BlockPlan(req_id="r", tokens=[], salt="", first=0, block_ids=list(range(len(rows))))
    return _Load(plan, concurrent.futures.Future(), rows)


def test_staging_rows_are_reused_only_after_every_holder_was_scattered_and_ended() -> None:
    area = StagingArea(np.empty((8, 64), np.uint8))
    fresh: list[int] = []

    def new(count: int) -> np.ndarray:
        fresh.append(count)
        return np.empty((count, 64), np.uint8)

    a = _load(area.take(4, new))
    area.hold(a)
    b = _load(area.take(3, new))
    area.hold(b)
    assert not np.shares_memory(a.staging, b.staging)
    c = area.take(2, new)  # 7 of 8 rows are held: a fresh array
    assert fresh == [2] and not np.shares_memory(c, area.rows)
    a.scattered = True
    a.future.set_result([True])
    assert np.shares_memory(area.take(1, new), area.rows)  # b still holds rows 4-6: row 7
    b.scattered = True  # scattered, but its read has not ended: still held
    assert fresh == [2]
    assert not np.shares_memory(area.take(1, new), area.rows) and fresh == [2, 1]
    b.future.set_result([True])
    again = area.take(4, new)
    assert np.shares_memory(again, a.staging)  # everything ended: from the start again


def test_a_cancelled_load_keeps_its_rows_and_the_area_maps_new_ones() -> None:
    area = StagingArea(np.empty((4, 64), np.uint8))
    old = area.rows
    a = _load(area.take(4, lambda n: np.empty((n, 64), np.uint8)))
    area.hold(a)
    a.future.cancel()  # abandoned at its timeout: the store's thread may still write it
    a.scattered = True
    rows = area.take(4, lambda n: np.empty((n, 64), np.uint8))
    assert np.shares_memory(rows, area.rows) and not np.shares_memory(rows, old)
