"""Admission by rate, not only by gap: slow uploaders that keep just above ``min_body_rate``
cannot hold most of the in-flight budget while other clients get 503 (both request paths)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from kvtier.codec import encode_frame
from kvtier.peer.guards import SHARE_SECONDS, BodyBudget
from kvtier.peer.protocol import Limits
from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN

AUTH = f"Authorization: Bearer {TOKEN}\r\n"
MiB = 1 << 20


def test_the_required_rate_is_the_floor_until_the_budget_is_half_held() -> None:
    budget = BodyBudget(8 * MiB)
    assert budget.required_rate(2 * MiB, 64 << 10) == 64 << 10
    assert budget.try_take(5 * MiB)
    assert budget.required_rate(2 * MiB, 64 << 10) == 2 * MiB / SHARE_SECONDS
    assert budget.required_rate(1024, 64 << 10) == 64 << 10  # a small body: the floor
    assert budget.required_rate(2 * MiB, 0) == 0  # min_body_rate=0: both off


@asynccontextmanager
async def serving(data_plane: bool) -> AsyncIterator[PeerServer]:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, data_plane=data_plane,
                     body_timeout=10.0, min_body_rate=64 << 10, max_inflight_bytes=7 * MiB,
                     limits=Limits(max_block_bytes=2 * MiB, max_body_bytes=2 * MiB))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


def _frame(i: int, nbytes: int) -> bytes:
    return encode_frame(np.full(nbytes, i, np.uint8), key=bytes([i]) * 8).to_bytes()


async def _slow_put(srv: PeerServer, i: int, progress: list[int]) -> int:
    """PUT a ~2 MiB frame at about 128 KiB/s (twice the floor); its status (0: none)."""
    frame = _frame(i, 2 * MiB - 4096)
    reader, writer = await asyncio.open_connection(srv.host, srv.port)
    try:
        writer.write(f"PUT /v1/blocks/{(bytes([i]) * 8).hex()} HTTP/1.1\r\nHost: x\r\n{AUTH}"
                     f"Content-Length: {len(frame)}\r\n\r\n".encode())
        step = 16 << 10
        for start in range(0, len(frame), step):
            writer.write(frame[start:start + step])
            progress[i] = start + step
            try:
                async with asyncio.timeout(0.125):
                    line = await reader.readline()
            except TimeoutError:
                continue
            return int(line.split()[1]) if line else 0
        async with asyncio.timeout(10):
            line = await reader.readline()
        return int(line.split()[1]) if line else 0
    except ConnectionError:
        return 0
    finally:
        writer.close()


async def _fast_put(srv: PeerServer) -> int:
    frame = _frame(99, 3 * MiB // 2)  # more than the room three slow bodies leave
    reader, writer = await asyncio.open_connection(srv.host, srv.port)
    try:
        writer.write(f"PUT /v1/blocks/{(bytes([99]) * 8).hex()} HTTP/1.1\r\nHost: x\r\n{AUTH}"
                     f"Content-Length: {len(frame)}\r\n\r\n".encode() + frame)
        async with asyncio.timeout(10):
            line = await reader.readline()
        return int(line.split()[1]) if line else 0
    finally:
        writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", [True, False])
async def test_slow_uploaders_holding_the_budget_are_cut_off_for_other_clients(
        data_plane: bool) -> None:
    async with serving(data_plane) as srv:
        progress = [0] * 3
        slow = [asyncio.ensure_future(_slow_put(srv, i, progress)) for i in range(3)]
        for _ in range(600):  # until all three bodies are admitted (30 s at most)
            if srv.budget.held >= 5 * MiB:
                break
            await asyncio.sleep(0.05)
        assert srv.budget.held >= 5 * MiB
        statuses: list[int] = []
        for _ in range(120):  # the slow bodies would take about 16 s to arrive
            statuses.append(await _fast_put(srv))
            if statuses[-1] == 204:
                break
            await asyncio.sleep(0.25)
        sent_when_admitted = list(progress)
        # Until a slow body is refused: the ones still within their share would run to their
        # end (over SHARE_SECONDS, as a body slower than its share must) and show nothing
        # more, so they are dropped then.
        pending = set(slow)
        async with asyncio.timeout(30):
            while pending and not any(t.done() and t.result() == 408 for t in slow):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        slow_statuses = [t.result() for t in slow if t.done() and not t.cancelled()]
    # Before: the three bodies (twice the 64 KiB/s floor) held 6 of the 7 MiB until they
    # ended, about 16 s, and every other PUT got 503 meanwhile.
    assert statuses[-1] == 204, statuses
    assert any(sent < 2 * MiB - 4096 for sent in sent_when_admitted), sent_when_admitted
    assert 408 in slow_statuses, slow_statuses
    assert srv.body_timeouts >= 1
