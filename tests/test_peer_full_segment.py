"""A peer server whose segment cannot make room (DRAM over a full disk or a refusing tier)
refuses the put (507) instead of acknowledging a copy it will drop, so the client stores
the copy elsewhere and every acknowledged key survives losing a healthy member (issue 21)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvtier.codec import encode_frame
from kvtier.errors import PeerError, PeerStatusError
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.store import TieredStore
from kvtier.testing.conformance import BLOCK_BYTES, key_of, sample_block
from kvtier.testing.fakes import FailingTier
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.peer_helpers import TOKEN
from tests.helpers.tmpfs import fill_up, mounted_tmpfs

PUTS = 60
DRAM_BLOCKS = 8


@pytest.fixture(params=["full-lmdb", "refusing"])
async def lower(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    """The tier under the full server's DRAM: an LMDB on a full tmpfs (root only), or a
    DRAM tier that refuses every put."""
    if request.param == "refusing":
        yield FailingTier(DRAMTier(), fail={"put"})
        return
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        tier = LMDBTier(mnt / "db", capacity=64 << 20)
        assert not await tier.contains(key_of(0))  # opened while the disk has room
        fill_up(mnt)
        yield tier


def _client(servers: list[PeerServer]) -> PeerTier:
    return PeerTier([s.member_id for s in servers], token=TOKEN, replicas=2, timeout=2.0)


async def _holders(servers: list[PeerServer], key: bytes) -> int:
    return sum([(await s.segment.contains_many([key]))[0] for s in servers])


@pytest.mark.slow
async def test_acked_keys_survive_a_member_loss_when_one_segment_is_full(lower: Tier) -> None:
    full = PeerServer(TieredStore([DRAMTier(capacity=DRAM_BLOCKS * BLOCK_BYTES), lower],
                                  close_flush=False), token=TOKEN, close_segment=True)
    healthy = [PeerServer(DRAMTier(), token=TOKEN, close_segment=True) for _ in range(2)]
    servers = [full, *healthy]
    running: list[PeerServer] = []
    try:
        for server in servers:
            await server.start()
            running.append(server)
        acked: list[int] = []
        async with _client(servers) as client:
            for i in range(PUTS):
                try:
                    await client.put(key_of(i), sample_block(i))
                except PeerError:
                    continue
                acked.append(i)
            on_full = [i for i in acked
                       if full.member_id in client.members.ring.owners(key_of(i), 2)]
            # What the full server answers: 507, which the client counts as "not stored".
            key = key_of(PUTS)
            with pytest.raises(PeerStatusError) as refused:
                await client.members.client(full.member_id).put(
                    key, encode_frame(sample_block(PUTS), key=key))
            assert refused.value.status == 507 and "no tier accepted" in str(refused.value)
            # A full member refused writes; it is up and still serves what it holds.
            assert client.members.alive(full.member_id)
        assert len(acked) == PUTS and len(on_full) > DRAM_BLOCKS
        # Every acknowledged put left its two copies (the full server's, or a fallback's).
        thin = [i for i in acked if await _holders(servers, key_of(i)) < 2]
        assert not thin, f"{len(thin)} of {len(acked)} acked keys hold fewer than 2 copies"
        for gone in healthy:  # either healthy member may be lost: nothing acked goes with it
            others = [s for s in servers if s is not gone]
            readable = [await _holders(others, key_of(i)) > 0 for i in acked]
            lost = [i for i, ok in zip(acked, readable, strict=True) if not ok]
            assert not lost, f"{len(lost)} acked keys held only by {gone.member_id}"
        await healthy[0].stop()
        running.remove(healthy[0])
        async with _client(servers) as reader:  # a fresh client, one member down
            got = await reader.get_many([key_of(i) for i in acked])
        missing = [i for i, block in zip(acked, got, strict=True) if block is None]
        assert not missing, f"{len(missing)} of {len(acked)} acked keys unreadable"
        assert all(block is not None and block.tobytes() == sample_block(i).tobytes()
                   for i, block in zip(acked, got, strict=True))
    finally:
        for server in running:
            await server.stop()
