"""Miss reasons under ``placement=local`` with one member SIGSTOPped: a block whose
directory owner or holder did not answer is ``unavailable`` (naming the member and its
state) in ``store.explain``, ``stats()["miss_reasons"]`` and ``kvtier explain``;
``not_stored`` only when every directory owner answered that it knows no holder. Real
`kvtier serve` processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import TieredStore, open_store
from kvtier.misses import MissReason
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import REPO, pool_processes, pool_url

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

BLOCKS = 60
SERVE = ["--tier", "dram://?capacity=64MiB"]
POOL = {"placement": "local", "replicas": 1, "health_interval": 0.2, "timeout": 5}


def _url(members: list[str], home: str) -> str:
    # health_interval=30: the client learns of the stopped member only from its own reads.
    return pool_url(members, placement="local", home=home, replicas=1, timeout=0.5,
                    health_interval=30)


def _directory_owner(store: TieredStore, key: bytes) -> str:
    return store.tiers[0].members.ring.owners(key, 1)[0]  # type: ignore[attr-defined,no-any-return]


async def _check(store: TieredStore, missed: list[bool], gone: str, role: str) -> None:
    """The blocks flagged in ``missed`` miss as ``unavailable`` naming ``gone``; the rest hit."""
    keys = [key_of(i) for i in range(BLOCKS)]
    held = [b is not None for b in await store.get_many(keys)]
    assert held == [not m for m in missed]
    reasons = {r: n for r, n in store.stats()["miss_reasons"].items() if n}
    assert reasons == {"unavailable": sum(missed)}, reasons
    for e, m in zip(await store.explain(keys), missed, strict=True):
        assert e.hit is not m
        if m:
            assert e.reason is MissReason.UNAVAILABLE, str(e)
            assert gone in e.summary() and role in e.summary(), e.summary()
            assert "timed out" in e.summary(), e.summary()


async def test_a_stopped_directory_owner_or_holder_is_unavailable(tmp_path: Path) -> None:
    with pool_processes(tmp_path, 3, lambda i: SERVE, POOL) as (procs, _):
        members = [p.member for p in procs]
        holder, owner, home = members
        async with open_store([_url(members, holder)]) as writer:
            await writer.put_many([(key_of(i), sample_block(i)) for i in range(BLOCKS)])
            owned = [_directory_owner(writer, key_of(i)) == owner for i in range(BLOCKS)]
        assert 0 < sum(owned) < BLOCKS
        # A directory owner stopped: the keys it answers for are unavailable, naming it.
        procs[1].signal(signal.SIGSTOP)
        try:
            async with open_store([_url(members, home)], timeout=5) as fresh:
                await _check(fresh, owned, owner, "directory owner")
                absent = [key_of(10_000 + i) for i in range(30)]
                for e, k in zip(await fresh.explain(absent), absent, strict=True):
                    down = _directory_owner(fresh, k) == owner
                    assert e.reason is (MissReason.UNAVAILABLE if down
                                        else MissReason.NOT_STORED), str(e)
            keys = [key_of(i).hex() for i in range(BLOCKS) if owned[i]][:3]
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "kvtier.cli", "explain", _url(members, home),
                 "--timeout", "2", *[a for k in keys for a in ("--key", k)]],
                cwd=REPO, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            assert out.stdout.count("MISS (unavailable)") == len(keys), out.stdout
            assert "not_stored" not in out.stdout and owner in out.stdout
        finally:
            procs[1].signal(signal.SIGCONT)
        # The holder stopped: every block misses as unavailable, named as a holder where
        # the directory answered and as a directory owner where it is one.
        procs[0].signal(signal.SIGSTOP)
        try:
            async with open_store([_url(members, home)], timeout=5) as fresh:
                await _check(fresh, [True] * BLOCKS, holder, "did not answer")
                summaries = [e.summary() for e in await fresh.explain(
                    [key_of(i) for i in range(BLOCKS)])]
                assert any("holders did not answer" in s for s in summaries)
        finally:
            procs[0].signal(signal.SIGCONT)
