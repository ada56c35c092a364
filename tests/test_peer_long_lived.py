"""A long-lived client reads what a fresh one reads (issue 30).

Against real `kvtier serve --pool` processes (DRAM segments, anti-entropy on): one client
stays open through SIGKILLs with empty restarts on the same port (some quicker than a
health probe, so the client never sees the member go), SIGSTOPs, and two owners of the same
keys restarted empty back to back, while it keeps writing. After every fault it and a fresh
client read every acknowledged key, batch by batch, and are compared key by key: a key the
fresh client reads and the long-lived one misses means the long-lived client's view of the
pool (failure detector, health, connections, hints, read walk) hides a copy that is there.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.load import Scale
from tests.helpers.peer_helpers import ServeProcess, pool_processes, pool_url, serve_processes

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

SERVERS = 5
REPLICAS = 3
BATCH = 64


def _block(i: int) -> np.ndarray:
    return sample_block(i, nbytes=4096)


async def _put(tier: PeerTier, start: int, count: int, acked: dict[bytes, int]) -> None:
    """Put keys ``start..start+count`` concurrently; the acknowledged ones go in ``acked``."""
    async def one(i: int) -> None:
        try:
            await tier.put(key_of(i), _block(i))
        except Exception:  # not acknowledged: not read back
            return
        acked[key_of(i)] = i

    await asyncio.gather(*(one(i) for i in range(start, start + count)))


async def _read(tier: PeerTier, keys: Sequence[bytes], acked: dict[bytes, int]
                ) -> tuple[set[bytes], int]:
    """``(keys read with their bytes, wrong blocks)``."""
    good: set[bytes] = set()
    wrong = 0
    for start in range(0, len(keys), BATCH):
        chunk = keys[start:start + BATCH]
        for key, got in zip(chunk, await tier.get_many(chunk), strict=True):
            if got is None:
                continue
            if np.array_equal(np.asarray(got).view(np.uint8).ravel(),
                              _block(acked[key]).view(np.uint8).ravel()):
                good.add(key)
            else:
                wrong += 1
    return good, wrong


async def _compare(long_lived: PeerTier, url: str, acked: dict[bytes, int]
                   ) -> tuple[list[bytes], int, int]:
    """Every acknowledged key read by ``long_lived``, then by a fresh client: the keys the
    fresh client read and the long-lived one missed, how many the fresh one missed too,
    and the wrong blocks of both."""
    keys = list(acked)
    old, wrong_old = await _read(long_lived, keys, acked)
    async with PeerTier.from_url(url) as fresh:
        new, wrong_new = await _read(fresh, keys, acked)
    behind = [k for k in keys if k in new and k not in old]
    both = sum(1 for k in keys if k not in new and k not in old)
    return behind, both, wrong_old + wrong_new


def _kill(proc: ServeProcess) -> None:
    proc.signal(signal.SIGKILL)
    assert proc.proc is not None
    proc.proc.wait(10)


async def _restart_empty(proc: ServeProcess) -> None:
    await asyncio.to_thread(proc.start, proc.member)


@pytest.mark.timeout(900)  # 8 faults and 8 read-backs of up to 1,920 keys, at load 8
@pytest.mark.one_loop  # kvtier serve processes; the freeze test below runs on both loops
async def test_a_long_lived_client_reads_what_a_fresh_one_reads(tmp_path: Path) -> None:
    rng = random.Random(30)
    # A timeout scaled to the box's load: a request that times out under load misses for
    # one client and not the other, which says nothing about the client's view.
    opts = {"replicas": REPLICAS, "ack": "all", "timeout": Scale()(1.0), "health_interval": 0.5}
    with pool_processes(tmp_path, SERVERS, lambda i: ["--tier", "dram://?capacity=256MiB",
                                                      "--repair-interval", "1"],
                        opts) as (procs, url):
        long_lived = PeerTier.from_url(url)
        await long_lived.open()
        acked: dict[bytes, int] = {}
        next_key = 0
        report: list[str] = []
        try:
            for round_ in range(8):
                await _put(long_lived, next_key, 120, acked)
                next_key += 120
                kind = ("quick", "slow", "stop", "pair")[round_ % 4]
                victims = rng.sample(procs, 2 if kind == "pair" else 1)
                if kind == "stop":
                    victims[0].signal(signal.SIGSTOP)
                    await _put(long_lived, next_key, 120, acked)
                    next_key += 120
                    await asyncio.sleep(2.0)
                    victims[0].signal(signal.SIGCONT)
                else:
                    for victim in victims:
                        _kill(victim)
                        if kind == "slow":  # the client sees it go, writes meanwhile
                            await _put(long_lived, next_key, 120, acked)
                            next_key += 120
                        # "quick", "pair": back empty before the client probes it.
                        await _restart_empty(victim)
                await _put(long_lived, next_key, 60, acked)
                next_key += 60
                behind, both, wrong = await _compare(long_lived, url, acked)
                report.append(f"round {round_} ({kind}): {len(behind)} of {len(acked)} "
                              f"behind, {both} missed by both, {wrong} wrong")
                assert wrong == 0, report
                assert behind == [], report
        finally:
            await long_lived.aclose()


async def _until(cond: Callable[[], bool], what: str, seconds: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_member_back_from_a_freeze_is_read_before_its_probes_clear_it(
        tmp_path: Path) -> None:
    # Member A holds the only copies of its keys (their co-owner B restarted empty, no
    # anti-entropy). A freezes (SIGSTOP) long enough for the long-lived client's reads and
    # a health probe to time out on it (out of the path, its last probe unanswered), then
    # resumes. Before the fix the long-lived client asked nobody for A's keys until a
    # probe answered (health_interval later), and two in a row cleared A: "long-lived read
    # 0, fresh 16".
    with serve_processes(tmp_path, 3, ["--tier", "dram://?capacity=64MiB"]) as procs:
        members = [p.member for p in procs]
        url = pool_url(members, replicas=2, timeout=Scale()(0.5), health_interval=5)
        async with PeerTier.from_url(url) as long_lived:
            a, b = procs[0], procs[1]
            keys = [key_of(i) for i in range(4000)
                    if set(long_lived.members.ring.owners(key_of(i), 2)) == {a.member,
                                                                           b.member}][:16]
            await long_lived.put_many([(k, _block(i)) for i, k in enumerate(keys)])
            acked = {k: i for i, k in enumerate(keys)}
            _kill(b)
            await _restart_empty(b)
            a.signal(signal.SIGSTOP)
            try:
                state = long_lived.members.detector[a.member]
                while not (state.down and not state.reachable):
                    await long_lived.get_many(keys)  # timeouts on A take it out
                    await asyncio.sleep(0.05)
            finally:
                a.signal(signal.SIGCONT)
            old, _ = await _read(long_lived, keys, acked)
            async with PeerTier.from_url(url) as fresh:
                new, _ = await _read(fresh, keys, acked)
            assert len(new) == len(keys)
            assert len(old) == len(new), f"long-lived read {len(old)}, fresh {len(new)}"
