"""A peer server's answers and its memory are bounded per connection and the same on both
request paths (the data plane and aiohttp's, ``data_plane=False``): raw requests compared
answer for answer, idle connections that cost no receive buffer, bodies that must keep a
rate, a connection cap within the open-files limit, and HEAD answers without a body."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import aiohttp
import numpy as np
import pytest

from kvtier.codec import encode_frame
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.protocol import Limits
from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import REPO, TOKEN

AUTH = f"Authorization: Bearer {TOKEN}\r\n"
KEY = b"\x01\x02\x03\x04"
GET = f"GET /v1/blocks/{KEY.hex()} HTTP/1.1\r\n"


@asynccontextmanager
async def serving(data_plane: bool, **kwargs: object) -> AsyncIterator[PeerServer]:
    srv = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, data_plane=data_plane,
                     **kwargs)  # type: ignore[arg-type]
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def status_of(port: int, request: bytes) -> int:
    """The status of the first answer to ``request`` on a fresh connection (0: none)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(5):
            line = await reader.readline()
        return int(line.split()[1]) if line else 0
    finally:
        writer.close()


def headers(n: int) -> str:
    return "".join(f"X-H{i}: 1\r\n" for i in range(n))


# (name, raw request): every one is answered the same by the data plane and by aiohttp.
HEAD_TABLE = [
    ("plain", GET + "Host: x\r\n" + AUTH + "\r\n"),
    ("missing Host", GET + AUTH + "\r\n"),
    ("two Host lines", GET + "Host: x\r\nHost: y\r\n" + AUTH + "\r\n"),
    ("two User-Agent lines", GET + "Host: x\r\nUser-Agent: a\r\nUser-Agent: b\r\n" + AUTH
     + "\r\n"),
    ("100 KB header line", GET + "Host: x\r\n" + AUTH + "X-Big: " + "a" * 100_000 + "\r\n\r\n"),
    ("8 KiB header line", GET + "Host: x\r\n" + AUTH + "X-Big: " + "a" * 8180 + "\r\n\r\n"),
    ("4,000 headers", GET + "Host: x\r\n" + AUTH + headers(4000) + "\r\n"),
    ("129 headers", GET + "Host: x\r\n" + AUTH + headers(127) + "\r\n"),
    ("100 headers", GET + "Host: x\r\n" + AUTH + headers(98) + "\r\n"),
    ("10 KB URL", f"GET /v1/blocks/{'ab' * 5000} HTTP/1.1\r\nHost: x\r\n" + AUTH + "\r\n"),
    ("no token", GET + "Host: x\r\n\r\n"),
    ("HEAD", f"HEAD /v1/blocks/{KEY.hex()} HTTP/1.1\r\nHost: x\r\n" + AUTH + "\r\n"),
]


async def test_the_data_plane_and_aiohttp_answer_every_head_alike() -> None:
    answers: dict[str, list[int]] = {name: [] for name, _ in HEAD_TABLE}
    for data_plane in (True, False):
        async with serving(data_plane) as srv:
            for name, request in HEAD_TABLE:
                answers[name].append(await status_of(srv.port, request.encode("latin-1")))
    differ = {name: got for name, got in answers.items() if got[0] != got[1]}
    assert not differ, f"data plane vs aiohttp: {differ}"
    # The table covers both outcomes: served (404, no such block) and refused by aiohttp.
    assert answers["plain"] == [404, 404] and answers["missing Host"] == [400, 400]
    assert answers["4,000 headers"] == [400, 400] and answers["100 KB header line"] == [400, 400]


@pytest.mark.parametrize("data_plane", [True, False])
async def test_a_head_miss_has_no_body_and_the_connection_goes_on(data_plane: bool) -> None:
    # aiohttp's client reads the answer to HEAD without a body: body bytes after it would be
    # read as the next answer's status line (BadStatusLine).
    async with serving(data_plane) as srv, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1),
            headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        base = f"http://{srv.member_id}/v1/blocks/{KEY.hex()}"
        for _ in range(3):
            async with http.head(base) as resp:
                assert resp.status == 404
            async with http.get(base) as resp:
                assert resp.status == 404 and await resp.read() == b"no such block"
        frame = encode_frame(np.arange(64, dtype=np.uint8), key=KEY).to_bytes()
        async with http.put(base, data=frame) as resp:
            assert resp.status == 204
        async with http.head(base) as resp:
            assert resp.status == 200 and resp.content_length == len(frame)
        async with http.get(base) as resp:
            assert await resp.read() == frame


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", [True, False])
async def test_a_dripping_body_is_refused_and_frees_its_budget(data_plane: bool) -> None:
    # body_timeout bounds the gap between bytes; a body sent a byte at a time below it
    # would hold its in-flight budget (and everyone else's 503s) until it ended.
    body_timeout = 1.0
    frame = encode_frame(np.zeros(1 << 20, dtype=np.uint8), key=KEY).to_bytes()
    async with serving(data_plane, body_timeout=body_timeout, min_body_rate=64 << 10,
                       max_inflight_bytes=2 << 20,
                       limits=Limits(max_block_bytes=2 << 20, max_body_bytes=2 << 20)) as srv:
        reader, writer = await asyncio.open_connection(srv.host, srv.port)
        writer.write(f"PUT /v1/blocks/{KEY.hex()} HTTP/1.1\r\nHost: x\r\n{AUTH}"
                     f"Content-Length: {len(frame)}\r\n\r\n".encode() + frame[:100])
        answer, dripped = b"", 0
        for i in range(100, 200):  # one byte every 0.4 s: never a gap of body_timeout
            dripped += 1
            writer.write(frame[i : i + 1])
            try:
                async with asyncio.timeout(0.4):
                    answer = await reader.readline()
            except TimeoutError:
                continue
            break
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        # Refused within about 5 * body_timeout of the drip's start: counted in bytes, each
        # at least 0.4 s apart (a loaded loop sends fewer, never more, in that time).
        assert dripped <= 5 * body_timeout / 0.4, dripped
        assert srv.budget.held == 0 and srv.body_timeouts == 1
        assert await srv.segment.get(KEY) is None


def test_body_buffers_go_back_to_the_os_after_a_burst() -> None:
    async def burst() -> tuple[int, float, float, float]:
        pool = BodyBuffers(budget=64 << 20, linger=0.2)
        before = rss_mib(os.getpid())
        views = [pool.take(8 << 20) for _ in range(4)]  # four bodies at once
        for view in views:
            np.frombuffer(view, dtype=np.uint8).fill(1)  # the kernel maps the pages
        del views, view
        reused = pool.take(8 << 20)  # a body after the burst reuses a buffer
        del reused
        held = rss_mib(os.getpid())
        count = pool.held_bytes
        await asyncio.sleep(0.5)  # past linger: every held buffer is dropped
        return count, before, held, rss_mib(os.getpid())

    count, before, held, after = asyncio.run(burst())
    assert count == 32 << 20 and held - before >= 28
    assert after - before < 4, f"RSS {before:.0f} -> {held:.0f} -> {after:.0f} MiB"


# ---------------------------------------------------------------- subprocess servers
_SERVE = """
import asyncio, resource, sys
nofile = int(sys.argv[2])
if nofile:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
if sys.argv[4] == "uvloop":
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier

async def main():
    srv = PeerServer(DRAMTier(), token=sys.argv[1], data_plane=sys.argv[3] == "1",
                     idle_timeout=60.0)
    await srv.start()
    print(srv.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await srv.stop()

asyncio.run(main())
"""


@contextmanager
def subprocess_server(nofile: int = 0, data_plane: bool = True) -> Iterator[tuple[int, int]]:
    """A PeerServer in a child process, on the event loop the test runs on: ``(port, pid)``;
    ``nofile`` sets its RLIMIT_NOFILE."""
    loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, TOKEN, str(nofile),
                             "1" if data_plane else "0", loop], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline()), proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def settled_rss(pid: int) -> float:
    await asyncio.sleep(0.3)
    return rss_mib(pid)


@pytest.mark.one_loop  # the server is a subprocess; the client's loop does not matter
async def test_idle_unauthenticated_connections_cost_no_receive_buffer() -> None:
    # Before: a zero-filled 256 KiB buffer per data-plane connection (500 -> ~125 MiB,
    # still held after they closed).
    with subprocess_server() as (port, pid):
        await status_of(port, (GET + "Host: x\r\n" + AUTH + "\r\n").encode())  # warm up
        before = await settled_rss(pid)
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(500)]
        for _, writer in conns:
            writer.write(b"GET /v1/blocks/01 HTTP/1.1\r\nHost: x\r\n")  # a head never ended
        await asyncio.gather(*(writer.drain() for _, writer in conns))
        held = await settled_rss(pid)
        for _, writer in conns:
            writer.close()
        after = await settled_rss(pid)
    assert held - before < 30, f"500 idle connections: {before:.0f} -> {held:.0f} MiB"
    assert after - before < 30, f"after they closed: {before:.0f} -> {after:.0f} MiB"


@pytest.mark.one_loop  # the server is a subprocess; the client's loop does not matter
async def test_past_the_open_files_limit_connections_get_503_not_resets() -> None:
    # Before: the cap (4096) was above RLIMIT_NOFILE (256), accept() failed with EMFILE and
    # the connections past it were left in the backlog unanswered or reset.
    opened: list[asyncio.StreamWriter] = []
    statuses: list[int | str] = []
    with subprocess_server(nofile=256) as (port, _):
        request = f"GET /v1/health HTTP/1.1\r\nHost: x\r\n{AUTH}\r\n".encode()
        for _ in range(300):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            opened.append(writer)  # kept open: every answered connection holds a descriptor
            writer.write(request)
            try:
                async with asyncio.timeout(3):
                    line = await reader.readline()
                statuses.append(int(line.split()[1]) if line else "closed")
            except (TimeoutError, OSError) as exc:
                statuses.append(type(exc).__name__)
                break
        for writer in opened:
            writer.close()
    assert set(statuses) == {200, 503}, statuses[-5:]
    assert statuses.count(200) >= 64
