"""Helpers shared by the peer tests: in-process servers and `kvtier serve` subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.peer.protocol import Limits
from kvtier.peer.server import PeerServer
from kvtier.testing.conformance import SLOW_SECONDS
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier

REPO = Path(__file__).resolve().parents[2]
TOKEN = "pool-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Limits small enough that the protocol tests reach them with a few blocks.
SMALL_LIMITS = Limits(max_block_bytes=1 << 20, max_batch=8, max_body_bytes=4 << 20)
_LISTEN_RE = re.compile(r"kvtier serve listening on (\S+)")


@dataclass
class ServeProcess:
    """A `kvtier serve` child process on loopback."""

    args: list[str]
    token_file: Path
    proc: subprocess.Popen[str] | None = None
    member: str = ""
    log_path: Path = field(default=Path("/dev/null"))
    #: Run before the command (``unshare ...``: the process in namespaces of its own).
    prefix: list[str] = field(default_factory=list)

    def start(self, listen: str = "127.0.0.1:0", timeout: float = 90.0) -> str:
        self.launch(listen)
        return self.wait_ready(timeout)

    def launch(self, listen: str = "127.0.0.1:0") -> None:
        """Start the process without waiting (start several, then :meth:`wait_ready`)."""
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        # Output goes to a file, not a pipe: a full pipe would block the server's logging.
        self.log_path = self.token_file.parent / f"serve-{id(self)}-{time.monotonic_ns()}.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "kvtier.cli", "serve", "--listen", listen,
                 "--token-file", str(self.token_file), *self.args],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Wait for the listening line; returns the member id ``host:port``. The bound is
        generous: at load 8 on two cores, importing the server alone takes over 20 s."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            match = _LISTEN_RE.search(self.output())
            if match:
                self.member = match.group(1)
                return self.member
            time.sleep(0.02)
        text = self.output()
        self.stop()
        raise RuntimeError("kvtier serve did not start:\n" + text)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def pool_url(members: list[str], **opts: object) -> str:
    """A ``peers://`` URL over ``members`` with the tests' token, a 2 s timeout and fast
    health probes (``opts`` add or override query options)."""
    query = "&".join(f"{k}={v}" for k, v in
                     {"token": TOKEN, "timeout": 2, "health_interval": 0.05, **opts}.items())
    return f"peers://{','.join(members)}?{query}"


def token_file(tmp: Path, token: str = TOKEN) -> Path:
    path = tmp / f"token-{abs(hash(token))}"
    path.write_text(token + "\n")
    return path


@contextmanager
def serve_processes(tmp: Path, count: int, args: list[str]) -> Iterator[list[ServeProcess]]:
    """``count`` ready `kvtier serve` processes sharing one token file; stopped on exit.

    All are launched before any is waited for, so their start-up overlaps.
    """
    procs = [ServeProcess(list(args), token_file(tmp)) for _ in range(count)]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@asynccontextmanager
async def peer_servers(count: int, segment: Callable[[], Tier] = DRAMTier
                       ) -> AsyncIterator[list[PeerServer]]:
    """``count`` started in-process peer servers on loopback (token :data:`TOKEN`), each
    serving a fresh ``segment()``; stopped on exit."""
    servers = [PeerServer(segment(), token=TOKEN, close_segment=True) for _ in range(count)]
    started: list[PeerServer] = []
    try:
        for server in servers:
            await server.start()
            started.append(server)
        yield servers
    finally:
        for server in started:
            await server.stop()


@asynccontextmanager
async def served_dram(*, base_url: bool = False, **server_opts: Any
                      ) -> AsyncIterator[tuple[PeerServer, aiohttp.ClientSession]]:
    """A started in-process server of a fresh DRAM segment (token :data:`TOKEN`, the other
    options ``server_opts``) and an HTTP session that sends the token; with ``base_url`` the
    session takes paths relative to the server. Both closed on exit."""
    async with PeerServer(DRAMTier(), token=TOKEN, close_segment=True,
                          **server_opts) as server, aiohttp.ClientSession(
            base_url=server.url if base_url else None, headers=AUTH) as http:
        yield server, http


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` (a scripted member) on a loopback port: its runner (``cleanup()``
    stops it) and its ``host:port``."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


class SlowSegments:
    """``slow_backend`` and ``backend_idle`` of :class:`~kvtier.testing.conformance.TierConformance`
    for a tier over the in-process servers in ``self.servers``: their
    :class:`~kvtier.testing.fakes.LatencyTier` segments take :data:`SLOW_SECONDS` a call
    while slowed."""

    servers: list[PeerServer]
    _slow_until = 0.0

    @contextlib.contextmanager
    def slow_backend(self, tier: Tier) -> Iterator[None]:
        segments = [s.segment for s in self.servers if isinstance(s.segment, LatencyTier)]
        for segment in segments:
            segment.delay = SLOW_SECONDS
        try:
            yield
        finally:
            for segment in segments:
                segment.delay = 0.0
            self._slow_until = time.monotonic() + SLOW_SECONDS

    async def backend_idle(self, tier: Tier) -> None:
        # Every server call slowed started before slow_backend closed, so it has finished
        # its delay by then; one more round trip lets the server finish what follows.
        await asyncio.sleep(max(0.0, self._slow_until - time.monotonic()) + 0.05)
        await tier.contains(b"k" * 16)


class Pool:
    """Servers that can be stopped and restarted empty on their own port."""

    def __init__(self) -> None:
        self.servers: dict[str, PeerServer] = {}

    async def start(self, port: int = 0) -> str:
        server = PeerServer(DRAMTier(), token=TOKEN, port=port, close_segment=True)
        await server.start()
        self.servers[server.member_id] = server
        return server.member_id

    async def stop(self, member: str) -> None:
        await self.servers.pop(member).stop()

    async def restart_empty(self, member: str) -> None:
        await self.stop(member)
        await self.start(int(member.rpartition(":")[2]))

    async def close(self) -> None:
        for server in list(self.servers.values()):
            await server.stop()


def free_members(count: int) -> list[str]:
    """``count`` loopback member ids on ports free now (for a pool whose members must be
    known before they start: ``kvtier serve --pool``)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def pool_processes(tmp: Path, count: int, args: Callable[[int], list[str]],
                   pool_opts: dict[str, object]) -> Iterator[tuple[list[ServeProcess], str]]:
    """``count`` ready `kvtier serve --pool POOL` processes (``args(i)``: member i's own
    arguments; ``pool_opts``: the pool URL's options beyond :func:`pool_url`'s), as
    ``(processes, pool URL)``; stopped on exit."""
    members = free_members(count)
    url = pool_url(members, **pool_opts)
    tokens = token_file(tmp)
    procs = [ServeProcess([*args(i), "--pool", url], tokens) for i in range(count)]
    try:
        for proc, member in zip(procs, members, strict=True):
            proc.launch(member)
        for proc in procs:
            proc.wait_ready()
        yield procs, url
    finally:
        for proc in procs:
            proc.stop()
