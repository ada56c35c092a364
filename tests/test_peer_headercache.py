"""The server's frame-header cache: a header is reused only for the same read-only array,
a changed block is always encoded afresh, and the cache never keeps a block alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest

from kvtier.codec import decode_frame, encode_frame
from kvtier.peer.headercache import FrameHeaders
from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _stored(values: list[int], dtype: str = "<u2") -> np.ndarray:
    arr = np.array(values, dtype=dtype)
    arr.flags.writeable = False
    return arr


def test_repeat_reuses_header_and_matches_encode_frame() -> None:
    cache = FrameHeaders()
    block = _stored(list(range(32)))
    first = cache.encode(b"k1", block)
    again = cache.encode(b"k1", block)
    assert cache.hits == 1
    expected = encode_frame(block, key=b"k1").to_bytes()
    assert first.to_bytes() == again.to_bytes() == expected
    assert decode_frame(again.to_bytes(), key=b"k1").tolist() == list(range(32))


def test_other_object_or_key_is_encoded_afresh() -> None:
    cache = FrameHeaders()
    cache.encode(b"k1", _stored([1, 2, 3]))
    # Same key, another array (a re-put): other bytes and shape, never the old header.
    changed = _stored([[7, 8], [9, 10]], "<f4")
    frame = cache.encode(b"k1", changed)
    assert cache.hits == 0
    assert decode_frame(frame.to_bytes(), key=b"k1").tolist() == [[7, 8], [9, 10]]
    # Same array under another key: bound to that key.
    other = cache.encode(b"k2", changed)
    assert decode_frame(other.to_bytes(), key=b"k2").tolist() == [[7, 8], [9, 10]]
    assert cache.hits == 0


def test_writable_arrays_are_never_cached() -> None:
    cache = FrameHeaders()
    block = np.arange(8, dtype=np.uint8)  # writable: its bytes may change in place
    cache.encode(b"k", block)
    block[0] = 99
    frame = cache.encode(b"k", block)
    assert cache.hits == 0 and len(cache) == 0
    assert decode_frame(frame.to_bytes(), key=b"k").tolist()[0] == 99


def test_cache_holds_no_block_and_is_bounded() -> None:
    cache = FrameHeaders(max_entries=2)
    block = _stored(list(range(4)))
    ref = weakref.ref(block)
    cache.encode(b"a", block)
    del block
    gc.collect()
    assert ref() is None
    for key in (b"b", b"c"):
        cache.encode(key, _stored([1]))
    assert len(cache) == 2
    cache.forget(b"c")
    assert len(cache) == 1
    with pytest.raises(ValueError, match="max_entries"):
        FrameHeaders(max_entries=0)


@pytest.fixture
async def served() -> AsyncIterator[tuple[PeerServer, aiohttp.ClientSession]]:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await server.start()
    async with aiohttp.ClientSession(base_url=server.url, headers=AUTH) as session:
        yield server, session
    await server.stop()


async def test_server_serves_a_replaced_block_afresh(
        served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    server, http = served
    first = np.arange(64, dtype=np.uint8)
    second = np.arange(32, dtype="<u4")[::-1].copy()
    await server.segment.put(b"\x0a", first)
    for _ in range(2):
        async with http.get("/v1/blocks/0a") as r:
            assert r.status == 200
            assert decode_frame(await r.read(), key=b"\x0a").tolist() == first.tolist()
    assert server.frames.hits == 1
    await server.segment.put(b"\x0a", second)  # same key, new block: new header
    async with http.get("/v1/blocks/0a") as r:
        assert decode_frame(await r.read(), key=b"\x0a").tolist() == second.tolist()
    async with http.delete("/v1/blocks/0a") as r:
        assert r.status == 204
    assert len(server.frames) == 0
