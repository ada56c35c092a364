"""``local://NAME`` against a real `kvtier serve --shm NAME` subprocess: the tier
conformance suite, and what the tier adds (one copy per hit and save, several engines on
one daemon, namespaces, the control socket refusing bad requests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.errors import ConfigError, ShapeMismatchError
from kvtier.shm.files import socket_path
from kvtier.testing.conformance import SLOW_SECONDS, TierConformance, key_of, sample_block
from kvtier.tiers.base import Tier
from kvtier.tiers.local import LocalTier
from kvtier.tiers.registry import tier_from_url
from tests.helpers.peer_helpers import REPO
from tests.helpers.shm_helpers import Daemon, running_daemon


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("daemon"), capacity="256MiB") as proc:
        yield proc


class TestLocalConformance(TierConformance):
    """One daemon for the module; each tier is its own namespace of it. The daemon's DRAM
    budget is its own (it evicts and demotes down its chain), so the budget cases skip as
    for ``peers://``."""

    bounded = False

    @pytest.fixture(autouse=True)
    def _daemon(self, shared_daemon: Daemon) -> Iterator[None]:
        self.daemon = shared_daemon
        self._timers: list[threading.Timer] = []
        self._ns = 0
        yield
        for timer in self._timers:
            timer.join()

    async def make_tier(self, capacity: int | None) -> Tier:
        self._ns += 1
        tier = tier_from_url(f"local://{self.daemon.shm_name}?timeout=2"
                             f"&namespace={os.urandom(6).hex()}-{self._ns}")
        await tier.open()
        return tier

    @contextlib.contextmanager
    def slow_backend(self, tier: Tier) -> Iterator[None]:
        # The real daemon stops (SIGSTOP) and resumes SLOW_SECONDS later.
        self.daemon.signal(signal.SIGSTOP)
        timer = threading.Timer(SLOW_SECONDS, self.daemon.signal, (signal.SIGCONT,))
        timer.start()
        self._timers.append(timer)
        yield

    async def backend_idle(self, tier: Tier) -> None:
        for timer in self._timers:
            await asyncio.to_thread(timer.join)
        await tier.contains(b"k" * 16)  # one more round trip: what it resumed has finished


@pytest.fixture
async def local(shared_daemon: Daemon) -> AsyncIterator[LocalTier]:
    tier = LocalTier(shared_daemon.shm_name, timeout=2, namespace=os.urandom(6).hex())
    await tier.open()
    yield tier
    await tier.aclose()


async def test_save_and_hit_are_one_copy_each(local: LocalTier) -> None:
    """A save lands in the slot the engine copied it into (the daemon's arena grows by the
    block once, not twice); a hit copies straight into the caller's buffer."""
    block = sample_block(4, nbytes=1 << 20, dtype="<f4").reshape(256, 1024)
    before = (await local.daemon_stats())["arena_used_bytes"]
    await local.put(key_of(1), block)
    after = (await local.daemon_stats())["arena_used_bytes"]
    assert after - before == block.nbytes
    out = np.zeros_like(block)
    async with await kvtier.open_store([local]) as store:
        assert await store.get_many_into([key_of(1), key_of(2)], [out, np.zeros_like(block)]) \
            == [True, False]
    assert out.tobytes() == block.tobytes()
    stats = await local.daemon_stats()
    assert stats["leases"] == 0 and stats["prepared"] == 0


async def test_two_engines_share_one_daemon(shared_daemon: Daemon, tmp_path: Path) -> None:
    """A block one store saved is a hit for another process's store (a subprocess here),
    with no network; another namespace does not see it."""
    namespace = os.urandom(6).hex()
    url = f"local://{shared_daemon.shm_name}?timeout=2&namespace={namespace}"
    block = sample_block(7, nbytes=64 << 10)
    async with await kvtier.open_store([url]) as store:
        await store.put(key_of(3), block)
    script = tmp_path / "reader.py"
    await asyncio.to_thread(
        script.write_text,
        "import asyncio, sys, numpy as np, kvtier\n"
        "async def main():\n"
        f"    async with await kvtier.open_store([{url!r}]) as store:\n"
        "        out = np.zeros(65536, np.uint8)\n"
        f"        hit = await store.get_many_into([{key_of(3)!r}], [out])\n"
        "        sys.stdout.write(out.tobytes().hex() if hit == [True] else 'miss')\n"
        "asyncio.run(main())\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    out, _ = await proc.communicate()
    assert out.decode() == block.view(np.uint8).tobytes().hex()
    other = f"local://{shared_daemon.shm_name}?namespace=other-{namespace}"
    async with await kvtier.open_store([other]) as store:
        assert await store.get(key_of(3)) is None


async def test_mismatched_buffer_refused_before_any_copy(local: LocalTier) -> None:
    await local.put(key_of(1), sample_block(1, dtype="<f2").reshape(8, 64))
    await local.put(key_of(2), sample_block(2, dtype="<f2").reshape(8, 64))
    good, bad = np.full((8, 64), 7, "<f2"), np.full((4, 64), 7, "<f2")
    async with await kvtier.open_store([local]) as store:
        with pytest.raises(ShapeMismatchError):
            await store.get_many_into([key_of(1), key_of(2)], [good, bad])
    assert np.all(good == 7), "a buffer was written before every buffer was checked"
    stats = await local.daemon_stats()
    assert stats["leases"] == 0  # the leases of the refused call were released


def _raw_request(path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/lease", b"{not json"),
    ("/v1/lease", b"[1, 2]"),
    ("/v1/lease", json.dumps({"keys": ["zz"]}).encode()),
    ("/v1/lease", json.dumps({"keys": ["00" * 129]}).encode()),
    ("/v1/lease", json.dumps({"keys": ["00" * 16] * 9000}).encode()),
    ("/v1/prepare", json.dumps({"blocks": [{"key": "00" * 16, "dtype": "O",
                                            "shape": [4]}]}).encode()),
    ("/v1/prepare", json.dumps({"blocks": [{"key": "00" * 16, "dtype": "<f4",
                                            "shape": [-1]}]}).encode()),
    ("/v1/release", json.dumps({"leases": ["x"]}).encode()),
    ("/v1/commit", json.dumps({"leases": [True]}).encode()),
], ids=["not-json", "not-object", "bad-hex", "long-key", "too-many", "object-dtype",
        "negative-shape", "bad-ids", "bool-ids"])
async def test_malformed_requests_refused_without_effect(shared_daemon: Daemon, path: str,
                                                         body: bytes) -> None:
    sock = socket_path(shared_daemon.shm_name)
    before = json.loads(_raw_request(sock, (
        b"GET /v1/stats HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n"
    )).partition(b"\r\n\r\n")[2])
    answer = await asyncio.to_thread(_raw_request, sock, _post(path, body))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    after = json.loads(_raw_request(sock, (
        b"GET /v1/stats HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n"
    )).partition(b"\r\n\r\n")[2])
    for field in ("leases", "prepared", "arena_used_bytes", "committed", "leased"):
        assert after.get(field, 0) == before.get(field, 0), field


async def test_oversized_body_refused(shared_daemon: Daemon) -> None:
    body = b'{"keys": ["' + b"0" * (5 << 20) + b'"]}'
    answer = await asyncio.to_thread(_raw_request, socket_path(shared_daemon.shm_name),
                                     _post("/v1/contains", body))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


async def test_other_users_refused(shared_daemon: Daemon) -> None:
    """A process of another user gets 403 (SO_PEERCRED), even through a socket file it could
    open."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    sock_path = str(socket_path(shared_daemon.shm_name))
    script = ("import os, socket\n"
              "os.setuid(65534)\n"
              "s = socket.socket(socket.AF_UNIX)\n"
              f"s.connect({sock_path!r})\n"
              "s.sendall(b'GET /v1/info HTTP/1.1\\r\\nHost: k\\r\\n'\n"
              "          b'Connection: close\\r\\n\\r\\n')\n"
              "print(s.recv(100).decode().split()[1])\n")
    os.chmod(sock_path, 0o666)  # let it connect at all: the peer check must refuse it
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
    finally:
        os.chmod(sock_path, 0o600)
    assert out.decode().strip() == "403"


def test_url_options_checked() -> None:
    with pytest.raises(ConfigError, match="local://NAME with no path"):
        tier_from_url("local://../etc")
    with pytest.raises(ConfigError, match="expected a name"):
        tier_from_url("local://-kv")
    with pytest.raises(ConfigError, match="timeout"):
        tier_from_url("local://kv0?timeout=0")
    with pytest.raises(ConfigError, match="unknown option"):
        tier_from_url("local://kv0?capacity=1GiB")
    tier = tier_from_url("local://kv0?timeout=0.5&namespace=m")
    assert isinstance(tier, LocalTier) and tier.timeout == 0.5
