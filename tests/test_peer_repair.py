"""Reads that find what the pool holds: the read walk past "not here", read repair and
anti-entropy re-replication, against real in-process servers on loopback. A "restart" is a
new server with an empty segment on the same port (what a `kvtier serve` restart with DRAM
leaves)."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier.peer.repair import AntiEntropy
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.base import Block
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN, Pool, ServeProcess, pool_url, token_file


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    p = Pool()
    yield p
    await p.close()


async def _read_all(tier: PeerTier, n: int) -> int:
    """How many of keys 0..n-1 read back with the right bytes."""
    got = await tier.get_many([key_of(i) for i in range(n)])
    return sum(1 for i, b in enumerate(got)
               if b is not None and np.array_equal(b, sample_block(i)))


async def _until_alive(tier: PeerTier, member: str) -> None:
    for _ in range(400):
        if tier.members.alive(member):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{member} never came back")


async def _until_changed(tier: PeerTier, member: str) -> None:
    for _ in range(400):
        if member in tier.members.recently_changed(60) and tier.members.alive(member):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"the restart of {member} was never noticed")


async def test_restart_empty_then_read_all_then_second_failure_loses_nothing(
        pool: Pool) -> None:
    """Kill X, restart it empty, read every key through the pool (read repair puts X's
    copies back), kill Y: no key is lost."""
    members = [await pool.start() for _ in range(3)]
    n = 120
    async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(n)])
        x, y = members[0], members[1]
        await pool.restart_empty(x)
        await _until_changed(tier, x)  # its health probe sees the restart
        assert await _read_all(tier, n) == n
        await tier.flush()  # read repairs run in the background
        assert tier.stats()["read_repairs"] > 0
        await pool.stop(y)
        assert await _read_all(tier, n) == n


async def test_anti_entropy_rereplicates_to_a_node_back_empty(pool: Pool) -> None:
    """Nobody reads: the survivors' anti-entropy pass alone restores the restarted node's
    copies, so a second failure loses nothing."""
    members = [await pool.start() for _ in range(3)]
    url = pool_url(members, replicas=2)
    repairs = []
    for member, server in pool.servers.items():
        node = PeerTier.from_url(url, self=member, local=server.segment)
        repairs.append(AntiEntropy(server, node, interval=3600))
    n = 120
    async with PeerTier.from_url(url) as tier:
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(n)])
    x, y = members[0], members[1]
    await pool.restart_empty(x)
    for repair in repairs:
        if repair.server.member_id != x:
            await repair.pool.open()
            await repair.run_pass()
    assert sum(r.counts["pushed"] for r in repairs) > 0
    await pool.stop(y)
    try:
        async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
            assert await _read_all(tier, n) == n
    finally:
        for repair in repairs:
            await repair.close()


async def test_write_with_an_owner_down_then_back_every_key_readable(pool: Pool) -> None:
    members = [await pool.start() for _ in range(3)]
    n = 90
    async with PeerTier.from_url(pool_url(members, replicas=1)) as tier:
        down = members[0]
        await pool.stop(down)
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(n)])  # fallbacks
        for i in range(n, n + 10):
            await tier.put(key_of(i), sample_block(i))
        await pool.start(int(down.rpartition(":")[2]))  # back, holding none of them
        await _until_alive(tier, down)
        assert await _read_all(tier, n + 10) == n + 10
        assert all([await tier.get(key_of(i)) is not None for i in range(n, n + 10)])
    # A client that never saw the outage reads them too.
    async with PeerTier.from_url(pool_url(members, replicas=1)) as fresh:
        assert await _read_all(fresh, n + 10) == n + 10


async def test_grow_from_three_to_four_members_every_key_readable(pool: Pool) -> None:
    members = [await pool.start() for _ in range(4)]
    n = 200
    async with PeerTier.from_url(pool_url(members[:3], replicas=1)) as old:
        await old.put_many([(key_of(i), sample_block(i)) for i in range(n)])
    async with PeerTier.from_url(pool_url(members, replicas=1)) as grown:
        moved = sum(1 for i in range(n) if grown.members.ring.primary(key_of(i)) == members[3])
        assert moved > 0  # the new member owns some keys it does not hold
        assert await _read_all(grown, n) == n
        await grown.flush()
        assert grown.stats()["read_repairs"] == moved  # now on their new owner


async def test_miss_walk_is_bounded(pool: Pool) -> None:
    """A true miss asks replicas + read_walk members (plus recently changed ones), not the
    whole pool."""
    members = [await pool.start() for _ in range(5)]
    async with PeerTier.from_url(pool_url(members, replicas=1, read_walk=1)) as tier:
        assert tier.walk_limit() == 2
        assert await tier.get(key_of(1)) is None
        asked = sum(sum(s.requests.values()) for s in pool.servers.values())
        assert asked == 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.one_loop  # the repair runs in kvtier serve processes, the client only asks
async def test_kvtier_serve_repair_refills_a_node_restarted_empty(tmp_path: Path) -> None:
    """`kvtier serve --pool POOL_URL` wiring (anti-entropy on by default): a node killed
    and restarted empty gets its blocks back from its peer's anti-entropy pass, with no
    client reading anything."""
    token = token_file(tmp_path)
    members = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    url = pool_url(members, replicas=2, health_interval=0.1)
    args = ["--tier", "dram://", "--pool", url.replace(f"token={TOKEN}", f"token=file:{token}"),
            "--repair-interval", "0.2"]
    procs = [ServeProcess(args, token) for _ in members]
    try:
        for proc, member in zip(procs, members, strict=True):
            proc.start(listen=member, timeout=60)
        async with PeerTier.from_url(url) as tier:
            await tier.put_many([(key_of(i), sample_block(i)) for i in range(50)])
        procs[1].signal(signal.SIGKILL)
        procs[1].proc.wait(10)  # type: ignore[union-attr]
        procs[1].start(listen=members[1], timeout=60)
        async with PeerTier.from_url(pool_url([members[1]])) as restarted:
            for _ in range(300):
                held = await restarted.contains_many([key_of(i) for i in range(50)])
                if all(held):
                    break
                await asyncio.sleep(0.1)
            assert all(held), f"{held.count(False)} of 50 blocks not re-replicated"
    finally:
        for proc in procs:
            proc.stop()


def _owned_by(tier: PeerTier, member: str) -> bytes:
    """A key whose first owner is ``member``."""
    return next(key_of(i) for i in range(1000) if tier.members.order(key_of(i))[0] == member)


async def test_read_repair_never_overwrites_a_newer_value_on_the_owner(pool: Pool) -> None:
    """A read finds an old copy away from the owner and repairs the owner in the background;
    a newer value written to the owner meanwhile stays (the repair only fills a hole)."""
    members = [await pool.start() for _ in range(2)]
    async with PeerTier.from_url(pool_url(members, replicas=1, read_walk=1)) as tier:
        owner, other = members
        key = _owned_by(tier, owner)
        await pool.servers[other].segment.put(key, sample_block(1))  # an old fallback copy
        got = await tier.get(key)
        assert got is not None and np.array_equal(got, sample_block(1))  # repair queued
        await pool.servers[owner].segment.put(key, sample_block(2))  # a newer put lands
        await tier.flush()
        now = await pool.servers[owner].segment.get(key)
        assert now is not None and np.array_equal(now, sample_block(2))
        assert tier.stats()["read_repairs"] == 1  # the hole was there when it was found


class _HeldReads(DRAMTier):
    """A DRAM segment whose batch reads wait until ``release`` is set (``reading`` tells
    when one started)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        self.reading.set()
        await self.release.wait()
        return await super()._get_many(keys)


async def test_anti_entropy_never_overwrites_a_newer_value_on_the_owner(pool: Pool) -> None:
    """Between the pass's stamp check and its push, a newer put reaches the owner: the
    push leaves it (it carries the older stamp)."""
    owner = await pool.start()
    holder = PeerServer(_HeldReads(), token=TOKEN)
    await holder.start()
    members = [owner, holder.member_id]
    node = PeerTier.from_url(pool_url(members, replicas=1), self=holder.member_id,
                             local=holder.segment)
    repair = AntiEntropy(holder, node, interval=3600)
    try:
        await repair.pool.open()
        key = _owned_by(node, owner)
        async with PeerTier.from_url(pool_url([holder.member_id], replicas=1)) as only_holder:
            await only_holder.put(key, sample_block(1))  # the holder's (older) copy
        held = holder.segment
        assert isinstance(held, _HeldReads)
        passing = asyncio.ensure_future(repair.run_pass())
        await asyncio.wait_for(held.reading.wait(), 5)  # owner checked: it lacked the key
        async with PeerTier.from_url(pool_url([owner], replicas=1)) as only_owner:
            await only_owner.put(key, sample_block(2))  # a newer put lands (newer stamp)
        held.release.set()
        await asyncio.wait_for(passing, 10)
        now = await pool.servers[owner].segment.get(key)
        assert now is not None and np.array_equal(now, sample_block(2))
    finally:
        await repair.close()
        await holder.stop()
        await holder.segment.aclose()


class _RecordingDRAM(DRAMTier):
    """A DRAM segment that records the keys stored, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.stored_order: list[bytes] = []

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        self.stored_order += [key for key, _ in items]
        await super()._put_many(items)


async def _repairer(server: PeerServer, members: list[str], replicas: int,
                    **opts: object) -> AntiEntropy:
    node = PeerTier.from_url(pool_url(members, replicas=replicas), self=server.member_id,
                             local=server.segment)
    repair = AntiEntropy(server, node, interval=3600, **opts)  # type: ignore[arg-type]
    await repair.pool.open()
    return repair


async def test_anti_entropy_pushes_the_keys_with_fewest_copies_first(pool: Pool) -> None:
    """Of the keys a pass has found (here one batch), those down to this node's copy alone
    go out before keys that still have two copies, although they were stored after them."""
    members = [await pool.start() for _ in range(2)]
    target = PeerServer(_RecordingDRAM(), token=TOKEN, close_segment=True)
    await target.start()
    pool.servers[target.member_id] = target
    members.append(target.member_id)
    holder, other = pool.servers[members[0]], pool.servers[members[1]]
    repair = await _repairer(holder, members, replicas=3, batch=24)
    try:
        ring = repair.pool.members
        # On the holder and `other`, the holder first in ring order (so it is the pusher).
        two = [k for k in map(key_of, range(200))
               if ring.order(k).index(holder.member_id) < ring.order(k).index(
                   other.member_id)][:12]
        one = [key_of(i) for i in range(100, 112)]  # on the holder alone
        for key in two + one:
            await holder.segment.put(key, sample_block(1))
        holder.stored(two + one)
        for key in two:
            await other.segment.put(key, sample_block(1))
        other.stored(two)
        done = await repair.run_pass()
        order = target.segment.stored_order  # type: ignore[attr-defined]
        assert sorted(order[:12]) == sorted(one), "the least-replicated keys were not first"
        assert sorted(order[12:]) == sorted(two)
        assert done["under_replicated"] == 24
    finally:
        await repair.close()


class _CountingDRAM(DRAMTier):
    """A DRAM segment that counts its presence checks (an anti-entropy survey's batches)."""

    checks = 0

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.checks += 1
        return await super()._contains_many(keys)


class _ArrivalDRAM(DRAMTier):
    """A DRAM segment that notes how many batches ``survey`` had checked when the first
    block arrived here."""

    def __init__(self, survey: _CountingDRAM) -> None:
        super().__init__()
        self.survey = survey
        self.checks_at_first: int | None = None

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        if self.checks_at_first is None:
            self.checks_at_first = self.survey.checks
        await super()._put_many(items)


async def test_a_refill_starts_before_the_survey_of_every_held_key_ends(
        pool: Pool) -> None:
    """A node holding many keys of a member back empty: the member gets its first blocks
    while most of the holder's batches are still unchecked, not after the whole walk (in
    the chaos soak a refill that waited for a survey of ~25k keys was too late)."""
    holder = PeerServer(_CountingDRAM(), token=TOKEN, close_segment=True)
    await holder.start()
    target = PeerServer(_ArrivalDRAM(holder.segment), token=TOKEN,  # type: ignore[arg-type]
                        close_segment=True)
    await target.start()
    pool.servers.update({holder.member_id: holder, target.member_id: target})
    n, batch = 480, 8  # 60 batches
    repair = await _repairer(holder, [holder.member_id, target.member_id], replicas=2,
                             batch=batch)
    try:
        await holder.segment.put_many([(key_of(i), sample_block(i, 256)) for i in range(n)])
        holder.stored(key_of(i) for i in range(n))
        holder.segment.checks = 0  # type: ignore[attr-defined]
        done = await repair.run_pass()
        assert done["pushed"] == n and done["checked"] == n
        first = target.segment.checks_at_first  # type: ignore[attr-defined]
        assert first is not None and first < n // batch // 2, (
            f"the first push waited for {first} of {n // batch} batches to be checked")
        assert all(await target.segment.contains_many([key_of(i) for i in range(n)]))
    finally:
        await repair.close()


async def test_a_pass_checks_the_keys_of_a_member_back_empty_first(pool: Pool) -> None:
    """Member B restarts empty; C, unchanged, lacks its keys too. The holder's pass checks
    (and so pushes) B's keys before C's, although they are interleaved in the walk."""
    holder = PeerServer(_CountingDRAM(), token=TOKEN, close_segment=True)
    await holder.start()
    b = await pool.start()
    c_server = PeerServer(_ArrivalDRAM(holder.segment), token=TOKEN,  # type: ignore[arg-type]
                          close_segment=True)
    await c_server.start()
    c = c_server.member_id
    pool.servers.update({holder.member_id: holder, c: c_server})
    members = [holder.member_id, b, c]
    batch = 8
    repair = await _repairer(holder, members, replicas=2, batch=batch)
    try:
        ring = repair.pool.members.ring
        of_b = [k for k in map(key_of, range(2000)) if b in ring.owners(k, 2)
                and holder.member_id in ring.owners(k, 2)][:160]
        of_c = [k for k in map(key_of, range(2000)) if c in ring.owners(k, 2)
                and holder.member_id in ring.owners(k, 2)][:160]
        walk = [k for pair in zip(of_c, of_b, strict=True) for k in pair]
        await holder.segment.put_many([(k, sample_block(1, 256)) for k in walk])
        holder.stored(walk)
        await pool.restart_empty(b)
        await _until_changed(repair.pool, b)
        holder.segment.checks = 0  # type: ignore[attr-defined]
        done = await repair.run_pass()
        assert done["pushed"] == len(walk)
        first_to_c = c_server.segment.checks_at_first  # type: ignore[attr-defined]
        assert first_to_c is not None and first_to_c >= len(of_b) // batch, (
            f"C got a push after {first_to_c} batches, before B's {len(of_b) // batch}")
    finally:
        await repair.close()


async def test_a_refill_is_pushed_once_not_by_every_holder(pool: Pool) -> None:
    """replicas=3 of three members, one back empty: of its two co-owners only the first
    holder in each key's ring order pushes, so each block travels once."""
    members = [await pool.start() for _ in range(3)]
    n = 60
    async with PeerTier.from_url(pool_url(members, replicas=3)) as tier:
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(n)])
    survivors = [pool.servers[m] for m in members[1:]]
    repairs = [await _repairer(s, members, replicas=3) for s in survivors]
    for server in survivors:
        server.stored(key_of(i) for i in range(n))
    try:
        await pool.restart_empty(members[0])
        # Each node has seen the restart (a probe the new server answered): alive alone
        # could be a node whose refused probe of the stop window is not processed yet, so
        # its pass takes the member down midway and pushes it nothing.
        for repair in repairs:
            await _until_changed(repair.pool, members[0])
        await asyncio.gather(*(repair.run_pass() for repair in repairs))
        assert sum(r.counts["pushed"] for r in repairs) == n, [dict(r.counts) for r in repairs]
        held = await pool.servers[members[0]].segment.contains_many(
            [key_of(i) for i in range(n)])
        assert all(held)
    finally:
        for repair in repairs:
            await repair.close()


@pytest.mark.slow
async def test_anti_entropy_pushes_at_most_its_byte_rate(pool: Pool) -> None:
    members = [await pool.start() for _ in range(2)]
    holder = pool.servers[members[0]]
    n, rate = 16, 256 << 10  # 16 blocks of 64 KiB at 256 KiB/s: >= 3 s past the 1 s burst
    repair = await _repairer(holder, members, replicas=2, batch=2, rate=rate)
    try:
        for i in range(n):
            await holder.segment.put(key_of(i), sample_block(i, 64 << 10))
        holder.stored(key_of(i) for i in range(n))
        loop = asyncio.get_running_loop()
        started = loop.time()
        done = await repair.run_pass()
        took = loop.time() - started
        assert done["pushed"] == n
        assert took >= (done["pushed_bytes"] - rate) / rate * 0.95
        assert repair.stats()["paced_s"] > 2.0
    finally:
        await repair.close()


async def test_a_warm_restart_re_replicates_the_blocks_found_on_disk(
        pool: Pool, tmp_path: Path) -> None:
    """A node restarted on its LMDB segment (warm) walks the blocks it found on disk: the
    member back empty gets them with nobody reading and nothing stored since the restart."""
    from kvtier.tiers.lmdb import LMDBTier

    n = 40
    first = PeerServer(LMDBTier(tmp_path / "seg", capacity=64 << 20), token=TOKEN,
                       close_segment=True)
    await first.start()
    warm_port = int(first.member_id.rpartition(":")[2])
    for i in range(n):
        await first.segment.put(key_of(i), sample_block(i))
    await first.stop()  # closes the LMDB segment
    empty = await pool.start()
    warm = PeerServer(LMDBTier(tmp_path / "seg", capacity=64 << 20), token=TOKEN,
                      close_segment=True, port=warm_port)
    await warm.start()
    pool.servers[warm.member_id] = warm
    repair = AntiEntropy(warm, PeerTier.from_url(pool_url([empty, warm.member_id], replicas=2),
                                                 self=warm.member_id, local=warm.segment),
                         interval=3600)
    try:
        await repair.start()
        await repair.run_pass()
        held = await pool.servers[empty].segment.contains_many([key_of(i) for i in range(n)])
        assert all(held), f"{held.count(False)} of {n} blocks on disk not re-replicated"
        assert repair.counts["found_at_start"] == n
    finally:
        await repair.close()


@pytest.mark.slow
async def test_a_put_while_an_owner_is_down_reaches_it_when_it_returns(pool: Pool) -> None:
    """Hinted handoff by the servers: with an owner stopped, puts land on a fallback member;
    the owner restarts empty and its co-owners' anti-entropy (running on their own, nobody
    reading) hands it every block it owns."""
    members = [await pool.start() for _ in range(4)]
    repairs = []
    for member, server in pool.servers.items():
        node = PeerTier.from_url(pool_url(members, replicas=2), self=member, local=server.segment)
        repairs.append(AntiEntropy(server, node, interval=0.05))
    for repair in repairs:
        await repair.start()
    down = members[0]
    await repairs.pop(0).close()  # the stopped member's own pass stops with it
    await pool.stop(down)
    n = 40
    try:
        async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
            await tier.members.check_health()
            assert not tier.members.alive(down)
            await tier.put_many([(key_of(i), sample_block(i)) for i in range(n)])
            owned = [key_of(i) for i in range(n) if down in tier.members.ring.owners(
                key_of(i), 2)]
        assert owned
        await pool.start(int(down.rpartition(":")[2]))  # back, empty
        back = pool.servers[down].segment
        for _ in range(100):
            if all(await back.contains_many(owned)):
                break
            for repair in repairs:
                repair.passed.clear()
            waits = [asyncio.ensure_future(r.passed.wait()) for r in repairs]
            await asyncio.wait(waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
        assert all(await back.contains_many(owned)), "the owner back never got its blocks"
        got = await back.get_many(owned)
        assert all(np.array_equal(b, sample_block(int.from_bytes(k[:4], "big")))  # type: ignore[arg-type]
                   for k, b in zip(owned, got, strict=True))
    finally:
        for repair in repairs:
            await repair.close()


async def test_a_pass_starts_soon_after_a_change_not_an_interval_later(pool: Pool) -> None:
    """A member restarts empty: the survivor's passes start when its probes see the change,
    although its interval (the retry spacing of a failed pass) is an hour."""
    members = [await pool.start() for _ in range(2)]
    survivor = pool.servers[members[1]]
    repair = AntiEntropy(survivor, PeerTier.from_url(pool_url(members, replicas=2),
                                                     self=survivor.member_id,
                                                     local=survivor.segment), interval=3600)
    try:
        await repair.start()
        await asyncio.wait_for(repair.passed.wait(), 20)  # the first pass, at start
        await survivor.segment.put(key_of(1), sample_block(1))
        survivor.stored([key_of(1)])
        repair.passed.clear()
        await pool.restart_empty(members[0])
        back = pool.servers[members[0]].segment
        for _ in range(10):  # it is seen down, then back: a pass follows each change
            await asyncio.wait_for(repair.passed.wait(), 20)
            repair.passed.clear()
            if await back.contains_many([key_of(1)]) == [True]:
                break
        assert await back.contains_many([key_of(1)]) == [True]
    finally:
        await repair.close()


async def test_a_servers_metrics_show_its_anti_entropy_counters(pool: Pool) -> None:
    """``/metrics`` carries the node's anti-entropy counters (what the chaos soak reads
    before each kill), and a server with no anti-entropy shows none."""
    members = [await pool.start() for _ in range(2)]
    holder, other = pool.servers[members[0]], pool.servers[members[1]]
    n = 8
    repair = await _repairer(holder, members, replicas=2)
    try:
        for i in range(n):
            await holder.segment.put(key_of(i), sample_block(i))
        holder.stored(key_of(i) for i in range(n))
        await repair.run_pass()
        text = holder.metrics_text()
        assert "kvtier_peer_repair_passes_total 1.0\n" in text
        assert f"kvtier_peer_repair_checked_total {float(n)}\n" in text
        assert f"kvtier_peer_repair_pushed_total {float(n)}\n" in text
        assert "kvtier_peer_repair_" not in other.metrics_text()
    finally:
        await repair.close()


async def _until_down(tier: PeerTier, member: str) -> None:
    for _ in range(400):
        if not tier.members.alive(member):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{member} never marked down")


@pytest.mark.slow
async def test_a_pass_begun_while_an_owner_was_down_stops_when_it_is_back(pool: Pool) -> None:
    """Owner B is down when A's pass begins, so the pass pushes B's keys to the next live
    member C (fallback copies). B comes back empty meanwhile: the pass stops instead of
    pushing every key to C first (a refill that waits for it is what lost keys in the chaos
    soak), and the next pass refills B."""
    from kvtier.peer.ring import HashRing

    members = [await pool.start() for _ in range(3)]
    a, b, c = members
    ring = HashRing(members)
    keys = [k for k in (key_of(i) for i in range(400)) if set(ring.owners(k, 2)) == {a, b}]
    keys = keys[:12]
    holder = pool.servers[a]
    # 64 KiB blocks at 128 KiB/s, 2 per round: the pass takes seconds, B is back long before.
    repair = await _repairer(holder, members, replicas=2, batch=2, rate=128 << 10)
    try:
        for k in keys:
            await holder.segment.put(k, np.frombuffer(k * 4096, np.uint8))
        holder.stored(keys)
        await pool.stop(b)
        await _until_down(repair.pool, b)
        task = asyncio.create_task(repair.run_pass())
        fallback = pool.servers[c].segment
        for _ in range(400):  # until the pass pushes to C
            if any(await fallback.contains_many(keys)):
                break
            await asyncio.sleep(0.02)
        await pool.start(int(b.rpartition(":")[2]))  # B back, empty
        await _until_alive(repair.pool, b)
        done = await task
        assert sum(await fallback.contains_many(keys)) < len(keys)
        assert done.get("superseded") == 1
        repair.pacer.rate = None  # the pacing only had to keep the first pass slow
        await repair.run_pass()
        assert all(await pool.servers[b].segment.contains_many(keys))
    finally:
        await repair.close()
