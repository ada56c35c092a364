"""``placement=local`` loses no acked block while a member is down: with one member of
three down, an eviction storm on the two full members found no live member older than a
block's last copy and dropped it as "the oldest anywhere", though the member that was down
had room or older blocks (the chaos soak lost 5 of 748 acked blocks so, 16 of 418 at
5 MiB). Against real `kvtier serve` processes."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kvtier.errors import KVTierError
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import pool_processes, pool_url
from tests.test_peer_local import POOL, _client, _dram, _held, _metric
from tests.test_peer_local_stale import _unreadable

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow


def _keys(members: list[str], home: str, then: str, start: int, n: int) -> list[bytes]:
    """``n`` keys from ``start`` whose second copy, written through ``home``, goes to
    ``then`` (the first member of the key's ring order besides home)."""
    ring = PeerTier.from_url(pool_url(members)).members.ring
    out: list[bytes] = []
    i = start
    while len(out) < n:
        key = key_of(i)
        if next(m for m in ring.owners(key, len(members)) if m != home) == then:
            out.append(key)
        i += 1
    return out


def test_no_acked_block_is_lost_to_an_eviction_storm_while_a_member_is_down(
        tmp_path: Path) -> None:
    """Three 20-block members, ``replicas=2``. 10 blocks on A and C, 10 on B and C, then 10
    on A and B: all three are full. C is killed: the first 20 are down to their last copy
    (A's or B's, which are full: no copy can be restored). 6 more blocks through home A
    need room on A and B: with one member down (R - 1), no acked block may be lost. A
    block's second copy may go, but a last copy is not "the oldest anywhere" while C, which
    had evicted nothing (its last health document), may come back: it stays, and a put
    that needed its room is refused. A fresh client reads every acked block."""
    opts = {**POOL, "replicas": 2, "timeout": 2}
    with pool_processes(tmp_path, 3, lambda i: _dram(20), opts) as (procs, _):
        members = [p.member for p in procs]
        a, b, c = members
        time.sleep(0.5)
        first = _keys(members, a, c, 12000, 10) + _keys(members, b, c, 12100, 10)
        both = _keys(members, a, b, 12200, 10)
        later = _keys(members, a, b, 12300, 6)
        blocks = {k: sample_block(i) for i, k in enumerate(first + both + later)}
        with _client(members, a, replicas=2) as on_a, _client(members, b, replicas=2) as on_b:
            on_a.put_many([(k, blocks[k]) for k in first[:10]])
            on_b.put_many([(k, blocks[k]) for k in first[10:]])
            time.sleep(0.2)  # the blocks on A and B next are younger
            on_a.put_many([(k, blocks[k]) for k in both])
        assert _held(c, first) == [True] * 20
        procs[2].signal(signal.SIGKILL)
        procs[2].proc.wait()  # type: ignore[union-attr]
        time.sleep(1.5)  # A and B see C refuse connections and run their passes
        acked = first + both
        with _client(members, a, replicas=2, health_interval=0.1) as writer:
            time.sleep(0.5)  # its probes see C down
            for key in later:
                try:
                    writer.put(key, blocks[key])
                except KVTierError:
                    continue  # refused (the room held last copies): not acknowledged
                acked.append(key)
        lost = _unreadable(members, a, acked, blocks)
        assert lost == [], (f"{len(lost)} of {len(acked)} acked blocks unreadable with one "
                            f"member down (dropped as the oldest: A "
                            f"{_metric(a, 'dropped_oldest'):.0f}, B "
                            f"{_metric(b, 'dropped_oldest'):.0f})")
