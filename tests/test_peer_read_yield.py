"""A read that asks no member (every member is out of the path) still yields to the event
loop, so the health loop that would bring members back keeps running.

Before the fix, such a read completed without ever suspending: readers that retried their
misses in a loop held the event loop forever, the health probes never ran, every member
stayed out of the path, and the client spun at 100% CPU inside the read path (the issue-30
row: five hosts, DNS membership changes, a load phase that never ended).
"""

from __future__ import annotations

import asyncio

from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import peer_servers, pool_url

SPINS = 50_000  # reads a reader retries before giving up: a count, never a duration


async def test_a_read_that_asks_nobody_yields_to_the_event_loop() -> None:
    async with peer_servers(2) as servers:
        members = [s.member_id for s in servers]
        async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
            await tier.put(key_of(1), sample_block(1))
            for member in members:
                tier.members.mark_dead(member, "test: out of the path")
            ticked = False

            async def tick() -> None:
                nonlocal ticked
                await asyncio.sleep(0)
                ticked = True

            ticker = asyncio.create_task(tick())
            spins = 0
            while not ticked and spins < SPINS:
                assert await tier.get_many([key_of(1)]) == [None]
                spins += 1
            await ticker
            assert spins < SPINS, "the reads never let another task run"


async def test_health_probes_bring_members_back_while_readers_spin_on_misses() -> None:
    """Every member was taken out of the path at once (a burst of failures); 8 readers
    retry their read in a loop. The health loop still probes, the members rejoin, and the
    reads find the block again (asked as the only owners left that answer probes)."""
    async with peer_servers(2) as servers:
        members = [s.member_id for s in servers]
        async with PeerTier.from_url(pool_url(members, replicas=2)) as tier:
            await tier.put(key_of(7), sample_block(7))
            for member in members:
                tier.members.mark_dead(member, "test: burst of failures")
            spins = 0

            async def reader() -> bool:
                nonlocal spins
                while spins < SPINS:
                    spins += 1
                    if (await tier.get_many([key_of(7)]))[0] is not None:
                        return True
                return False

            found = await asyncio.gather(*(reader() for _ in range(8)))
            assert all(found), f"no member came back within {SPINS} reads"
