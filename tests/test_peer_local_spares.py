"""``placement=local`` drops spare copies before last copies: a member whose segment is
full of copies that other members also hold (a read's copy home) frees their room before
its eviction takes a block's only copy. Against real `kvtier serve` processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import pool_processes
from tests.test_peer_local import POOL, _client, _dram, _held, _metric
from tests.test_peer_local_stale import _unreadable

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow


def test_spare_copies_go_before_a_last_copy_is_dropped_as_the_oldest(tmp_path: Path) -> None:
    """Two 20-block members, ``replicas=1``. A holds 10 blocks (N, the oldest in the pool,
    each its only copy); B then fills with 22 younger blocks (M) and evicts its 2 oldest
    (forwarded to A, which has room), so N is the oldest anywhere; a client of home A reads
    8 of B's blocks twice (hot: copied home, A is full). 5 more blocks through home A need
    room on A: A drops 5 of its spare copies (B holds them), not 5 of N (no one else does),
    and every acked block reads back."""
    opts = {**POOL, "replicas": 1}
    with pool_processes(tmp_path, 2, lambda i: _dram(20), opts) as (procs, _):
        a, b = [p.member for p in procs]
        time.sleep(0.5)
        oldest = [key_of(9000 + i) for i in range(10)]
        on_b = [key_of(9100 + i) for i in range(22)]
        later = [key_of(9200 + i) for i in range(5)]
        keys = oldest + on_b + later
        blocks = {k: sample_block(i) for i, k in enumerate(keys)}
        with _client([a, b], a, replicas=1) as writer:
            writer.put_many([(k, blocks[k]) for k in oldest])
        time.sleep(0.2)  # N is older than anything B stores next
        with _client([a, b], b, replicas=1) as writer:
            writer.put_many([(k, blocks[k]) for k in on_b])
        hot = on_b[2:10]
        assert _held(b, hot) == [True] * 8
        with _client([a, b], a, replicas=1) as reader:
            for _ in range(2):  # read twice from B: hot, copied home to A (into free room)
                assert all(g is not None for g in reader.get_many(hot))
            time.sleep(1.0)  # the copies home run in the background
        assert _held(a, oldest + hot) == [True] * 18
        time.sleep(0.5)  # A's health probes see B full, evicting blocks younger than N
        with _client([a, b], a, replicas=1) as writer:
            writer.put_many([(k, blocks[k]) for k in later])
        lost = _unreadable([a, b], b, keys, blocks)
        assert lost == [], (f"{len(lost)} of {len(keys)} acked blocks unreadable "
                            f"(dropped as the oldest: {_metric(a, 'dropped_oldest'):.0f})")
        assert _metric(a, "spares_reclaimed") >= 5
        assert _held(a, oldest) == [True] * 10
