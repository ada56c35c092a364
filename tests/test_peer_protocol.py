"""The wire format as docs/peer-protocol.md states it: requests built byte by byte (no
kvtier.peer.protocol helpers), answers decoded the same way, against a live server."""

from __future__ import annotations

import asyncio
import json
import struct

import aiohttp
import numpy as np
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from kvtier.peer.protocol import Limits
from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN


def doc_frame(payload: bytes, dtype: str, shape: tuple[int, ...],
              key: bytes | None = None) -> bytes:
    """A raw (uncompressed) frame exactly as the doc's table lays it out: version 1, or
    version 2 bound to ``key`` (u8 key length and the key hashed in front of the header)."""
    head = b"KVTB" + bytes([1 if key is None else 2, 0, len(shape), len(dtype)])
    head += struct.pack("<QQ", len(payload), len(payload))
    head += b"".join(struct.pack("<Q", d) for d in shape) + dtype.encode("ascii")
    bound = b"" if key is None else bytes([len(key)]) + key
    checksum = xxhash.xxh3_64(bound + head + payload).intdigest()
    return head + struct.pack("<Q", checksum) + payload


def key_list(keys: list[bytes]) -> bytes:
    return struct.pack("<I", len(keys)) + b"".join(struct.pack("<H", len(k)) + k for k in keys)


def block_list(items: list[tuple[bytes, bytes]]) -> bytes:
    out = struct.pack("<I", len(items))
    for key, frame in items:
        out += struct.pack("<H", len(key)) + key + struct.pack("<Q", len(frame)) + frame
    return out


def parse_block_list(body: bytes) -> list[tuple[bytes, bytes]]:
    (count,) = struct.unpack_from("<I", body, 0)
    off, out = 4, []
    for _ in range(count):
        (klen,) = struct.unpack_from("<H", body, off)
        key = body[off + 2 : off + 2 + klen]
        off += 2 + klen
        (flen,) = struct.unpack_from("<Q", body, off)
        out.append((key, body[off + 8 : off + 8 + flen]))
        off += 8 + flen
    assert off == len(body)
    return out


def test_doc_frame_example_matches_codec() -> None:
    from kvtier.codec import decode_frame, encode_frame

    frame = doc_frame(bytes(range(8)), "|u1", (8,))
    assert frame[:8].hex() == "4b56544201000103"
    assert frame == encode_frame(np.arange(8, dtype=np.uint8)).to_bytes()
    assert decode_frame(frame).tolist() == list(range(8))
    keyed = doc_frame(bytes(range(8)), "|u1", (8,), key=b"\xaa\xbb")
    assert keyed[:8].hex() == "4b56544202000103"
    assert keyed == encode_frame(np.arange(8, dtype=np.uint8), key=b"\xaa\xbb").to_bytes()
    assert decode_frame(keyed, key=b"\xaa\xbb").tolist() == list(range(8))


async def test_single_block_routes(served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    server, http = served
    payload = np.arange(64, dtype="<u2").tobytes()
    frame = doc_frame(payload, "<u2", (4, 16))
    async with http.put("/v1/blocks/0a0b0c", data=frame) as r:
        assert r.status == 204
    async with http.get("/v1/blocks/0a0b0c") as r:
        # Answers are version-2 frames, bound to the key asked for.
        assert r.status == 200 and await r.read() == doc_frame(payload, "<u2", (4, 16),
                                                                key=b"\x0a\x0b\x0c")
        assert r.headers["Content-Type"] == "application/octet-stream"
    async with http.head("/v1/blocks/0a0b0c") as r:
        assert r.status == 200
    async with http.get("/v1/blocks/0a0b0d") as r:
        assert r.status == 404
    async with http.delete("/v1/blocks/0a0b0c") as r:
        assert r.status == 204
    async with http.delete("/v1/blocks/0a0b0c") as r:
        assert r.status == 404
    assert await server.segment.get(b"\x0a\x0b\x0c") is None
    # A version-2 frame is accepted under its own key only.
    async with http.put("/v1/blocks/0a0b0d", data=doc_frame(payload, "<u2", (4, 16),
                                                            key=b"\x0a\x0b\x0c")) as r:
        assert r.status == 400
    async with http.put("/v1/blocks/0a0b0c", data=doc_frame(payload, "<u2", (4, 16),
                                                            key=b"\x0a\x0b\x0c")) as r:
        assert r.status == 204
    assert len(server.segment) == 1  # type: ignore[arg-type]


async def test_batch_routes(served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    server, http = served
    frames = {bytes([i]) * (i + 1): doc_frame(bytes([i]) * 100, "|u1", (100,)) for i in range(3)}
    async with http.post("/v1/batch/put", data=block_list(list(frames.items()))) as r:
        assert r.status == 204
    ask = [b"\x01\x01", b"\xee", b"\x00", b"\x01\x01"]
    async with http.post("/v1/batch/get", data=key_list(ask)) as r:
        assert r.status == 200
        got = parse_block_list(await r.read())
    assert [k for k, _ in got] == ask
    # A key repeated in one request is served once: the repeat answers as missing.
    assert got[0][1] == doc_frame(b"\x01" * 100, "|u1", (100,), key=b"\x01\x01")
    assert got[1][1] == b"" and got[3][1] == b""
    async with http.post("/v1/batch/exists", data=key_list([b"\x00", b"\xee"])) as r:
        assert r.status == 200 and await r.read() == bytes.fromhex("02000000" "01" "00")
    async with http.post("/v1/batch/delete", data=key_list([b"\x00", b"\xee"])) as r:
        assert r.status == 200 and await r.read() == bytes.fromhex("02000000" "01" "00")
    async with http.post("/v1/batch/get", data=key_list([])) as r:
        assert r.status == 200 and await r.read() == b"\0\0\0\0"
    assert len(server.segment) == 2  # type: ignore[arg-type]


async def test_doc_examples(served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    _, http = served
    body = bytes.fromhex("02000000" "0100aa" "0200bbcc")
    assert body == key_list([b"\xaa", b"\xbb\xcc"])
    async with http.put("/v1/blocks/aa", data=doc_frame(b"x", "|u1", (1,))) as r:
        assert r.status == 204
    async with http.post("/v1/batch/exists", data=body) as r:
        assert await r.read() == bytes.fromhex("02000000" "01" "00")


async def test_health_and_metrics(served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    server, http = served
    async with http.put("/v1/blocks/01", data=doc_frame(b"abcd", "|u1", (4,))) as r:
        assert r.status == 204
    async with http.get("/v1/health") as r:
        doc = json.loads(await r.read())
    assert doc["node_id"] == server.member_id and doc["protocol"] == 2
    assert doc["used"] == 4 and doc["blocks"] == 1 and doc["capacity"] is None
    assert doc["uptime_s"] >= 0 and doc["limits"]["max_batch"] == 8
    async with http.get("/metrics") as r:
        text = await r.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("kvtier_peer_requests_total", (("method", "PUT"), ("route", "/v1/blocks/{key}"),
                                                    ("status", "204")))] == 1
    assert samples[("kvtier_store_used", (("scheme", "dram"), ("tier", "0")))] == 4
    assert ("kvtier_peer_received_bytes_total", ()) in samples


def _state(server: PeerServer) -> list[bytes]:
    return sorted(server.segment._blocks)  # type: ignore[attr-defined]


BAD = doc_frame(b"abcd", "|u1", (4,))


BAD_CASES = [
    ("GET", "/v1/blocks/ZZ", None, 400),
    ("GET", "/v1/blocks/ABCD", None, 400),
    ("GET", "/v1/blocks/abc", None, 400),
    ("PUT", "/v1/blocks/" + "ab" * 129, BAD, 400),
    ("PUT", "/v1/blocks/01", BAD[:-1] + b"!", 400),
    ("PUT", "/v1/blocks/01", BAD[:20], 400),
    ("PUT", "/v1/blocks/01", b"", 400),
    ("PUT", "/v1/blocks/01", doc_frame(bytes(2 << 20), "|u1", (2 << 20,)), 413),
    ("POST", "/v1/batch/put", block_list([(b"\x01", BAD), (b"\x02", BAD[:-1] + b"?")]), 400),
    ("POST", "/v1/batch/put", block_list([(b"\x01", BAD), (b"\x02", b"")]), 400),
    ("POST", "/v1/batch/put", block_list([(b"\x01", BAD)]) + b"junk", 400),
    ("POST", "/v1/batch/put", block_list([(bytes([i]), BAD) for i in range(9)]), 413),
    ("POST", "/v1/batch/get", key_list([b""]), 400),
    ("POST", "/v1/batch/get", key_list([b"\x01"])[:-1], 400),
    ("POST", "/v1/batch/exists", struct.pack("<I", 1 << 30), 413),
    ("POST", "/v1/batch/delete", key_list([bytes([i]) for i in range(9)]), 413),
    ("GET", "/v1/nope", None, 404),
    ("GET", "/v2/blocks/01", None, 404),
    ("POST", "/v1/blocks/01", BAD, 405),
    ("GET", "/v1/batch/get", None, 405),
    ("DELETE", "/v1/health", None, 405),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD_CASES,
                         ids=[f"{i}-{c[3]}" for i, c in enumerate(BAD_CASES)])
async def test_bad_requests_change_nothing(
        served: tuple[PeerServer, aiohttp.ClientSession], method: str, path: str,
        body: bytes | None, status: int) -> None:
    server, http = served
    async with http.put("/v1/blocks/77", data=BAD) as r:
        assert r.status == 204
    before = _state(server)
    async with http.request(method, path, data=body) as r:
        assert r.status == status, await r.text()
    assert _state(server) == before


async def test_oversized_content_length_refused_before_body() -> None:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True,
                        limits=Limits(max_block_bytes=1024, max_body_bytes=4096))
    await server.start()
    try:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                     "\r\nContent-Length: 999999999999\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.split()[1] == b"413"
        writer.close()
        await writer.wait_closed()
    finally:
        await server.stop()
