"""A peer put that the server refuses says why (issue 22 item 5): the client's error carries
the server's answer, so the operator knows which limit to change. Real servers on loopback."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import PeerError
from kvtier.peer.protocol import Limits
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN


async def _refused_put(segment: DRAMTier, limits: Limits | None, nbytes: int) -> str:
    server = PeerServer(segment, token=TOKEN, close_segment=True,
                        **({"limits": limits} if limits is not None else {}))
    await server.start()
    try:
        tier = PeerTier.from_url(f"peers://{server.member_id}?token={TOKEN}&timeout=5")
        try:
            with pytest.raises(PeerError) as info:
                await tier.put(key_of(1), np.ones(nbytes, np.uint8))
        finally:
            await tier.aclose()
    finally:
        await server.stop()
    return str(info.value)


async def test_block_over_max_block_bytes_names_the_limit() -> None:
    message = await _refused_put(DRAMTier(), Limits(max_block_bytes=64 << 10), 128 << 10)
    assert "0 of 1 copies" in message
    assert "413" in message and "max_block_bytes" in message


async def test_block_too_big_for_the_segment_names_the_segment() -> None:
    message = await _refused_put(DRAMTier(capacity=64 << 10), None, 128 << 10)
    assert "0 of 1 copies" in message
    assert "capacity" in message or "larger than" in message, message
