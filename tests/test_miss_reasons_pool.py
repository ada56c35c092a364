"""Miss reasons in a pool with a member down: a block whose owner is stopped or killed is
``unavailable`` (naming the owner and its state), for the writer and for a fresh client, in
``store.explain``, ``stats()["miss_reasons"]`` and ``kvtier explain``; ``not_stored`` only
when every owner answered "not here". Real `kvtier serve` processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import TieredStore, open_store
from kvtier.misses import MissReason
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import REPO, ServeProcess, pool_url, serve_processes

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

BLOCKS = 60


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    with serve_processes(tmp_path, 3, ["--tier", "dram://?capacity=64MiB"]) as procs:
        yield procs


def _url(members: list[str]) -> str:
    # health_interval=30: the fresh client learns of the member only from its own reads.
    return pool_url(members, replicas=1, timeout=0.5, health_interval=30)


def _owner(store: TieredStore, i: int) -> str:
    tier = store.tiers[0]
    return tier.members.ring.owners(key_of(i), 1)[0]  # type: ignore[attr-defined,no-any-return]


async def _read_all(store: TieredStore) -> list[bool]:
    return [b is not None for b in await store.get_many([key_of(i) for i in range(BLOCKS)])]


async def _check(store: TieredStore, gone: str, how: str) -> int:
    """Every block misses exactly when ``gone`` owns it, as ``unavailable`` naming it."""
    held = await _read_all(store)
    owned = [_owner(store, i) == gone for i in range(BLOCKS)]
    assert held == [not o for o in owned]
    lost = sum(owned)
    reasons = {r: n for r, n in store.stats()["miss_reasons"].items() if n}
    assert reasons == {"unavailable": lost}, reasons
    found = await store.explain([key_of(i) for i in range(BLOCKS)])
    for e, o in zip(found, owned, strict=True):
        assert e.hit is not o
        if o:
            assert e.reason is MissReason.UNAVAILABLE, str(e)
            assert gone in e.summary() and how in e.summary(), e.summary()
    return lost


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
async def test_owner_down_is_unavailable_for_writer_and_fresh_client(
        three: list[ServeProcess], sig: signal.Signals) -> None:
    members = [p.member for p in three]
    victim = three[1]
    how = "timed out" if sig is signal.SIGSTOP else "Connect"
    async with open_store([_url(members)]) as writer:
        await writer.put_many([(key_of(i), sample_block(i)) for i in range(BLOCKS)])
        victim.signal(sig)
        try:
            lost = await _check(writer, victim.member, how)
            assert 0 < lost < BLOCKS
            async with open_store([_url(members)], timeout=5) as fresh:
                assert await _check(fresh, victim.member, how) == lost
            # A key nobody stored: its owner answered "not here" (or is the one down).
            absent = [key_of(10_000 + i) for i in range(30)]
            for e, k in zip(await writer.explain(absent), absent, strict=True):
                down = writer.tiers[0].members.ring.owners(k, 1)[0] == victim.member  # type: ignore[attr-defined]
                assert e.reason is (MissReason.UNAVAILABLE if down else MissReason.NOT_STORED)
            # From a shell: kvtier explain opens the pool afresh.
            keys = [key_of(i).hex() for i in range(BLOCKS)
                    if _owner(writer, i) == victim.member][:3]
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "kvtier.cli", "explain", _url(members), "--timeout", "2",
                 *[a for k in keys for a in ("--key", k)]],
                cwd=REPO, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            assert out.stdout.count("MISS (unavailable)") == len(keys), out.stdout
            assert "not_stored" not in out.stdout and victim.member in out.stdout
        finally:
            if sig is signal.SIGSTOP:
                victim.signal(signal.SIGCONT)
