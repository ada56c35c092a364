"""A peer's answer is checked against what was asked, before it costs the client memory or
its event loop: frames of another size than the pool's blocks are refused undecompressed,
large frames decompress in pieces off the loop, and the limits of what a checksum proves
(a hostile member can forge one; only TLS with a pinned CA keeps the token from it)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trustme
from aiohttp import web

from kvtier.codec import decode_frame, encode_frame
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.peer import protocol as proto
from kvtier.peer.frames import Accept, decode_batch_from_peer
from kvtier.peer.tier import PeerTier
from kvtier.peer.tls import client_context
from tests.helpers.peer_helpers import TOKEN

KEYS = [bytes([i]) * 16 for i in range(1, 9)]
BOMB = 16 << 20  # what each hostile frame declares; a few KiB on the wire (zeros)


@asynccontextmanager
async def hostile_member(frames: dict[bytes, bytes]) -> AsyncIterator[str]:
    """A process on a member's port answering batch gets with ``frames`` (valid checksums,
    bound to the asked keys: xxh3 is public)."""

    async def batch_get(request: web.Request) -> web.Response:
        keys = proto.decode_keys(await request.read(), 1024)
        body = len(keys).to_bytes(4, "little") + b"".join(
            len(k).to_bytes(2, "little") + k + len(frames[k]).to_bytes(8, "little") + frames[k]
            for k in keys)
        return web.Response(body=body, content_type=proto.CONTENT_TYPE)

    async def get_block(request: web.Request) -> web.Response:
        return web.Response(body=frames[bytes.fromhex(request.match_info["key"])],
                            content_type=proto.CONTENT_TYPE)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "uptime_s": 1e6})

    app = web.Application()
    app.router.add_post(proto.BATCH_GET_PATH, batch_get)
    app.router.add_get(proto.BLOCK_PATH, get_block)
    app.router.add_get(proto.HEALTH_PATH, health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def bombs() -> dict[bytes, bytes]:
    zeros = np.zeros(BOMB, dtype=np.uint8)
    return {k: encode_frame(zeros, key=k, compress_level=1).to_bytes() for k in KEYS}


async def test_frames_of_another_size_than_the_pools_blocks_are_refused_undecompressed(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: every frame up to max_block_bytes (64 MiB) was decompressed: get_many(64) of
    # 64 MiB bombs took 13 s and 4 GiB. With block_bytes the header alone refuses them.
    async with hostile_member(bombs()) as member:
        tier = PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=5&block_bytes=64KiB")
        async with tier:
            with caplog.at_level(logging.WARNING, logger="kvtier.peer.tier"):
                assert await tier.get_many(KEYS) == [None] * len(KEYS)
                assert await tier.get(KEYS[0]) is None
    assert tier.counts["corrupt"] == len(KEYS) + 1
    assert f"raw_size {BOMB} is not this client's block_bytes 65536" in caplog.text


def test_block_bytes_is_checked_as_configuration() -> None:
    with pytest.raises(ConfigError, match="block_bytes"):
        PeerTier(["127.0.0.1:1"], block_bytes=0)
    with pytest.raises(ConfigError, match="block_bytes"):
        PeerTier(["127.0.0.1:1"], block_bytes=(64 << 20) + 1)


async def test_a_batch_checks_every_header_before_decompressing_any() -> None:
    good = np.arange(4096, dtype=np.uint16)
    frames: list[bytes | None] = [encode_frame(good, key=KEYS[0], compress_level=1).to_bytes(),
                                  encode_frame(np.zeros(BOMB, np.uint8), key=KEYS[1],
                                               compress_level=1).to_bytes(),
                                  encode_frame(good, key=KEYS[0]).to_bytes(),  # another key's
                                  encode_frame(good).to_bytes(),  # not bound to its key
                                  None]
    out = await decode_batch_from_peer(frames, KEYS[:5], Accept(1 << 20, good.nbytes))
    assert np.array_equal(out[0], good)  # type: ignore[arg-type]
    assert isinstance(out[1], CorruptBlockError) and "block_bytes" in str(out[1])
    assert isinstance(out[2], CorruptBlockError) and "another key" in str(out[2])
    assert isinstance(out[3], CorruptBlockError) and "not bound" in str(out[3])
    assert out[4] is None
    # From a member of the previous protocol an unbound frame is that block.
    unbound = await decode_batch_from_peer(frames[3:4], KEYS[3:4],
                                           Accept(1 << 20, unbound=True))
    assert np.array_equal(unbound[0], good)  # type: ignore[arg-type]


@pytest.mark.parametrize("shuffle", [False, True])
def test_large_frames_decompress_in_pieces_exactly(shuffle: bool) -> None:
    rng = np.random.default_rng(7)
    block = (rng.integers(0, 16, size=(3 << 20) // 2 + 3) * 257).astype(np.uint16)  # > 1 MiB
    frame = encode_frame(block, key=b"k", compress_level=1, shuffle=shuffle).to_bytes()
    assert np.array_equal(decode_frame(frame, key=b"k"), block)


def test_a_truncated_large_zstd_payload_is_corrupt_not_short() -> None:
    from kvtier.codec import _checksum, parse_header

    block = np.zeros(4 << 20, dtype=np.uint8)
    frame = bytearray(encode_frame(block, key=b"k", compress_level=1).to_bytes())
    head = parse_header(frame)
    # Cut the zstd stream short but keep its header and a valid checksum: only the
    # decompressor can tell.
    payload = bytes(frame[head.header_len : head.header_len + 40])
    prefix = bytearray(frame[: head.header_len - 8])
    prefix[16:24] = len(payload).to_bytes(8, "little")
    forged = bytes(prefix) + _checksum(b"k", prefix, payload).to_bytes(8, "little") + payload
    with pytest.raises(CorruptBlockError):
        decode_frame(forged, key=b"k")


# ------------------------------------------------------------------- TLS and the token
@asynccontextmanager
async def listener(tls: ssl.SSLContext | None) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A process on a member's port that records what clients send it."""
    seen: list[bytes] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                seen.append(await reader.readuntil(b"\r\n\r\n"))
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()


async def test_over_plain_http_the_token_goes_to_whoever_answers_with_tls_it_does_not(
        tmp_path: object) -> None:
    async with listener(None) as (member, seen):
        async with PeerTier([member], token=TOKEN, timeout=2) as tier:
            assert await tier.get(KEYS[0]) is None
        assert any(TOKEN.encode() in head for head in seen)  # plain HTTP: the token leaks
    pool_ca, impostor_ca = trustme.CA(), trustme.CA()
    impostor = impostor_ca.issue_cert("127.0.0.1").configure_cert
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    impostor(server_tls)
    ca_file = tmp_path / "ca.pem"  # type: ignore[operator]
    pool_ca.cert_pem.write_to_path(str(ca_file))
    async with listener(server_tls) as (member, seen):
        tier = PeerTier([member], token=TOKEN, timeout=2, ssl_context=client_context(str(ca_file)))
        async with tier:
            assert await tier.get(KEYS[0]) is None
        assert not any(TOKEN.encode() in head for head in seen)  # the handshake failed first
