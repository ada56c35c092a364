"""Failure detection of the peer pool under load: one timeout does not take a healthy member
out, members out of the path are still asked when no other owner is left, rejoining needs
several probes, budgets grow with the bytes asked for, slow members are asked last, and a
long-lived client reads what a fresh one reads. Real servers on loopback.

Every timeout, delay and sleep is scaled by the machine's measured slowdown
(:class:`~tests.helpers.load.Scale`, 1 when idle): a healthy answer beats the timeout, a
slowed one misses it, a sleep outlasts the slowed answer, at any load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Block
from kvtier.tiers.dram import DRAMTier
from tests.helpers.load import Scale
from tests.helpers.peer_helpers import TOKEN

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

#: Idle-machine seconds: the pool's timeout, a slowed segment's delay (past the timeout),
#: and a sleep that outlasts the delay (the servers finish the late requests).
TIMEOUT, SLOWED, SETTLE = 0.15, 0.45, 0.5


@pytest.fixture
def scale() -> Scale:
    return Scale()


def _url(members: Sequence[str], scale: Scale, **opts: object) -> str:
    query = {"token": TOKEN, "timeout": scale(TIMEOUT), "replicas": 2, "health_interval": 60,
             **opts}
    return f"peers://{','.join(members)}?" + "&".join(f"{k}={v}" for k, v in query.items())


@pytest.fixture
async def slowable() -> AsyncIterator[list[PeerServer]]:
    """Three servers whose segments answer after ``segment.delay`` seconds (0 at first)."""
    servers = [PeerServer(LatencyTier(DRAMTier(), delay=0.0), token=TOKEN, close_segment=True)
               for _ in range(3)]
    for server in servers:
        await server.start()
    yield servers
    for server in servers:
        await server.stop()


def _delay(servers: Sequence[PeerServer], seconds: float) -> None:
    for server in servers:
        server.segment.delay = seconds  # type: ignore[attr-defined]


async def test_one_timeout_burst_keeps_healthy_members_in_the_write_path(
        slowable: list[PeerServer], scale: Scale) -> None:
    """One of three down, writers time out once on the other two: later puts still store
    every copy (the row: 39 puts failed "no live peer to store" with two members up)."""
    down, *healthy = slowable
    members = [s.member_id for s in slowable]
    await down.stop()
    async with PeerTier.from_url(_url(members, scale)) as tier:
        await tier.open()  # the stopped member refuses the probe: out at once
        assert not tier.members.alive(down.member_id)
        _delay(healthy, scale(SLOWED))
        burst = await asyncio.gather(*(tier.put(key_of(i), sample_block(i))
                                       for i in range(1, 17)), return_exceptions=True)
        assert all(isinstance(r, Exception) for r in burst)  # 16 writers, all timed out
        _delay(healthy, 0.0)
        assert all(tier.members.alive(s.member_id) for s in healthy)
        for i in range(17, 25):
            await tier.put(key_of(i), sample_block(i))
        assert tier.stats()["dead"] == [down.member_id]


async def test_members_out_of_the_path_are_asked_while_they_answer_probes(
        slowable: list[PeerServer], scale: Scale) -> None:
    """Three sequential timeouts take both members of a two-member pool out: a put and a
    read still reach them (never "no live peer" while members answer health probes)."""
    pair = slowable[:2]
    async with PeerTier.from_url(_url([s.member_id for s in pair], scale)) as tier:
        await tier.put(key_of(0), sample_block(0))
        _delay(pair, scale(SLOWED))
        for _ in range(3):
            assert await tier.get(key_of(0)) is None  # timed out on both owners
            await asyncio.sleep(scale(SETTLE))  # the servers finish the late requests
        assert tier.stats()["dead"] == sorted(s.member_id for s in pair)
        _delay(pair, 0.0)
        await tier.put(key_of(1), sample_block(1))
        assert np.array_equal(await tier.get(key_of(0)), sample_block(0))  # type: ignore[arg-type]
        assert tier.stats()["dead"] == sorted(s.member_id for s in pair)  # no probe yet


async def test_rejoining_takes_several_probes_and_a_burst_counts_once(
        slowable: list[PeerServer], scale: Scale) -> None:
    """Hysteresis: a member that timed out is not brought back by one small health answer
    (the 20 Mbit/s row: 4 down/up cycles in 6 s)."""
    slow = slowable[0]
    async with PeerTier.from_url(_url([slow.member_id], scale, replicas=1)) as tier:
        await tier.put(key_of(0), sample_block(0))
        _delay([slow], scale(SLOWED))
        # 8 reads time out together: one signal, the member stays in the path.
        assert await asyncio.gather(*(tier.get(key_of(0)) for _ in range(8))) == [None] * 8
        assert tier.members.alive(slow.member_id)
        for _ in range(2):
            await asyncio.sleep(scale(SETTLE))
            assert await tier.get(key_of(0)) is None
        assert not tier.members.alive(slow.member_id)  # three failures in a row
        await asyncio.sleep(scale(SETTLE))
        _delay([slow], 0.0)
        assert (await tier.members.check_health())[slow.member_id] == "ok"
        assert not tier.members.alive(slow.member_id)  # one answer is not enough
        await tier.members.check_health()
        assert tier.members.alive(slow.member_id)
        assert tier.stats()["member_failures"] == tier.stats()["member_recoveries"] == 1


class _ThrottledDRAM(DRAMTier):
    """A DRAM segment whose batch reads take ``bytes / rate`` seconds (a slow disk)."""

    rate = 400 << 20

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        blocks = await super()._get_many(keys)
        await asyncio.sleep(sum(b.nbytes for b in blocks if b is not None) / self.rate)
        return blocks


async def test_a_large_batch_gets_a_budget_for_its_bytes(scale: Scale) -> None:
    """128 x 256 KiB in one batch get with timeout=0.05 from a segment that reads at
    400 MiB/s: every block arrives, the member stays up (the row: 400 x 256 KiB with
    timeout=0.5, all missed and every member marked down)."""
    server = PeerServer(_ThrottledDRAM(), token=TOKEN, close_segment=True)
    await server.start()
    try:
        items = [(key_of(i), sample_block(i, nbytes=256 << 10)) for i in range(128)]
        min_rate = int((64 << 20) / scale.factor)  # the default rate, as slowed as the box
        floor = scale(0.05)
        async with PeerTier.from_url(_url([server.member_id], scale, replicas=1,
                                          timeout=scale(5))) as w:
            await w.put_many(items)
        async with PeerTier.from_url(_url([server.member_id], scale, replicas=1,
                                          timeout=floor, min_rate=min_rate)) as tier:
            assert await tier.get(items[0][0]) is not None  # one block: its size is seen
            got = await tier.get_many([k for k, _ in items[1:]])
            assert [g is not None and np.array_equal(g, b) for g, (_, b) in
                    zip(got, items[1:], strict=True)] == [True] * 127
            assert tier.members.alive(server.member_id)
            assert tier.budget.frame_bytes >= 256 << 10
            assert tier.budget.seconds(0) == floor  # a request moving nothing: the floor
    finally:
        await server.stop()


def test_min_rate_and_detector_options_are_checked() -> None:
    scale = Scale(1.0)
    tier = PeerTier.from_url(_url(["127.0.0.1:1"], scale, min_rate="10MiB", fail_after=5,
                                  rejoin_after=4))
    assert tier.budget.min_rate == 10 << 20
    assert tier.budget.seconds(10 << 20) == pytest.approx(TIMEOUT + 1.0)
    assert (tier.members.detector.fail_after, tier.members.detector.rejoin_after) == (5, 4)
    for bad in ({"min_rate": 0}, {"fail_after": 0}, {"rejoin_after": "x"}):
        with pytest.raises(ConfigError):
            PeerTier.from_url(_url(["127.0.0.1:1"], scale, **bad))


async def test_a_slow_member_is_asked_after_its_fast_co_owner(scale: Scale) -> None:
    """A working member 30 ms slower than its co-owner is not asked first for its keys (the
    100 Mbit/s row: p50 40.9 ms vs 1.0 ms, never deprioritised)."""
    slow = PeerServer(LatencyTier(DRAMTier(), delay=scale(0.03)), token=TOKEN, close_segment=True)
    fast = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    for s in (slow, fast):
        await s.start()
    try:
        async with PeerTier.from_url(_url([slow.member_id, fast.member_id], scale,
                                          timeout=scale(1))) as tier:
            keys = [k for k in (key_of(i) for i in range(200))
                    if tier.members.ring.primary(k) == slow.member_id][:20]
            detector = tier.members.detector
            for _ in range(4):  # a loaded loop slows both: widen the gap until it shows
                for i, key in enumerate(keys):  # both owners answer: latency is measured
                    await tier.put(key, sample_block(i))
                if detector.prefer([slow.member_id, fast.member_id])[0] == fast.member_id:
                    break
                slow.segment.delay *= 3  # type: ignore[attr-defined]
            gets_before = slow.segment.calls.get("get", 0)  # type: ignore[attr-defined]
            for i, key in enumerate(keys):
                assert np.array_equal(await tier.get(key), sample_block(i))  # type: ignore[arg-type]
            assert slow.segment.calls.get("get", 0) == gets_before  # type: ignore[attr-defined]
            assert tier.members.alive(slow.member_id)
    finally:
        for s in (slow, fast):
            await s.stop()


async def test_a_long_lived_client_reads_what_a_fresh_client_reads(
        slowable: list[PeerServer], scale: Scale) -> None:
    """After a load burst in which every member timed out three times, a long-lived client
    reads every acked key at once, as a fresh client does (the row: 0 of 400 vs 400)."""
    members = [s.member_id for s in slowable]
    keys = [key_of(i) for i in range(60)]
    async with PeerTier.from_url(_url(members, scale)) as tier:
        await tier.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        _delay(slowable, scale(SLOWED))
        for _ in range(3):
            assert await tier.get_many(keys[:6]) == [None] * 6
            await asyncio.sleep(scale(SETTLE))
        _delay(slowable, 0.0)
        long_lived = sum(g is not None for g in await tier.get_many(keys))
        async with PeerTier.from_url(_url(members, scale)) as fresh:
            assert sum(g is not None for g in await fresh.get_many(keys)) == len(keys)
        assert long_lived == len(keys)


async def test_a_hedged_read_is_answered_by_the_next_owner_when_the_first_stalls(
        scale: Scale) -> None:
    """``hedge=1``: a get its first owner has not answered after that owner's usual latency
    goes to the co-owner too; the co-owner's hit wins, and the stalled answer still teaches
    the pool that the member is slow (its next reads go to the co-owner first)."""
    stalling = PeerServer(LatencyTier(DRAMTier(), delay=0.0), token=TOKEN, close_segment=True)
    # The co-owner is the slower one at first, so the member about to stall is asked first.
    fast = PeerServer(LatencyTier(DRAMTier(), delay=scale(0.02)), token=TOKEN,
                      close_segment=True)
    for s in (stalling, fast):
        await s.start()
    try:
        async with PeerTier.from_url(_url([stalling.member_id, fast.member_id], scale,
                                          timeout=scale(2),
                                          hedge=1)) as tier:
            keys = [k for k in (key_of(i) for i in range(200))
                    if tier.members.ring.primary(k) == stalling.member_id][:10]
            for i, key in enumerate(keys):
                await tier.put(key, sample_block(i))
            for key in keys:  # both members answer alike
                assert await tier.get(key) is not None
            wins = tier.counts["hedge_wins"]
            stalling.segment.delay, fast.segment.delay = scale(0.5), 0.0  # type: ignore[attr-defined]
            assert np.array_equal(await tier.get(keys[0]), sample_block(0))  # type: ignore[arg-type]
            assert tier.counts["hedge_wins"] == wins + 1
            await asyncio.gather(*tier._stragglers)  # the stalled answer arrives
            latency = tier.members.detector[stalling.member_id].latency
            assert latency is not None and latency > scale(0.05)
            gets = stalling.segment.calls.get("get", 0)  # type: ignore[attr-defined]
            assert np.array_equal(await tier.get(keys[1]), sample_block(1))  # type: ignore[arg-type]
            assert stalling.segment.calls.get("get", 0) == gets  # type: ignore[attr-defined]
    finally:
        for s in (stalling, fast):
            await s.stop()
