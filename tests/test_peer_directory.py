"""The holder directory's wire format (``placement=local``) as docs/peer-protocol.md states
it: requests built byte by byte, answers decoded the same way, against a live server; the
same auth, limits and 400/401/413 answers, with no side effect, as every other route."""

from __future__ import annotations

import struct

import aiohttp
import numpy as np
import pytest

from kvtier.codec import encode_frame
from kvtier.peer.directory import Directory
from kvtier.peer.server import PeerServer


def key_list(keys: list[bytes]) -> bytes:
    return struct.pack("<I", len(keys)) + b"".join(struct.pack("<H", len(k)) + k for k in keys)


def update(holder: bytes, add: list[bytes], remove: list[bytes]) -> bytes:
    return struct.pack("<H", len(holder)) + holder + key_list(add) + key_list(remove)


def parse_holders(body: bytes) -> list[list[str]]:
    (count,) = struct.unpack_from("<I", body, 0)
    off, out = 4, []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", body, off)
        off += 2
        holders = []
        for _ in range(n):
            (size,) = struct.unpack_from("<H", body, off)
            holders.append(body[off + 2:off + 2 + size].decode())
            off += 2 + size
        out.append(holders)
    assert off == len(body)
    return out


async def _post(http: aiohttp.ClientSession, path: str, body: bytes) -> tuple[int, bytes]:
    async with http.post(path, data=body) as r:
        return r.status, await r.read()


async def test_update_then_lookup_as_documented(
        served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    _, http = served
    a, b = b"\x0a", b"\x0b"
    assert await _post(http, "/v1/dir/update", update(b"h1:7070", [a, b], [])) == (
        200, struct.pack("<I", 0))
    status, body = await _post(http, "/v1/dir/update", update(b"h2:7070", [a], []))
    assert status == 200
    status, body = await _post(http, "/v1/dir/lookup", key_list([a, b, b"\x0c"]))
    assert status == 200 and parse_holders(body) == [["h1:7070", "h2:7070"], ["h1:7070"], []]
    # A remove answers the holders left, in the same step.
    status, body = await _post(http, "/v1/dir/update", update(b"h1:7070", [], [a, b]))
    assert status == 200 and parse_holders(body) == [["h2:7070"], []]
    status, body = await _post(http, "/v1/dir/lookup", key_list([a, b]))
    assert parse_holders(body) == [["h2:7070"], []]


BAD_CASES = [
    ("/v1/dir/lookup", key_list([b""]), 400),
    ("/v1/dir/lookup", key_list([b"\x01"])[:-1], 400),
    ("/v1/dir/lookup", key_list([bytes([i]) for i in range(9)]), 413),
    ("/v1/dir/update", update(b"", [b"\x01"], []), 400),
    ("/v1/dir/update", update(b"no-port", [b"\x01"], []), 400),
    ("/v1/dir/update", update(b"h:99999", [b"\x01"], []), 400),
    ("/v1/dir/update", update(b"\xff\xfe:1", [b"\x01"], []), 400),
    ("/v1/dir/update", update(b"h:1", [b"\x01"], [])[:-1], 400),
    ("/v1/dir/update", update(b"h:1", [b"\x01"], []) + b"junk", 400),
    ("/v1/dir/update", update(b"h:1", [bytes([i]) for i in range(5)],
                              [bytes([i]) for i in range(5)]), 413),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_CASES,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CASES)])
async def test_bad_directory_requests_change_nothing(
        served: tuple[PeerServer, aiohttp.ClientSession], path: str, body: bytes,
        status: int) -> None:
    server, http = served
    await _post(http, "/v1/dir/update", update(b"h1:7070", [b"\x01"], []))
    before = server.directory.lookup([b"\x01", b"\x02"]), server.directory.updates
    got, _ = await _post(http, path, body)
    assert got == status
    assert (server.directory.lookup([b"\x01", b"\x02"]), server.directory.updates) == before


async def test_directory_routes_need_the_token(
        served: tuple[PeerServer, aiohttp.ClientSession]) -> None:
    server, _ = served
    async with aiohttp.ClientSession(base_url=server.url) as anonymous:
        for path, body in (("/v1/dir/lookup", key_list([b"\x01"])),
                           ("/v1/dir/update", update(b"h:1", [b"\x01"], []))):
            async with anonymous.post(path, data=body) as r:
                assert r.status == 401
    assert len(server.directory) == 0


def test_a_directory_keeps_the_latest_holders_of_a_key() -> None:
    directory = Directory()
    for port in range(1, 20):
        directory.update(f"h:{port}", [b"k"], ())
    [holders] = directory.lookup([b"k"])
    assert holders == [f"h:{p}" for p in range(4, 20)]  # MAX_HOLDERS = 16, oldest out
    directory.update("h:4", [b"k"], ())  # re-registered: now the latest
    assert directory.lookup([b"k"])[0][-1] == "h:4"


@pytest.mark.parametrize("age", ["-1", "nan", "inf", "abc", ""])
async def test_a_forward_with_a_bad_age_is_refused_and_stores_nothing(
        served: tuple[PeerServer, aiohttp.ClientSession], age: str) -> None:
    server, http = served
    key = b"\x05"
    frame = encode_frame(np.arange(8, dtype=np.uint8), key=key).to_bytes()
    body = struct.pack("<I", 1) + struct.pack("<H", 1) + key + struct.pack("<Q", len(frame)) \
        + frame
    status, _ = await _post(http, f"/v1/batch/put?fill=1&age={age}", body)
    assert status == 400
    assert not (await server.segment.contains_many([key]))[0]
    status, _ = await _post(http, "/v1/batch/put?fill=1&age=2.5", body)
    assert status == 204 and (await server.segment.contains_many([key]))[0]
