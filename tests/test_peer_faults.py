"""Faults with real `kvtier serve` processes: killed, hung (SIGSTOP) and slow peers are
misses within the deadline, never exceptions or hangs; a restarted peer is used again.

Durations are asserted against timeouts scaled by the machine's measured slowdown
(:class:`~tests.helpers.load.Scale`), and "the failed member is no longer asked" by the
pool's error count and the segments' call counts, not by how fast the next read was."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.store import open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.load import Scale
from tests.helpers.peer_helpers import TOKEN, ServeProcess, serve_processes, token_file

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

TIMEOUT = 0.5
SLACK = 0.5


@pytest.fixture
def scale() -> Scale:
    return Scale()


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    with serve_processes(tmp_path, 3, ["--tier", "dram://?capacity=64MiB"]) as procs:
        yield procs


def _url(members: list[str], scale: Scale, **opts: object) -> str:
    query = {"token": TOKEN, "timeout": scale(TIMEOUT), "replicas": 2, "health_interval": 0.2,
             **opts}
    return f"peers://{','.join(members)}?" + "&".join(f"{k}={v}" for k, v in query.items())


async def _wait(cond: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_killed_peer_then_restarted(three: list[ServeProcess], scale: Scale) -> None:
    members = [p.member for p in three]
    store = await open_store([_url(members, scale)])
    tier = store.tiers[0]
    assert isinstance(tier, PeerTier)
    async with store:
        await store.put_many([(key_of(i), sample_block(i)) for i in range(500)])
        victim = three[0]
        victim.signal(signal.SIGKILL)
        victim.proc.wait(5)  # type: ignore[union-attr]
        before = tier.counts["errors"]
        errors: int | None = None  # the pool's failed requests when the victim went out
        worst = 0.0
        for i in range(500):
            t0 = time.monotonic()
            got = await store.get(key_of(i))
            worst = max(worst, time.monotonic() - t0)
            assert got is not None and got.tobytes() == sample_block(i).tobytes(), i
            if errors is None and not tier.members.alive(victim.member):
                errors = tier.counts["errors"]
        assert worst < scale(TIMEOUT + SLACK)
        assert not tier.members.alive(victim.member)
        # Out of the path after its first failures (a dropped keep-alive connection, then a
        # refused one), and never asked again.
        assert errors is not None and errors - before <= 2 and tier.counts["errors"] == errors
        t0 = time.monotonic()
        got_all = await store.get_many([key_of(i) for i in range(500)])
        assert time.monotonic() - t0 < scale(TIMEOUT + SLACK)
        assert all(g is not None for g in got_all)
        assert tier.counts["errors"] == errors
        assert await store.lookup_prefix([key_of(i) for i in range(500)]) == 500

        victim.start(listen=victim.member)  # same port
        await _wait(lambda: tier.members.alive(victim.member))
        await store.put_many([(key_of(1000 + i), sample_block(i)) for i in range(100)])
        health = await tier.members.client(victim.member).health()
        assert health["blocks"] > 0  # the restarted peer holds new copies again
        got_new = await store.get_many([key_of(1000 + i) for i in range(100)])
        assert all(g is not None for g in got_new)


async def test_hung_peer_costs_at_most_the_timeout(three: list[ServeProcess],
                                                   scale: Scale) -> None:
    # No background probes: every failure counted on the hung member is a read's.
    tier = PeerTier.from_url(_url([p.member for p in three], scale, health_interval=30))
    async with tier:
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(60)])
        hung = three[1]
        hung.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(*(tier.get(key_of(i)) for i in range(60)))
            assert time.monotonic() - t0 < scale(TIMEOUT + SLACK)
            assert all(r is not None and r.tobytes() == sample_block(i).tobytes()
                       for i, r in enumerate(results))
            # The hung peer is now suspected, asked after its co-owners: no read waits on it.
            suspicion = tier.members.detector[hung.member].suspicion
            assert suspicion >= 1
            for i in range(60):
                assert await tier.get(key_of(i)) is not None
            assert tier.members.detector[hung.member].suspicion == suspicion
            await tier.put(key_of(999), sample_block(999))  # written to live owners
        finally:
            hung.signal(signal.SIGCONT)
        await _wait(lambda: tier.members.alive(hung.member))


@pytest.fixture
async def slow_pool(scale: Scale) -> AsyncIterator[tuple[PeerServer, list[PeerServer]]]:
    slow = PeerServer(LatencyTier(DRAMTier(), delay=scale(1.5)), token=TOKEN,
                      close_segment=True)
    fast = [PeerServer(DRAMTier(), token=TOKEN, close_segment=True) for _ in range(2)]
    for s in (slow, *fast):
        await s.start()
    yield slow, fast
    for s in (slow, *fast):
        await s.stop()


async def test_slow_peer_is_a_miss_within_the_deadline(
        slow_pool: tuple[PeerServer, list[PeerServer]], scale: Scale) -> None:
    slow, fast = slow_pool
    servers = {s.member_id: s for s in (slow, *fast)}
    tier = PeerTier.from_url(_url(list(servers), scale, timeout=scale(0.3),
                                  health_interval=30))
    async with tier:
        keys = [key_of(i) for i in range(40)]
        for i, key in enumerate(keys):  # seed every owner's segment directly
            for owner in tier.members.ring.owners(key, 2):
                inner = servers[owner].segment
                await getattr(inner, "inner", inner).put(key, sample_block(i))
        slow_first = [k for k in keys if tier.members.ring.primary(k) == slow.member_id]
        assert slow_first
        t0 = time.monotonic()
        got = await tier.get(slow_first[0])
        assert time.monotonic() - t0 < scale(0.3 + SLACK)
        assert got is not None  # answered by the replica after the slow primary timed out
        # One timeout puts the member under suspicion, not out of the path: it is asked
        # after its co-owner from now on, so the next read of its keys is fast.
        assert tier.members.alive(slow.member_id)
        assert tier.members.detector[slow.member_id].suspicion == 1
        calls = slow.segment.calls.get("get", 0)  # type: ignore[attr-defined]
        assert await tier.get(slow_first[-1]) is not None
        assert slow.segment.calls.get("get", 0) == calls  # type: ignore[attr-defined]
        single = PeerTier.from_url(_url([slow.member_id], scale, timeout=scale(0.3),
                                        replicas=1))
        async with single:
            t0 = time.monotonic()
            assert await single.get(slow_first[0]) is None
            assert await single.contains_many(slow_first) == [False] * len(slow_first)
            assert time.monotonic() - t0 < scale(2 * 0.3 + SLACK)


async def test_dns_membership_with_localhost() -> None:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await server.start()
    try:
        tier = PeerTier.from_url(f"peers+dns://localhost:{server.port}?token={TOKEN}"
                                 "&timeout=0.5&health_interval=0.1&dns_interval=0.2")
        async with tier:
            await tier.put_many([(key_of(i), sample_block(i)) for i in range(20)])
            assert f"127.0.0.1:{server.port}" in tier.members.members
            got = await tier.get_many([key_of(i) for i in range(20)])
            assert all(g is not None for g in got)
            assert len(server.segment) == 20  # type: ignore[arg-type]
    finally:
        await server.stop()


def test_serve_sigterm_shuts_down_cleanly(tmp_path: Path) -> None:
    proc = ServeProcess(["--tier", "dram://?capacity=1MiB"], token_file(tmp_path))
    proc.start()
    assert proc.proc is not None
    proc.signal(signal.SIGTERM)
    assert proc.proc.wait(10) == 0
    assert "stopped" in proc.output()
    proc.stop()


def test_serve_refuses_to_start_without_token(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.helpers.peer_helpers import REPO

    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--listen",
                          "127.0.0.1:0", "--tier", "dram://"], cwd=REPO, capture_output=True,
                         text=True, timeout=30, env={"PYTHONPATH": str(REPO)})
    assert run.returncode == 2 and "--token-file" in run.stdout


async def test_kvtier_stats_prints_health_and_metrics(tmp_path: Path) -> None:
    import sys

    from tests.helpers.peer_helpers import REPO

    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, node_id="node-a")
    await server.start()
    await server.segment.put(key_of(1), sample_block(1))
    env = {"PYTHONPATH": str(REPO)}
    try:
        for token, want_rc, want in ((TOKEN, 0, "node node-a  version"), ("wrong", 1, "401")):
            path = token_file(tmp_path, token)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvtier.cli", "stats", server.url, "--token-file",
                str(path), cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == want_rc and want in out.decode(), out.decode()
    finally:
        await server.stop()
