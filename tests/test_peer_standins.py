"""Stand-in copies: a block stored on a member that is not among its owners (a put, push
or read repair while an owner was down) is dropped by that member's anti-entropy once
every owner holds it, and kept while any owner is down, silent or "not here". Real
in-process servers on loopback; a "restart" is a new empty server on the same port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
import pytest

from kvtier.peer.repair import AntiEntropy
from kvtier.peer.ring import HashRing
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN, Pool, pool_url


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    p = Pool()
    yield p
    await p.close()


async def _repairer(server: PeerServer, members: list[str], replicas: int,
                    interval: float = 3600) -> AntiEntropy:
    node = PeerTier.from_url(pool_url(members, replicas=replicas), self=server.member_id,
                             local=server.segment)
    repair = AntiEntropy(server, node, interval=interval)
    await repair.pool.open()
    return repair


async def _until(tier: PeerTier, member: str, alive: bool) -> None:
    for _ in range(400):
        if tier.members.alive(member) == alive:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{member} never seen {'up' if alive else 'down'}")


async def _holders(pool: Pool, keys: Sequence[bytes]) -> list[set[str]]:
    """Per key, the members whose segment holds it."""
    held = {m: await s.segment.contains_many(list(keys)) for m, s in pool.servers.items()}
    return [{m for m, flags in held.items() if flags[i]} for i in range(len(keys))]


def _three_with_standin_keys(members: list[str], n: int) -> tuple[str, str, str, list[bytes]]:
    """``(owner, co_owner, standin, keys)``: keys owned (replicas 2) by the first two, with
    the third next in their ring order (where a put goes while the owner is down)."""
    ring = HashRing(members)
    a, b, c = members
    keys = [k for k in map(key_of, range(600)) if ring.owners(k, 3) == [a, b, c]][:n]
    assert len(keys) == n
    return a, b, c, keys


@pytest.mark.slow
async def test_keys_written_while_an_owner_was_down_end_on_exactly_their_owners(
        pool: Pool) -> None:
    """Four members, replicas 2, anti-entropy on each: with an owner stopped, puts land on
    fallback members; once it is back (empty) and refilled, every key is held by its two
    owners and nobody else, and reads back right."""
    members = [await pool.start() for _ in range(4)]
    repairs = [await _repairer(s, members, replicas=2, interval=0.05)
               for s in pool.servers.values()]
    for repair in repairs:
        await repair.start()
    down = members[0]
    await repairs.pop(0).close()  # the stopped member's own passes stop with it
    await pool.stop(down)
    n = 60
    keys = [key_of(i) for i in range(n)]
    ring = HashRing(members)
    try:
        async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
            await tier.members.check_health()
            assert not tier.members.alive(down)
            await tier.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        standins = [k for k, held in zip(keys, await _holders(pool, keys), strict=True)
                    if held - set(ring.owners(k, 2))]
        assert standins, "no put landed on a fallback member"
        await pool.start(int(down.rpartition(":")[2]))  # back, empty
        for _ in range(200):
            held = await _holders(pool, keys)
            if all(h == set(ring.owners(k, 2)) for k, h in zip(keys, held, strict=True)):
                break
            await asyncio.sleep(0.05)
        extra = {k.hex()[:8]: sorted(h - set(ring.owners(k, 2)))
                 for k, h in zip(keys, held, strict=True) if h != set(ring.owners(k, 2))}
        assert not extra, f"{len(extra)} of {n} keys not on exactly their owners: {extra}"
        for _ in range(200):  # a pass adds its counters when it ends, after its drops
            if sum(r.counts["standins_pruned"] for r in repairs) >= len(standins):
                break
            await asyncio.sleep(0.05)
        assert sum(r.counts["standins_pruned"] for r in repairs) >= len(standins)
        async with PeerTier.from_url(pool_url(members, replicas=2)) as fresh:
            got = await fresh.get_many(keys)
        assert all(b is not None and np.array_equal(b, sample_block(i))
                   for i, b in enumerate(got))
    finally:
        for repair in repairs:
            await repair.close()


async def test_a_standin_is_kept_while_its_owner_is_down(pool: Pool) -> None:
    """Owners A and B (replicas 2), then C and D in ring order: A is stopped, so its live
    owners are B and C, and both hold the keys; D holds them too (it stood in while two
    were down). D keeps every copy while A is down, although both live owners hold them;
    once A is back and holds them, D drops its copies and the owners keep theirs."""
    members = [await pool.start() for _ in range(4)]
    ring = HashRing(members)
    a, b, c, d = members
    keys = [k for k in map(key_of, range(2000)) if ring.owners(k, 4) == members][:6]
    assert len(keys) == 6
    for key in keys:
        for holder in (b, c, d):
            await pool.servers[holder].segment.put(key, sample_block(1))
    repair = await _repairer(pool.servers[d], members, replicas=2)
    pool.servers[d].stored(keys)
    try:
        await pool.stop(a)
        await _until(repair.pool, a, alive=False)
        done = await repair.run_pass()
        assert all(await pool.servers[d].segment.contains_many(keys))
        assert not done.get("standins_pruned")
        await pool.start(int(a.rpartition(":")[2]))
        for key in keys:  # what the owner's refill by its co-owner leaves
            await pool.servers[a].segment.put(key, sample_block(1))
        await _until(repair.pool, a, alive=True)
        done = await repair.run_pass()
        assert done.get("standins_pruned") == len(keys)
        assert not any(await pool.servers[d].segment.contains_many(keys))
        assert all(await pool.servers[a].segment.contains_many(keys))
        assert all(await pool.servers[b].segment.contains_many(keys))
    finally:
        await repair.close()


async def test_an_owner_that_answers_not_here_keeps_the_standin(pool: Pool) -> None:
    """Both owners are up but one answers "not here" (its refill is not done): the stand-in
    keeps its copies and its pass counts them as waiting (so it is retried); once the owner
    holds them the next pass drops them."""
    members = [await pool.start() for _ in range(3)]
    a, b, c, keys = _three_with_standin_keys(members, 8)
    for key in keys:
        await pool.servers[b].segment.put(key, sample_block(1))
        await pool.servers[c].segment.put(key, sample_block(1))
    repair = await _repairer(pool.servers[c], members, replicas=2)
    pool.servers[c].stored(keys)
    try:
        done = await repair.run_pass()
        assert all(await pool.servers[c].segment.contains_many(keys))
        assert not done.get("standins_pruned")
        assert done.get("standins_waiting") == len(keys)
        assert repair.waiting == set(keys)
        for key in keys:
            await pool.servers[a].segment.put(key, sample_block(1))
        done = await repair.run_pass(sorted(repair.waiting))  # what the loop rechecks
        assert done.get("standins_pruned") == len(keys) and done.get("rechecks") == 1
        assert not any(await pool.servers[c].segment.contains_many(keys))
        assert not repair.waiting
    finally:
        await repair.close()


class _HookedDRAM(DRAMTier):
    """A DRAM segment that runs ``hook`` once, at its next presence check."""

    hook: Callable[[], Awaitable[None]] | None = None

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        hook, self.hook = self.hook, None
        if hook is not None:
            await hook()
        return await super()._contains_many(keys)


async def _with_hooked_member(pool: Pool) -> tuple[PeerServer, list[str]]:
    """Two plain members and a third whose segment is a :class:`_HookedDRAM`."""
    members = [await pool.start() for _ in range(2)]
    hooked = PeerServer(_HookedDRAM(), token=TOKEN, close_segment=True)
    await hooked.start()
    pool.servers[hooked.member_id] = hooked
    return hooked, [*members, hooked.member_id]


async def test_a_standin_written_again_during_the_pass_is_kept(pool: Pool) -> None:
    """A client stores a key on the stand-in (through its server) after the pass began and
    before the pass drops it: that write is kept, and the next pass drops the key only
    after checking its owners again."""
    hooked, members = await _with_hooked_member(pool)
    ring = HashRing(members)
    c = hooked.member_id
    a, b = [m for m in members if m != c]
    keys = [k for k in map(key_of, range(600)) if c not in ring.owners(k, 2)][:4]
    for key in keys:
        for owner in (a, b, c):
            await pool.servers[owner].segment.put(key, sample_block(1))
    repair = await _repairer(hooked, members, replicas=2)
    hooked.stored(keys)

    async def client_put() -> None:
        async with PeerTier.from_url(pool_url([c], replicas=1)) as writer:
            await writer.put(keys[0], sample_block(2))

    try:
        hooked.segment.hook = client_put  # type: ignore[attr-defined]
        done = await repair.run_pass()
        assert done.get("standins_pruned") == len(keys) - 1
        assert done.get("standins_waiting") == 1
        got = await hooked.segment.get(keys[0])
        assert got is not None and np.array_equal(got, sample_block(2))
        done = await repair.run_pass()
        assert done.get("standins_pruned") == 1
    finally:
        await repair.close()


@pytest.mark.slow
async def test_a_copy_a_join_moved_is_kept_until_the_ring_settles(pool: Pool) -> None:
    """A fourth member joins and takes B's place among some keys' owners: B keeps those
    copies through the pool's ``change_window`` (another node may not have seen the join
    yet and still count on B), its passes count them as waiting, and once the window has
    passed, with both new owners holding them, B drops them."""
    members = [await pool.start() for _ in range(4)]
    a, b, c, d = members
    before, after = HashRing([a, b, c]), HashRing(members)
    keys = [k for k in map(key_of, range(3000))
            if before.owners(k, 2) == [a, b] and set(after.owners(k, 2)) == {a, d}][:4]
    assert len(keys) == 4
    for key in keys:
        for holder in (a, b, d):
            await pool.servers[holder].segment.put(key, sample_block(1))
    node = PeerTier.from_url(pool_url([a, b, c], replicas=2, change_window=1),
                             self=b, local=pool.servers[b].segment)
    repair = AntiEntropy(pool.servers[b], node, interval=3600)
    await repair.pool.open()
    pool.servers[b].stored(keys)
    try:
        await repair.pool.members.apply_members(set(members))  # d joins (as DNS would say)
        done = await repair.run_pass()
        assert not done.get("standins_pruned")
        assert done.get("standins_waiting") == len(keys)
        assert all(await pool.servers[b].segment.contains_many(keys))
        await asyncio.sleep(1.1)  # the change window passes
        done = await repair.run_pass()
        assert done.get("standins_pruned") == len(keys)
        assert not any(await pool.servers[b].segment.contains_many(keys))
    finally:
        await repair.close()


async def test_a_recheck_of_waiting_standins_stops_at_a_membership_change(
        pool: Pool) -> None:
    """The loop rechecks the stand-ins a pass kept; a member fails during that recheck:
    the recheck stops (the full pass the change calls for, a refill, goes first)."""
    hooked, members = await _with_hooked_member(pool)
    ring = HashRing(members)
    c = hooked.member_id
    a, b = [m for m in members if m != c]
    keys = [k for k in map(key_of, range(600)) if ring.owners(k, 2) == [b, a]][:8]
    for key in keys:  # a lacks them: c's copies wait for its refill
        for holder in (b, c):
            await pool.servers[holder].segment.put(key, sample_block(1))
    node = PeerTier.from_url(pool_url(members, replicas=2), self=c, local=hooked.segment)
    repair = AntiEntropy(hooked, node, interval=3600, batch=2)
    await repair.pool.open()
    hooked.stored(keys)

    async def a_fails() -> None:
        await pool.stop(a)
        await _until(repair.pool, a, alive=False)

    try:
        await repair.run_pass()
        assert repair.waiting == set(keys)
        hooked.segment.hook = a_fails  # type: ignore[attr-defined]
        done = await repair.run_pass(sorted(repair.waiting))
        assert done.get("superseded") == 1 and done.get("rechecks") == 1
        assert done.get("checked") == 2  # the first two keys, then it stopped
        assert all(await hooked.segment.contains_many(keys))
    finally:
        await repair.close()


async def test_a_watch_that_ends_leaves_another_equal_one_watching(pool: Pool) -> None:
    """Two write watches open at once (a pass's and anti-entropy's late-write watch), both
    empty when the inner one ends: the outer one still collects the writes that follow
    (they were removed by value, so the inner one's end took the outer one instead)."""
    server = pool.servers[await pool.start()]
    with server.watch_writes() as outer:
        with server.watch_writes() as inner:
            pass
        server.stored([key_of(1)])
        assert (outer, inner) == ({key_of(1)}, set())
    server.stored([key_of(2)])
    assert (outer, inner) == ({key_of(1)}, set())
