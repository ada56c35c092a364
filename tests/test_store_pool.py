"""Pool-wide visibility (issue 10 item 2): a block put through a store with a pool tier is
readable by every other store of the pool once ``put`` returns."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvtier.peer.server import PeerServer
from kvtier.store import open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN


@pytest.fixture
async def server() -> AsyncIterator[PeerServer]:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await server.start()
    yield server
    await server.stop()


async def test_put_is_readable_pool_wide_while_private_dram_still_holds_it(
        server: PeerServer) -> None:
    urls = ["dram://", f"peers://{server.member_id}?token={TOKEN}&timeout=2"]
    a, b = await open_store(urls), await open_store(urls)
    async with a, b:
        await a.put_many([(key_of(i), sample_block(i)) for i in range(16)])
        for i in range(16, 32):
            await a.put(key_of(i), sample_block(i))
        # Still in A's private DRAM: nothing was evicted, yet the pool has every block.
        assert await a.tiers[0].contains_many([key_of(i) for i in range(32)]) == [True] * 32
        got = await b.get_many([key_of(i) for i in range(32)])
        assert all(g is not None and g.tobytes() == sample_block(i).tobytes()
                   for i, g in enumerate(got))
        assert b.stats()["tiers"][1]["hits"] == 32


async def test_pool_write_through_can_be_turned_off(server: PeerServer) -> None:
    urls = ["dram://", f"peers://{server.member_id}?token={TOKEN}&timeout=2"]
    a, b = await open_store(urls, pool_write_through=False), await open_store(urls)
    async with a, b:
        await a.put(key_of(1), sample_block(1))
        assert await b.get(key_of(1)) is None
