"""Security of the peer server: bearer tokens, TLS, mutual TLS, and a fuzz run of malformed
requests against a `kvtier serve` process (no 5xx, stays up, memory bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import trustme

from kvtier.codec import encode_frame
from kvtier.errors import PeerError
from kvtier.peer.client import PeerClient
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.peer.tls import client_context, server_context
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN, ServeProcess, token_file

FRAME = encode_frame(sample_block(1)).to_bytes()
KEY_HEX = key_of(5).hex()


@pytest.fixture
async def server() -> AsyncIterator[PeerServer]:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await srv.start()
    await srv.segment.put(key_of(5), sample_block(5))
    yield srv
    await srv.stop()


def _snapshot(srv: PeerServer) -> dict[bytes, bytes]:
    return {k: v.tobytes() for k, v in srv.segment._blocks.items()}  # type: ignore[attr-defined]


ROUTES = [("GET", f"/v1/blocks/{KEY_HEX}", None), ("PUT", f"/v1/blocks/{KEY_HEX}", FRAME),
          ("PUT", "/v1/blocks/aa", FRAME), ("DELETE", f"/v1/blocks/{KEY_HEX}", None),
          ("POST", "/v1/batch/get", b"\1\0\0\0\1\0\xaa"),
          ("POST", "/v1/batch/put", b"\0\0\0\0"),
          ("POST", "/v1/batch/delete", struct.pack("<IH", 1, 16) + key_of(5)),
          ("POST", "/v1/batch/exists", b"\0\0\0\0"), ("GET", "/v1/health", None),
          ("GET", "/metrics", None), ("GET", "/v1/nowhere", None)]


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Bearer {TOKEN}x",
                                  "Bearer other-pool-token", TOKEN, f"bearer {TOKEN}",
                                  f"Basic {TOKEN}", "Bearer ", "Bearer \u00e9t\u00e9"])
async def test_bad_tokens_are_401_with_no_side_effect(server: PeerServer,
                                                      auth: str | None) -> None:
    before = _snapshot(server)
    headers = {} if auth is None else {"Authorization": auth}
    async with aiohttp.ClientSession(base_url=server.url) as http:
        for method, path, body in ROUTES:
            async with http.request(method, path, data=body, headers=headers) as r:
                assert r.status == 401, (method, path)
                assert r.headers["WWW-Authenticate"] == "Bearer"
    assert _snapshot(server) == before


async def test_tier_with_another_pools_token_misses_and_changes_nothing(
        server: PeerServer) -> None:
    before = _snapshot(server)
    tier = PeerTier.from_url(f"peers://{server.member_id}?token=other-pool&timeout=1")
    async with tier:
        assert await tier.get(key_of(5)) is None
        assert await tier.contains(key_of(5)) is False
        with pytest.raises(PeerError):
            await tier.put(key_of(6), sample_block(6))
        assert await tier.delete(key_of(5)) is False
    assert _snapshot(server) == before


def test_server_requires_a_token_unless_told() -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="token"):
        PeerServer(DRAMTier(), token=None)
    with pytest.raises(ConfigError, match="token"):
        PeerServer(DRAMTier(), token="")
    assert PeerServer(DRAMTier(), token=None, insecure_no_auth=True).host == "127.0.0.1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    paths = {"ca": tmp / "ca.pem", "other_ca": tmp / "other.pem", "server": tmp / "srv.pem",
             "client": tmp / "client.pem", "rogue": tmp / "rogue.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    other_ca.cert_pem.write_to_path(str(paths["other_ca"]))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(paths["server"]))
    ca.issue_cert("client.kvtier").private_key_and_cert_chain_pem.write_to_path(
        str(paths["client"]))
    other_ca.issue_cert("client.kvtier").private_key_and_cert_chain_pem.write_to_path(
        str(paths["rogue"]))
    return {k: str(v) for k, v in paths.items()}


async def test_tls_with_generated_ca(pki: dict[str, str]) -> None:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True,
                     ssl_context=server_context(pki["server"]))
    await srv.start()
    try:
        assert srv.url.startswith("https://")
        tier = PeerTier.from_url(f"peers://{srv.member_id}?token={TOKEN}&tls_ca={pki['ca']}")
        async with tier:
            await tier.put(key_of(1), sample_block(1))
            got = await tier.get(key_of(1))
            assert got is not None and got.tobytes() == sample_block(1).tobytes()
        untrusting = PeerClient(srv.member_id, token=TOKEN, timeout=2,
                                ssl_context=client_context(pki["other_ca"]))
        with pytest.raises(PeerError):
            await untrusting.health()
        await untrusting.close()
        plain = PeerClient(srv.member_id, token=TOKEN, timeout=2)
        with pytest.raises(PeerError):
            await plain.health()
        await plain.close()
    finally:
        await srv.stop()


async def test_mutual_tls_via_kvtier_serve(pki: dict[str, str], tmp_path: Path) -> None:
    proc = ServeProcess(["--tier", "dram://", "--tls-cert", pki["server"],
                         "--tls-client-ca", pki["ca"]], token_file(tmp_path))
    member = await asyncio.to_thread(proc.start)
    try:
        good = PeerTier.from_url(f"peers://{member}?token={TOKEN}&tls_ca={pki['ca']}"
                                 f"&tls_cert={pki['client']}")
        async with good:
            await good.put(key_of(1), sample_block(1))
            assert await good.get(key_of(1)) is not None
        for extra in ("", f"&tls_cert={pki['rogue']}"):
            refused = PeerTier.from_url(f"peers://{member}?token={TOKEN}&tls_ca={pki['ca']}"
                                        f"{extra}&timeout=2")
            async with refused:
                assert await refused.get(key_of(1)) is None
                with pytest.raises(PeerError):
                    await refused.members.client(member).health()
        ctx = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises((ssl.SSLError, ConnectionError)):
            # TLS 1.3 reports the missing client certificate on the first read.
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", int(member.split(":")[1]), ssl=ctx)
            writer.write(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            if not await asyncio.wait_for(reader.read(100), 5):
                raise ConnectionResetError("closed by server")
    finally:
        proc.stop()


# ---------------------------------------------------------------------------- fuzz
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _raw_request(rng: random.Random) -> bytes:
    kind = rng.randrange(8)
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 400))
    if kind == 1:  # huge declared length, short body
        size = rng.choice([2**31, 2**40, 2**63 - 1, 10**30, -5])
        return (f"PUT /v1/blocks/aa HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {size}\r\n\r\n"
                ).encode() + rng.randbytes(rng.randrange(50))
    if kind == 2:  # truncated head
        head = f"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n"
        return head.encode()[: rng.randrange(1, len(head))]
    if kind == 3:  # bad chunked encoding
        return (f"POST /v1/batch/get HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked"
                f"\r\n\r\n{rng.choice(['zz', 'ffffffffffffffff', '-1', '5'])}\r\nabc\r\n0\r\n\r\n"
                ).encode()
    if kind == 4:  # odd header blocks
        return (f"GET /v1/health HTTP/1.1\r\nHost: x\r\n{auth}" + "X: " + "a" * rng.choice(
            [10, 9000, 70000]) + "\r\n\r\n").encode()
    if kind == 5:  # batch body declaring big lengths
        body = struct.pack("<IH", 1, 1) + b"\xaa" + struct.pack("<Q", rng.choice(
            [2**62, 2**32, 10**9, 7]))
        return (f"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(body)}"
                "\r\n\r\n").encode() + body
    if kind == 6:  # weird request lines
        return rng.choice([b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\r\n\r\n\r\n",
                           b"GET /v1/blocks/" + b"f" * 9000 + b" HTTP/1.1\r\n\r\n",
                           b"BREW /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"])
    body = rng.randbytes(rng.randrange(0, 2000))
    return (f"POST /v1/batch/exists HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(body)}"
            "\r\n\r\n").encode() + body


async def _raw(host: str, port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(payload)
        await writer.drain()
        if writer.can_write_eof():
            # The server may already have answered a bad request and closed (ENOTCONN).
            with contextlib.suppress(OSError):
                writer.write_eof()
        return await asyncio.wait_for(reader.readline(), 3)
    except (ConnectionError, TimeoutError):
        return b""
    finally:
        writer.close()


def _mutated_frame(rng: random.Random) -> bytes:
    frame = bytearray(encode_frame(sample_block(rng.randrange(100), nbytes=256)).to_bytes())
    for _ in range(rng.randrange(1, 4)):
        frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    cut = rng.choice([len(frame), rng.randrange(len(frame))])
    return bytes(frame[:cut])


def _http_request(rng: random.Random) -> tuple[str, str, bytes | None, dict[str, str]]:
    method = rng.choice(["GET", "PUT", "POST", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    path = rng.choice(["/v1/blocks/" + rng.randbytes(rng.randrange(0, 140)).hex(),
                       "/v1/blocks/" + rng.choice(["", "XYZ", "0", "%00", "../../etc"]),
                       "/v1/batch/" + rng.choice(["get", "put", "exists", "delete", "x"]),
                       "/v1/health", "/metrics", "/" + rng.randbytes(8).hex(), "/v1//blocks"])
    body = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 3000)), _mutated_frame(rng),
                       struct.pack("<I", rng.randrange(2**32)) + rng.randbytes(20)])
    headers = {"Authorization": rng.choice([f"Bearer {TOKEN}"] * 4 + ["Bearer x", ""])}
    if rng.random() < 0.2:
        headers["Content-Type"] = rng.choice(["text/plain", "multipart/form-data", "bogus;;=="])
    return method, path, body, headers


@pytest.mark.slow
async def test_fuzz_malformed_requests(tmp_path: Path) -> None:
    proc = ServeProcess(["--tier", "dram://?capacity=32MiB", "--max-body", "1MiB",
                         "--max-block-bytes", "256KiB", "--max-batch", "64"],
                        token_file(tmp_path))
    member = await asyncio.to_thread(proc.start)
    host, port = member.rsplit(":", 1)
    rng = random.Random(20261129)
    statuses: dict[int, int] = {}
    try:
        async with aiohttp.ClientSession(base_url=f"http://{member}") as http:
            rss_start = 0
            deadline = time.monotonic() + 40
            for i in range(3000):
                if time.monotonic() > deadline:
                    break
                if i == 300:
                    rss_start = _rss_kib(proc.pid)
                if i % 3 == 0:
                    line = await _raw(host, int(port), _raw_request(rng))
                    parts = line.split()
                    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
                else:
                    method, path, body, headers = _http_request(rng)
                    try:
                        async with http.request(method, path, data=body, headers=headers,
                                                timeout=aiohttp.ClientTimeout(total=5)) as r:
                            await r.read()
                            status = r.status
                    except aiohttp.ClientError:
                        status = 0
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, (i, status)
            assert sum(statuses.values()) >= 1000
            async with http.get("/v1/health", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200
            async with http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                metrics = await r.text()
        assert 'status="5' not in metrics
        assert proc.proc is not None and proc.proc.poll() is None
        assert _rss_kib(proc.pid) - rss_start < 64 * 1024, statuses
        assert "Traceback" not in proc.output()
    finally:
        proc.stop()
