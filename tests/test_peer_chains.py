"""``peers://?placement=anchor:1`` against real in-process servers on loopback: the conformance
suite, where a chain's blocks live, and replication, read repair, anti-entropy and membership
changes under chain placement."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import numpy as np
import pytest

from kvtier import open_store
from kvtier.errors import ConfigError
from kvtier.peer.repair import AntiEntropy
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.tiers.base import Tier
from tests.helpers.peer_helpers import TOKEN, Pool, peer_servers

ANCHORED = {"placement": "anchor:1"}
# Tests that fail no member: slow health probes and generous timeouts, so a loaded machine
# cannot take a member out of the path and move a copy to a fallback owner.
CALM = {"health_interval": 30, "timeout": 10}


def _url(members: list[str], **opts: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in
                     {"token": TOKEN, "timeout": 2, "health_interval": 0.05, **opts}.items())
    return f"peers://{','.join(members)}?{query}"


def _chain(index: int, length: int = 6) -> list[bytes]:
    """Chain ``index``: keys ``key_of(index * 100 + i)``."""
    return [key_of(index * 100 + i) for i in range(length)]


def _block(key: bytes) -> np.ndarray:
    return sample_block(int.from_bytes(key[:4], "big"))


async def _holders(servers: list[PeerServer], key: bytes) -> list[str]:
    return [s.member_id for s in servers if await s.segment.contains(key)]


def _block_requests(server: PeerServer) -> int:
    """Requests about blocks this server answered (health probes left out)."""
    return sum(n for (route, _, _), n in server.requests.items() if "health" not in route)


class TestPeerConformanceAnchored(TierConformance):
    """The tier contract over three members, every key the suite uses placed by its chain's
    anchor (chains of five keys, as the store's note_chain would teach it)."""

    bounded = False

    @pytest.fixture(autouse=True)
    async def _servers(self) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            self.stack = stack
            yield

    async def make_tier(self, capacity: int | None) -> Tier:
        servers = await self.stack.enter_async_context(peer_servers(3))
        tier = PeerTier.from_url(_url([s.member_id for s in servers], **ANCHORED))
        for start in range(0, 200, 5):
            tier.note_chain([key_of(i) for i in range(start, start + 5)])
        return tier


@pytest.fixture
async def pool() -> AsyncIterator[list[PeerServer]]:
    async with peer_servers(3) as servers:
        yield servers


async def test_a_chain_and_its_continuation_live_on_the_anchors_owner(
        pool: list[PeerServer]) -> None:
    members = [s.member_id for s in pool]
    chains = [_chain(c, 8) for c in range(12)]
    async with open_store([_url(members, **ANCHORED, **CALM)]) as writer:
        tier = writer.tiers[0]
        assert isinstance(tier, PeerTier)
        for chain in chains:
            await writer.put_many([(k, _block(k)) for k in chain[:5]])
            await writer.put_many([(k, _block(k)) for k in chain[5:]], parent=chain[4])
        for chain in chains:
            owner = tier.members.ring.primary(chain[1])
            assert [await _holders(pool, k) for k in chain] == [[owner]] * 8
        assert all(len(s.segment) > 0 for s in pool)  # type: ignore[arg-type]
        assert tier.stats()["placement"] == "anchor:1"
    # Another client learns the anchors from its lookup: no extra request, every block found.
    async with open_store([_url(members, **ANCHORED, **CALM)]) as reader:
        before = sum(_block_requests(s) for s in pool)
        assert await reader.lookup_prefix(chains[3]) == 8
        assert sum(_block_requests(s) for s in pool) - before == 1  # one owner asked
        got = await reader.get_many(chains[3][2:])  # a partial batch: positions are known
        assert all(np.array_equal(b, _block(k)) for b, k in zip(got, chains[3][2:], strict=True))
        single = await reader.get(chains[3][7])
        assert single is not None and np.array_equal(single, _block(chains[3][7]))


async def test_a_put_after_an_unknown_parent_is_placed_by_its_own_keys(
        pool: list[PeerServer]) -> None:
    members = [s.member_id for s in pool]
    chain = _chain(1, 4)
    async with open_store([_url(members, **ANCHORED, **CALM)]) as store:
        await store.put_many([(k, _block(k)) for k in chain[2:]], parent=chain[1])
        tier = store.tiers[0]
        assert isinstance(tier, PeerTier)
        for key in chain[2:]:
            assert await _holders(pool, key) == [tier.members.ring.primary(key)]


async def test_replicas_of_a_chain_are_its_anchors_owners(pool: list[PeerServer]) -> None:
    members = [s.member_id for s in pool]
    async with PeerTier.from_url(_url(members, replicas=2, **ANCHORED, **CALM)) as tier:
        for c in range(6):
            chain = _chain(c)
            tier.note_chain(chain)
            await tier.put_many([(k, _block(k)) for k in chain])
            owners = sorted(tier.members.ring.owners(chain[1], 2))
            assert [sorted(await _holders(pool, k)) for k in chain] == [owners] * len(chain)


@pytest.mark.parametrize("placement", ["anchor:x", "chunk:0", "ring"])
def test_bad_placement_is_a_config_error(placement: str) -> None:
    with pytest.raises(ConfigError, match="placement"):
        PeerTier.from_url(f"peers://h1:7070?placement={placement}")


async def test_bad_anchor_on_a_batch_put_is_refused_and_nothing_stored(
        pool: list[PeerServer]) -> None:
    import aiohttp

    from kvtier.codec import encode_frame
    from kvtier.peer import protocol as proto

    body = b"".join(bytes(b) for b in proto.encode_blocks(
        [(key_of(1), encode_frame(sample_block(1), key=key_of(1)))]))
    url = f"http://{pool[0].member_id}{proto.BATCH_PUT_PATH}?anchor=zz"
    async with aiohttp.ClientSession() as http, http.post(
            url, data=body, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 400
    assert len(pool[0].segment) == 0  # type: ignore[arg-type]


# ---------------------------------------------------------------- repair under anchor:1

@pytest.fixture
async def restartable() -> AsyncIterator[Pool]:
    p = Pool()
    yield p
    await p.close()


async def _read_chains(tier: PeerTier, chains: list[list[bytes]]) -> int:
    """Blocks of ``chains`` read back right, each chain read as a store reads a prompt."""
    right = 0
    for chain in chains:
        tier.note_chain(chain)
        got = await tier.get_many(chain)
        right += sum(1 for b, k in zip(got, chain, strict=True)
                     if b is not None and np.array_equal(b, _block(k)))
    return right


async def _until(predicate: object, what: str) -> None:
    for _ in range(400):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(what)


async def test_restart_empty_read_repair_then_second_failure_loses_nothing(
        restartable: Pool) -> None:
    members = [await restartable.start() for _ in range(3)]
    chains = [_chain(c) for c in range(20)]
    async with PeerTier.from_url(_url(members, replicas=2, **ANCHORED)) as tier:
        for chain in chains:
            tier.note_chain(chain)
            await tier.put_many([(k, _block(k)) for k in chain])
        x, y = members[0], members[1]
        await restartable.restart_empty(x)
        await _until(lambda: x in tier.members.recently_changed(60) and tier.members.alive(x),
                     f"the restart of {x} was never noticed")
        assert await _read_chains(tier, chains) == 120
        await tier.flush()
        repaired = tier.stats()["read_repairs"]
        owned_by_x = sum(len(c) for c in chains if x in tier.members.ring.owners(c[1], 2))
        assert repaired == owned_by_x > 0  # whole chains back on their anchor's owner
        await restartable.stop(y)
        assert await _read_chains(tier, chains) == 120


async def test_anti_entropy_rereplicates_chains_to_their_anchors_owner(
        restartable: Pool) -> None:
    """Nobody reads: the anchors the writer sent with its puts let the survivors' passes
    push each chain to its anchor's owner, so a second failure loses nothing."""
    members = [await restartable.start() for _ in range(3)]
    url = _url(members, replicas=2, **ANCHORED)
    repairs = [AntiEntropy(server, PeerTier.from_url(url, self=member, local=server.segment),
                           interval=3600) for member, server in restartable.servers.items()]
    chains = [_chain(c) for c in range(20)]
    async with PeerTier.from_url(url) as tier:
        for chain in chains:
            tier.note_chain(chain)
            await tier.put_many([(k, _block(k)) for k in chain])
    x, y = members[0], members[1]
    await restartable.restart_empty(x)
    try:
        for repair in repairs:
            if repair.server.member_id != x:
                await repair.pool.open()
                await repair.run_pass()
        pushed = sum(r.counts["pushed"] for r in repairs)
        async with PeerTier.from_url(url) as probe:
            owned_by_x = [c for c in chains if x in probe.members.ring.owners(c[1], 2)]
        assert owned_by_x and len(restartable.servers[x].segment) == 6 * len(owned_by_x)  # type: ignore[arg-type]
        assert pushed >= 6 * len(owned_by_x)
        await restartable.stop(y)
        async with PeerTier.from_url(_url(members, replicas=2, **ANCHORED)) as reader:
            assert await _read_chains(reader, chains) == 120
    finally:
        for repair in repairs:
            await repair.close()


async def test_grow_from_three_to_four_members_every_chain_readable(
        restartable: Pool) -> None:
    members = [await restartable.start() for _ in range(4)]
    chains = [_chain(c) for c in range(30)]
    async with PeerTier.from_url(_url(members[:3], **ANCHORED)) as old:
        for chain in chains:
            old.note_chain(chain)
            await old.put_many([(k, _block(k)) for k in chain])
    async with PeerTier.from_url(_url(members, **ANCHORED)) as grown:
        moved = [c for c in chains if grown.members.ring.primary(c[1]) == members[3]]
        assert moved  # the new member owns chains it does not hold
        assert await _read_chains(grown, chains) == 180
        await grown.flush()
        assert grown.stats()["read_repairs"] == 6 * len(moved)  # whole chains moved over
        assert len(restartable.servers[members[3]].segment) == 6 * len(moved)  # type: ignore[arg-type]
