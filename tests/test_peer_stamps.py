"""An acked overwrite or delete is never undone by a member that missed it (issue 30).

Against real `kvtier serve --pool` processes: a member killed (SIGKILL) and restarted on
its LMDB directory, or frozen (SIGSTOP) for two seconds, holds the old values of keys its
co-owners overwrote or deleted meanwhile. Stamps and tombstones (kvtier.peer.versions)
make the co-owners' newer writes win: no acked overwrite reads back old, no acked delete
comes back."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import ServeProcess, pool_processes

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

N = 24  # keys overwritten, and keys deleted, all first owned by the member that fails


def _keys(tier: PeerTier, owner: str) -> tuple[list[bytes], list[bytes]]:
    """Keys whose first owner is ``owner``: ``N`` to overwrite, ``N`` to delete."""
    found = [key_of(i) for i in range(4000) if tier.members.order(key_of(i))[0] == owner]
    assert len(found) >= 2 * N
    return found[:N], found[N:2 * N]


async def _stale_and_undone(url: str, overwritten: list[bytes], deleted: list[bytes]
                            ) -> tuple[int, int]:
    """What a fresh client reads: overwrites still at their first value, deletes back."""
    async with PeerTier.from_url(url) as fresh:
        got = await fresh.get_many(overwritten)
        stale = sum(1 for b in got if b is None or not np.array_equal(b, sample_block(2)))
        back = sum(1 for b in await fresh.get_many(deleted) if b is not None)
    return stale, back


async def _settle(url: str, overwritten: list[bytes], deleted: list[bytes],
                  seconds: float) -> tuple[int, int]:
    """Poll until a fresh client reads every overwrite new and no delete, or ``seconds``
    pass; returns the last reading."""
    deadline = time.monotonic() + seconds
    while True:
        found = await _stale_and_undone(url, overwritten, deleted)
        if found == (0, 0) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)


async def _write_v1(url: str, member: str) -> tuple[list[bytes], list[bytes]]:
    async with PeerTier.from_url(url) as tier:
        overwritten, deleted = _keys(tier, member)
        await tier.put_many([(k, sample_block(1)) for k in overwritten + deleted])
    return overwritten, deleted


async def _overwrite_and_delete(tier: PeerTier, overwritten: list[bytes],
                                deleted: list[bytes]) -> None:
    """Every overwrite and delete at once, each acked without an error."""
    await asyncio.gather(*(tier.put(k, sample_block(2)) for k in overwritten),
                         *(tier.delete(k) for k in deleted))


@pytest.mark.one_loop  # stamps kept by kvtier serve processes; the freeze test: both loops
async def test_a_member_restarted_on_its_lmdb_directory_undoes_no_overwrite_or_delete(
        tmp_path: Path) -> None:
    # Before stamps: 24 of 24 overwrites read back v1 (the restarted owner is asked first)
    # and 24 of 24 deletes came back (its anti-entropy pushed them to its co-owners).
    with pool_processes(tmp_path, 3, lambda i: ["--tier", f"lmdb://{tmp_path}/m{i}",
                                                "--repair-interval", "0.5"],
                        {"replicas": 2, "ack": "all", "health_interval": 0.1}
                        ) as (procs, url):
        owner = procs[0].member
        overwritten, deleted = await _write_v1(url, owner)
        procs[0].signal(signal.SIGKILL)
        procs[0].proc.wait(10)  # type: ignore[union-attr]
        async with PeerTier.from_url(url) as tier:
            await _overwrite_and_delete(tier, overwritten, deleted)
        procs[0].start(listen=owner, timeout=60)
        stale, back = await _settle(url, overwritten, deleted, 20)
        assert (stale, back) == (0, 0), \
            f"{stale} of {N} overwrites read old, {back} of {N} deletes came back"
        await asyncio.sleep(2)  # and it stays so
        assert await _stale_and_undone(url, overwritten, deleted) == (0, 0)
        restarted: ServeProcess = procs[0]
        assert "Traceback" not in restarted.output()


async def test_a_member_frozen_for_two_seconds_undoes_no_overwrite_or_delete(
        tmp_path: Path) -> None:
    # Before stamps: 24 of 24 deletes came back once the frozen member resumed.
    with pool_processes(tmp_path, 3, lambda i: ["--tier", "dram://",
                                                "--repair-interval", "0.5"],
                        {"replicas": 2, "ack": "all", "health_interval": 0.1, "timeout": 1}
                        ) as (procs, url):
        owner = procs[0].member
        overwritten, deleted = await _write_v1(url, owner)
        # This client takes a member out of the path at its first failure.
        async with PeerTier.from_url(url + "&fail_after=1") as tier:
            await tier.get_many(overwritten)  # connections up before the freeze
            procs[0].signal(signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                # The overwrites time out on it and mark it down; the deletes then skip it.
                await asyncio.gather(*(tier.put(k, sample_block(2)) for k in overwritten))
                assert not tier.members.alive(owner)
                await asyncio.gather(*(tier.delete(k) for k in deleted))
                await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - frozen)))
            finally:
                procs[0].signal(signal.SIGCONT)
        stale, back = await _settle(url, overwritten, deleted, 20)
        assert (stale, back) == (0, 0), \
            f"{stale} of {N} overwrites read old, {back} of {N} deletes came back"
        await asyncio.sleep(2)
        assert await _stale_and_undone(url, overwritten, deleted) == (0, 0)
