"""The peer client against hostile or broken peers: raw asyncio servers on loopback that send
heads the client cannot frame safely, oversized declarations, frames of other keys,
redirects; plus TLS server names and `kvtier serve --loop`. Runs on asyncio and uvloop."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import subprocess
import sys
import tracemalloc
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import trustme
from aiohttp import web

from kvtier.codec import encode_frame
from kvtier.errors import PeerError
from kvtier.peer.client import PeerClient
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.peer.tls import server_context
from kvtier.store import open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import REPO, TOKEN, ServeProcess, token_file

SECRET = "hunter2-pool-secret"
Answer = Callable[[bytes], bytes]


class RawPeer:
    """A loopback TCP server that reads each request (head and Content-Length body) and
    writes whatever ``answer(request_head)`` returns; counts connections."""

    def __init__(self, answer: Answer, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests.append(head)
                writer.write(self.answer(head))
                await writer.drain()
                if self.close_after:
                    await asyncio.sleep(0.05)
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _fixed(data: bytes) -> Answer:
    return lambda _head: data


def _requested_key(head: bytes) -> bytes:
    path = head.split(b" ", 2)[1].decode()
    return bytes.fromhex(path.rsplit("/", 1)[1])


def _http_ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


# --------------------------------------------------------------------------- framing
UNFRAMEABLE = {
    "chunked and length": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                          b"Content-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "duplicate length": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    "conflicting length": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\n"
                          b"abcde",
    "signed length": b"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc",
    "list length": b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc",
    "no length": b"HTTP/1.1 200 OK\r\n\r\nabc",
    "interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
    "bare LF": b"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc",
    "longer than length": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef",
    "obs-fold": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n X-Folded: 1\r\n\r\nabc",
}


@pytest.mark.parametrize("answer", list(UNFRAMEABLE.values()), ids=list(UNFRAMEABLE))
async def test_unframeable_answers_are_refused(answer: bytes) -> None:
    async with RawPeer(_fixed(answer)) as member:
        client = PeerClient(member, token=TOKEN, timeout=2)
        try:
            with pytest.raises(PeerError, match="bad response"):
                await client.get(key_of(1))
        finally:
            await client.close()


async def test_http10_answer_closes_the_connection() -> None:
    peer = RawPeer(_fixed(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
    async with peer as member:
        client = PeerClient(member, token=TOKEN, timeout=2)
        try:
            assert await client.get(key_of(1)) is None
            assert await client.get(key_of(2)) is None
        finally:
            await client.close()
    # HTTP/1.0 is close-by-default: the second request must not reuse the first connection.
    assert peer.connections == 2


async def test_declared_length_over_the_limit_is_refused_before_allocating() -> None:
    huge = b"HTTP/1.1 200 OK\r\nContent-Length: 8000000000\r\n\r\n"
    async with RawPeer(_fixed(huge)) as member:
        client = PeerClient(member, token=TOKEN, timeout=5)
        tracemalloc.start()
        try:
            with pytest.raises(PeerError, match="exceeds this client's limit"):
                await client.get(key_of(1))
            with pytest.raises(PeerError, match="exceeds this client's limit"):
                await client.get_many([key_of(1), key_of(2)])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.close()
    assert peak < 64 << 20


async def test_closing_an_idle_pooled_connection_logs_no_fatal_error(
        caplog: pytest.LogCaptureFixture) -> None:
    # A body larger than the head buffer: the first read fills it completely.
    body = bytes(300 << 10)
    peer = RawPeer(_fixed(_http_ok(body)), close_after=True)
    caplog.set_level(logging.DEBUG, logger="asyncio")
    async with peer as member:
        client = PeerClient(member, token=TOKEN, timeout=2)
        try:
            for _ in range(3):
                got = await client.get(key_of(1))
                assert got is not None and got.nbytes == len(body)
                await asyncio.sleep(0.2)  # the peer closes the now idle connection
        finally:
            await client.close()
    assert "get_buffer" not in caplog.text
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


# ------------------------------------------------------------------- frame trust
@pytest.fixture
async def real() -> AsyncIterator[PeerServer]:
    async with PeerServer(DRAMTier(), token=TOKEN, close_segment=True) as server:
        yield server


async def _frame_from(server: PeerServer, key: bytes) -> bytes:
    client = PeerClient(server.member_id, token=TOKEN, timeout=2)
    try:
        frame = await client.get(key)
    finally:
        await client.close()
    assert frame is not None
    return bytes(frame)


class ImpostorPeer(RawPeer):
    """Answers every block GET, and every batch get entry, with ``frame_of(key)``."""

    def __init__(self, frame_of: Callable[[bytes], bytes]) -> None:
        super().__init__(self._answer)
        self.frame_of = frame_of
        self.bodies: list[bytes] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                if b"/v1/batch/get" in head:
                    (count,) = struct.unpack_from("<I", body, 0)
                    off, out = 4, [struct.pack("<I", count)]
                    for _ in range(count):
                        (klen,) = struct.unpack_from("<H", body, off)
                        key = body[off + 2 : off + 2 + klen]
                        off += 2 + klen
                        frame = self.frame_of(key)
                        out.append(struct.pack("<H", klen) + key
                                   + struct.pack("<Q", len(frame)) + frame)
                    writer.write(self._ok(b"".join(out)))
                else:
                    writer.write(self._answer(head))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        return self._ok(self.frame_of(_requested_key(head)))

    def _ok(self, body: bytes) -> bytes:
        return _http_ok(body)


async def test_a_valid_frame_of_another_key_is_a_miss(real: PeerServer) -> None:
    other = key_of(99)
    await real.segment.put(other, sample_block(99))
    stolen = await _frame_from(real, other)
    async with ImpostorPeer(lambda _key: stolen) as member:
        tier = PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=2")
        async with tier:
            for _ in range(5):
                assert await tier.get(key_of(1)) is None
            assert await tier.get_many([key_of(1), key_of(2)]) == [None, None]
            # Asked for the key the frame was written for, it is the right block.
            got = await tier.get(other)
            assert got is not None and got.tobytes() == sample_block(99).tobytes()
            assert tier.stats()["corrupt"] == 7


class Protocol2Impostor(ImpostorPeer):
    """An impostor that announces protocol 2, whose answers must be key-bound frames."""

    def _ok(self, body: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\nKvtier-Protocol: 2\r\nContent-Length: %d\r\n\r\n"
                % len(body) + body)


async def test_an_unbound_frame_from_a_protocol_2_peer_is_a_miss() -> None:
    # Version-1 frames carry no key binding: a peer of protocol 2 must not answer with them
    # (a peer of protocol 1 may: tests/test_peer_versions.py).
    unbound = encode_frame(sample_block(1)).to_bytes()
    async with Protocol2Impostor(lambda _key: unbound) as member:
        tier = PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=2")
        async with tier:
            assert await tier.get(key_of(1)) is None
            assert await tier.get_many([key_of(1), key_of(2)]) == [None, None]


async def test_a_frame_declaring_more_than_the_client_limit_is_not_decompressed() -> None:
    big = np.zeros(128 << 20, dtype=np.uint8)  # 128 MiB of zeros: a few KiB compressed
    bombs = {key_of(i): encode_frame(big, compress_level=1, key=key_of(i)).to_bytes()
             for i in (1, 2)}
    del big
    assert all(len(b) < 1 << 20 for b in bombs.values())
    async with ImpostorPeer(lambda key: bombs[key]) as member:
        tier = PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=5")
        async with tier:
            tracemalloc.start()
            try:
                assert await tier.get(key_of(1)) is None
                assert await tier.get_many([key_of(1), key_of(2)]) == [None, None]
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert tier.stats()["corrupt"] == 3
    assert peak < 32 << 20  # nothing was decompressed


# --------------------------------------------------------------- redirects, secrets
@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server that redirects every request to a same-origin path that would answer
    like a healthy peer; returns its member id and the log of requests that reached it."""
    followed: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"/elsewhere{request.path}")

    async def elsewhere(request: web.Request) -> web.Response:
        followed.append(request.path)
        if request.path.endswith("/v1/health"):
            return web.json_response({"status": "ok", "node_id": "x", "used": 0})
        return web.Response(text="kvtier_peer_uptime_seconds 1\n")

    app = web.Application()
    app.router.add_route("*", "/elsewhere/{tail:.*}", elsewhere)
    app.router.add_route("*", "/{tail:.*}", redirect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"127.0.0.1:{port}", followed
    await runner.cleanup()


async def test_redirects_are_never_followed_and_the_token_never_logged(
        redirecting: tuple[str, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    member, followed = redirecting
    caplog.set_level(logging.DEBUG)
    tier = PeerTier.from_url(f"peers://{member}?token={SECRET}&timeout=1&health_interval=0.05")
    async with tier:
        await tier.members.check_health()
        assert not tier.members.alive(member)  # a redirecting member is not alive
        tier.members._mark_alive(member)
        assert await tier.get(key_of(1)) is None
        assert await tier.contains_many([key_of(1), key_of(2)]) == [False, False]
        with pytest.raises(PeerError) as raised:
            await tier.put(key_of(1), sample_block(1))
        client = tier.members.client(member)
        for call in (client.health(), client.metrics(), client.exists_many([key_of(1)])):
            with pytest.raises(PeerError) as failed:
                await call
            assert "307" in str(failed.value)
            assert SECRET not in str(failed.value) and SECRET not in repr(failed.value)
        await asyncio.sleep(0.2)  # a few health probes
    assert followed == []
    assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)
    assert SECRET not in caplog.text
    assert "Authorization" not in caplog.text


async def test_a_peer_echoing_the_request_cannot_put_the_token_in_errors_or_logs(
        caplog: pytest.LogCaptureFixture) -> None:
    def echo(head: bytes) -> bytes:
        return b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(head) + head

    caplog.set_level(logging.DEBUG)
    async with RawPeer(echo) as member:
        client = PeerClient(member, token=SECRET, timeout=2)
        try:
            with pytest.raises(PeerError) as raised:
                await client.get(key_of(1))
        finally:
            await client.close()
        tier = PeerTier.from_url(f"peers://{member}?token={SECRET}&timeout=2")
        async with tier:
            with pytest.raises(PeerError):
                await tier.put(key_of(1), sample_block(1))
    assert "Authorization" in str(raised.value)  # the echo is quoted...
    assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)  # ...masked
    assert SECRET not in caplog.text


@pytest.mark.slow
async def test_kvtier_stats_does_not_follow_redirects(redirecting: tuple[str, list[str]],
                                                      tmp_path: Path) -> None:
    member, followed = redirecting
    secret_file = token_file(tmp_path, SECRET)
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "kvtier.cli", "stats", f"http://{member}",
                         "--token-file", str(secret_file), "--timeout", "2"],
        cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "307" in proc.stdout
    assert SECRET not in proc.stdout + proc.stderr
    assert followed == []


# ------------------------------------------------------------------------------ TLS
@pytest.fixture(scope="module")
def named_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and a server certificate for a DNS name only (no IP SAN)."""
    tmp = tmp_path_factory.mktemp("named-pki")
    ca = trustme.CA()
    paths = {"ca": tmp / "ca.pem", "server": tmp / "server.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    ca.issue_cert("pool.kvtier.internal").private_key_and_cert_chain_pem.write_to_path(
        str(paths["server"]))
    return {k: str(v) for k, v in paths.items()}


async def test_tls_server_name_verifies_members_addressed_by_ip(
        named_pki: dict[str, str]) -> None:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True,
                     ssl_context=server_context(named_pki["server"]))
    async with srv:
        base = f"peers://{srv.member_id}?token={TOKEN}&timeout=2&tls_ca={named_pki['ca']}"
        named = PeerTier.from_url(base + "&tls_server_name=pool.kvtier.internal")
        async with named:
            await named.put(key_of(1), sample_block(1))  # one-copy client
            got = await named.get(key_of(1))
            assert got is not None and got.tobytes() == sample_block(1).tobytes()
            assert await named.contains_many([key_of(1), key_of(2)]) == [True, False]  # aiohttp
            assert (await named.members.client(srv.member_id).health())["status"] == "ok"
        # Without the name the certificate (no IP SAN) does not match 127.0.0.1: a miss.
        unnamed = PeerTier.from_url(base)
        async with unnamed:
            assert await unnamed.get(key_of(1)) is None
            with pytest.raises(PeerError):
                await unnamed.members.client(srv.member_id).health()
        wrong = PeerTier.from_url(base + "&tls_server_name=other.kvtier.internal")
        async with wrong:
            assert await wrong.get(key_of(1)) is None


async def test_locate_prefix_verifies_members_by_tls_server_name(
        named_pki: dict[str, str]) -> None:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True,
                     ssl_context=server_context(named_pki["server"]))
    async with srv:
        await srv.segment.put(key_of(1), sample_block(1))
        base = f"peers://{srv.member_id}?token={TOKEN}&timeout=2&tls_ca={named_pki['ca']}"
        keys = [key_of(1), key_of(2)]
        async with open_store([base + "&tls_server_name=pool.kvtier.internal"]) as named:
            found = await named.locate_prefix(keys, timeout=5)
            assert found.nodes[srv.member_id].blocks == 1 and found.pool == 1
        # Without the name the certificate (no IP SAN) does not match: the member is left out.
        async with open_store([base]) as unnamed:
            assert srv.member_id not in (await unnamed.locate_prefix(keys, timeout=5)).nodes


# ----------------------------------------------------------------------- serve --loop
@pytest.mark.slow
@pytest.mark.parametrize("loop", ["uvloop", "asyncio", "auto"])
def test_serve_runs_on_the_loop_asked_for(tmp_path: Path, loop: str) -> None:
    proc = ServeProcess(["--tier", "dram://", "--loop", loop], token_file(tmp_path))
    member = proc.start()
    try:
        assert f"loop {'uvloop' if loop == 'auto' else loop})" in proc.output()
        request = urllib.request.Request(f"http://{member}/v1/health",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.loads(answer.read())["status"] == "ok"
        asyncio.run(_roundtrip(member))
    finally:
        proc.stop()


async def _roundtrip(member: str) -> None:
    tier = PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=5")
    async with tier:
        await tier.put(key_of(3), sample_block(3))
        got = await tier.get(key_of(3))
        assert got is not None and got.tobytes() == sample_block(3).tobytes()

