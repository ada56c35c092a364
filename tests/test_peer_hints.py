"""Hinted handoff (kvtier.peer.handoff): hints bounded in bytes, deletes hinted with their
stamps, and hints of a member that leaves the ring handed to the keys' new owners."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvtier.peer.handoff import Hints
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import peer_servers, pool_url


def test_hints_are_bounded_in_bytes_across_members() -> None:
    hints = Hints(max_keys=1000, max_bytes=10 * (16 + 120))
    for i in range(8):
        hints.add("a:1", key_of(i))
    for i in range(8, 12):
        hints.add("b:1", key_of(i))
    assert len(hints) == 10 and hints.dropped == 2 and hints.nbytes <= hints.max_bytes
    assert not hints.holds("a:1", key_of(0)) and hints.holds("a:1", key_of(2))  # oldest
    assert hints.holds("b:1", key_of(8))  # the member with the most hints lost them


def test_a_delete_hint_replaces_the_put_hint_of_its_key_and_keeps_its_stamp() -> None:
    hints = Hints()
    hints.add("a:1", key_of(1))
    hints.add("a:1", key_of(2))
    hints.add_delete("a:1", key_of(1), 77)
    assert hints.take_deletes("a:1") == [(key_of(1), 77)]
    assert hints.take("a:1") == [key_of(2)] and len(hints) == 0 and hints.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        Hints(max_bytes=0)


def test_hints_of_a_member_that_left_go_to_the_new_owners() -> None:
    hints = Hints()
    hints.add("gone:1", key_of(1))
    hints.add_delete("gone:1", key_of(2), 5)
    moved = hints.retarget({"gone:1"}, lambda key: ["gone:1", "new:1"])
    assert moved == {"new:1"} and hints.take("new:1") == [key_of(1)]
    assert hints.take_deletes("new:1") == [(key_of(2), 5)] and len(hints) == 0


async def _until(check: object, seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "not within the deadline"
        await asyncio.sleep(0.05)


async def test_a_delete_an_owner_missed_reaches_it_when_it_is_back() -> None:
    # Before: deletes left no hint; the owner out of the path kept its copy, and readers
    # that asked it first read the deleted block until an anti-entropy pass.
    async with peer_servers(2) as servers:
        members = [s.member_id for s in servers]
        url = pool_url(members, replicas=2, rejoin_after=5)
        async with PeerTier.from_url(url) as tier:
            key = key_of(3)
            await tier.put(key, sample_block(3))
            owner = servers[0]
            tier.members.mark_dead(owner.member_id, "test: out of the path")
            assert await tier.delete(key)
            assert (await owner.segment.get(key)) is not None  # it missed the delete

            async def deleted() -> bool:
                return await owner.segment.get(key) is None

            await _until(deleted)
            await tier.flush()
            assert owner.versions.state(key, False)[0] == 2  # its tombstone
            assert tier.stats()["hinted_deletes_handed_over"] == 1


async def test_hints_for_a_member_that_leaves_the_ring_go_to_the_new_owner() -> None:
    # Before: the hints waited for the member that left, forever.
    async with peer_servers(3) as servers:
        members = [s.member_id for s in servers]
        # rejoin_after: the member taken out stays out (it never gets its hints itself).
        async with PeerTier.from_url(pool_url(members, replicas=2,
                                              rejoin_after=100000)) as tier:
            key = next(key_of(i) for i in range(1000)
                       if tier.members.order(key_of(i))[0] == members[0])
            first, second, third = tier.members.order(key)
            tier.members.mark_dead(first, "test: out of the path")
            await tier.put(key, sample_block(4))  # copies on second and third, a hint
            by_id = {s.member_id: s for s in servers}
            await by_id[third].segment.delete(key)  # the fallback copy gone (evicted)
            assert tier.stats()["hints"] == 1
            await tier.members.apply_members({second, third})

            async def on_new_owner() -> bool:
                got = await by_id[third].segment.get(key)
                return got is not None and bool(np.array_equal(got, sample_block(4)))

            await _until(on_new_owner)
            assert tier.stats()["hints"] == 0
