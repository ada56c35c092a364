"""``placement=local`` never drops a copy on the word of a stale directory entry: a member
restarted empty is still named as a holder of what it held before (nothing tells the
directory what a dead process held), and an eviction that trusted that entry dropped the
only real copy as a "spare". Against real `kvtier serve` processes."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import pool_processes
from tests.test_peer_local import POOL, _client, _dram, _held, _metric

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow


def _unreadable(members: list[str], home: str, keys: list[bytes],
                blocks: dict[bytes, np.ndarray[Any, Any]]) -> list[int]:
    """Positions of ``keys`` a fresh client of ``home`` cannot read back as written."""
    with _client(members, home, replicas=1) as fresh:
        got = fresh.get_many(keys)
    return [i for i, (k, g) in enumerate(zip(keys, got, strict=True))
            if g is None or not np.array_equal(g, blocks[k])]

def test_an_eviction_does_not_trust_a_holder_restarted_empty(tmp_path: Path) -> None:
    """Member A (20 blocks) and B (200) both hold 20 blocks; B restarts empty; 40 more
    blocks through home A evict the 20 from A. The directory still names B, but B lacks
    them: each is a last copy and moves to B. All 60 fit the pool's 220 blocks, so a fresh
    client reads every one."""
    opts = {**POOL, "replicas": 1}
    with pool_processes(tmp_path, 2, lambda i: _dram(20 if i == 0 else 200), opts) as (
            procs, _):
        a, b = [p.member for p in procs]
        time.sleep(0.5)
        first = [key_of(7000 + i) for i in range(20)]
        blocks = {k: sample_block(i) for i, k in enumerate(first)}
        with _client([a, b], a, replicas=1) as on_a, _client([a, b], b, replicas=1) as on_b:
            on_a.put_many(list(blocks.items()))
            on_b.put_many(list(blocks.items()))  # B holds them too, and registers so
        assert _held(a, first) == [True] * 20 == _held(b, first)
        procs[1].stop()  # B restarts empty on its port: the directory still names it
        procs[1].launch(b)
        procs[1].wait_ready()
        time.sleep(1.0)  # A's health probes see B back, with room
        assert _held(b, first) == [False] * 20
        more = [key_of(7100 + i) for i in range(40)]
        blocks |= {k: sample_block(20 + i) for i, k in enumerate(more)}
        with _client([a, b], a, replicas=1) as writer:
            for start in range(0, len(more), 5):
                writer.put_many([(k, blocks[k]) for k in more[start:start + 5]])
        keys = first + more
        lost = _unreadable([a, b], b, keys, blocks)
        assert lost == [], f"{len(lost)} of {len(keys)} acked blocks unreadable"
        assert _metric(a, "stale_holders") >= 1


def test_a_read_copy_home_never_displaces_a_last_copy(tmp_path: Path) -> None:
    """A full pool of two 20-block members holds 40 blocks, each its only copy. A client
    of home A reads B's blocks twice (hot: copied home): A's copies may only take free room
    or displace spare copies, so every one of the 40 acked blocks is still readable."""
    opts = {**POOL, "replicas": 1}
    with pool_processes(tmp_path, 2, lambda i: _dram(20), opts) as (procs, _):
        a, b = [p.member for p in procs]
        time.sleep(0.5)
        on_a = [key_of(8000 + i) for i in range(20)]
        on_b = [key_of(8100 + i) for i in range(20)]
        blocks = {k: sample_block(i) for i, k in enumerate(on_a + on_b)}
        with _client([a, b], a, replicas=1) as writer:
            writer.put_many([(k, blocks[k]) for k in on_a])
        with _client([a, b], b, replicas=1) as writer:
            writer.put_many([(k, blocks[k]) for k in on_b])
        time.sleep(0.5)  # both members' health probes see the other full
        with _client([a, b], a, replicas=1) as reader:
            for _ in range(2):
                assert all(g is not None for g in reader.get_many(on_b))
            time.sleep(1.0)  # the copies home run in the background
        keys = on_a + on_b
        lost = _unreadable([a, b], b, keys, blocks)
        assert lost == [], f"{len(lost)} of {len(keys)} acked blocks unreadable"


def test_an_overwrite_through_another_home_supersedes_the_old_copy(tmp_path: Path) -> None:
    """``replicas=1``: a client of home A writes 10 blocks, a client of home B overwrites
    them (B's copies, not A's). A's older copies are deleted before the overwrite is
    acknowledged, so a client of home A reads the new values, not its home's old ones."""
    opts = {**POOL, "replicas": 1}
    with pool_processes(tmp_path, 2, lambda i: _dram(50), opts) as (procs, _):
        a, b = [p.member for p in procs]
        time.sleep(0.5)
        keys = [key_of(9500 + i) for i in range(10)]
        with _client([a, b], a, replicas=1) as writer:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        new = {k: sample_block(100 + i) for i, k in enumerate(keys)}
        with _client([a, b], b, replicas=1) as writer:
            writer.put_many(list(new.items()))
        stale = _unreadable([a, b], a, keys, new)
        assert stale == [], f"{len(stale)} of {len(keys)} overwrites read at their first value"
        assert _held(a, keys) == [False] * 10


def test_a_delete_missed_by_a_frozen_holder_is_handed_over(tmp_path: Path) -> None:
    """``replicas=1``: 10 blocks through home A live on A only, whatever their ring owners.
    A is frozen while a client deletes them (A times out); once A answers again the client
    hands the missed deletes over to it, as to a ring owner, so no deleted block reads
    back from A."""
    opts = {**POOL, "replicas": 1}
    with pool_processes(tmp_path, 3, lambda i: _dram(50), opts) as (procs, _):
        members = [p.member for p in procs]
        a = members[0]
        time.sleep(0.5)
        keys = [key_of(9700 + i) for i in range(10)]
        with _client(members, a, replicas=1) as writer:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        assert _held(a, keys) == [True] * 10
        with _client(members, members[1], replicas=1, timeout=1, health_interval=0.2) as c:
            procs[0].signal(signal.SIGSTOP)
            try:
                for key in keys:
                    c.delete(key)
            finally:
                procs[0].signal(signal.SIGCONT)
            deadline = time.monotonic() + 10.0  # A answers health probes again: its
            while sum(_held(a, keys)) and time.monotonic() < deadline:  # missed deletes go
                time.sleep(0.5)  # to it, in the background
        undone = sum(_held(a, keys))
        assert undone == 0, f"{undone} of {len(keys)} acked deletes still held by A"
