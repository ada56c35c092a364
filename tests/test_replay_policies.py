"""S3FIFOPolicy and ARCPolicy: budget, scan resistance, ghosts, pins, errors; both drive the
replay (see docs/pooling-results.md)."""

from __future__ import annotations

import pytest

from kvtier.errors import BlockTooLargeError, TierFullError
from kvtier.policy import ARCPolicy, RecencyPolicy, S3FIFOPolicy


def _k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def _put(policy: S3FIFOPolicy | RecencyPolicy | ARCPolicy, key: bytes,
         size: int = 1) -> list[bytes]:
    if policy.touch(key):
        return []
    victims = policy.victims(size)
    for v in victims:
        assert policy.remove(v) is not None
    policy.admit(key, size)
    return victims


def test_budget_is_never_exceeded() -> None:
    p = S3FIFOPolicy(10)
    for i in range(200):
        _put(p, _k(i % 37), size=1 + i % 3)
        assert p.used <= 10
        assert len(p) == len(list(p.lru_order()))


def test_scan_does_not_flush_reused_keys_but_flushes_lru() -> None:
    hot = [_k(i) for i in range(8)]
    results = {}
    for name, policy in (("s3fifo", S3FIFOPolicy(10)), ("lru", RecencyPolicy(10))):
        for _ in range(3):
            for k in hot:
                _put(policy, k)
        for i in range(100, 150):  # a one-pass scan, 5x the budget
            _put(policy, _k(i))
        results[name] = sum(k in policy for k in hot)
    assert results["lru"] == 0
    assert results["s3fifo"] == len(hot)


def test_ghost_hit_goes_to_main() -> None:
    p = S3FIFOPolicy(10, small_fraction=0.2)
    _put(p, _k(1))
    for i in range(2, 20):
        _put(p, _k(i))
    assert _k(1) not in p
    _put(p, _k(1))  # remembered in the ghost list: re-admitted into main
    for i in range(20, 26):
        _put(p, _k(i))
    assert _k(1) in p


def test_pins_and_errors() -> None:
    p = S3FIFOPolicy(3)
    for i in range(3):
        _put(p, _k(i))
        p.pin(_k(i))
    with pytest.raises(TierFullError):
        p.victims(1)
    assert len(p) == 3 and p.used == 3
    p.unpin(_k(0))
    assert p.victims(1) == [_k(0)]
    with pytest.raises(BlockTooLargeError):
        p.victims(4)
    for bad in ({"capacity": -1}, {"capacity": 1.5}):
        with pytest.raises(ValueError, match="capacity"):
            S3FIFOPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="small_fraction"):
        S3FIFOPolicy(10, small_fraction=1.0)
    assert S3FIFOPolicy(None).victims(10**9) == []


@pytest.mark.parametrize("seed", range(5))
def test_arc_budget_and_membership_match_a_model(seed: int) -> None:
    import random

    rng = random.Random(seed)
    p = ARCPolicy(20)
    present: set[bytes] = set()
    for _ in range(2000):
        key = _k(int(rng.paretovariate(1.2)) % 60)
        evicted = _put(p, key, size=1 + rng.randrange(3))
        present.add(key)
        present.difference_update(evicted)
        assert p.used <= 20
        assert present == set(p.lru_order()) and len(p) == len(present)
        assert all(k in p for k in present)


def test_arc_resists_scans_and_acts_as_lru_for_recent_reuse() -> None:
    p = ARCPolicy(10)
    hot = [_k(i) for i in range(6)]
    for _ in range(3):
        for k in hot:
            _put(p, k)
    for i in range(100, 160):
        _put(p, _k(i))
    assert all(k in p for k in hot)
    # Pure recency (each key reused once, soon): ghost hits move the target toward T1 until
    # ARC hits like LRU does.
    q = ARCPolicy(10)
    hits = []
    for i in range(400):
        _put(q, _k(i))
        if i >= 6:
            hit = q.touch(_k(i - 6))
            if not hit:
                _put(q, _k(i - 6))  # a miss re-admits, as a request does
            hits.append(hit)
    assert sum(hits[-100:]) >= 90


def test_arc_pins_and_errors() -> None:
    p = ARCPolicy(2)
    _put(p, _k(1))
    _put(p, _k(2))
    p.pin(_k(1))
    p.pin(_k(2))
    with pytest.raises(TierFullError):
        p.victims(1)
    assert p.used == 2 and _k(1) in p and _k(2) in p
    p.unpin(_k(2))
    assert p.victims(1) == [_k(2)]
    with pytest.raises(BlockTooLargeError):
        p.victims(3)
    with pytest.raises(ValueError, match="capacity"):
        ARCPolicy(-1)
