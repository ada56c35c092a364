"""HashRing: movement on membership change, balance, and cross-process stability."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from kvtier.peer.ring import DEFAULT_VNODES, HashRing
from tests.helpers.peer_helpers import REPO

N_KEYS = 30_000  # movement within 1.03/n and balance 1.02 here, bounds 1.25/n and 1.15
KEYS = [i.to_bytes(8, "little") * 2 for i in range(N_KEYS)]


def _members(n: int) -> list[str]:
    return [f"10.0.{i // 250}.{i % 250}:7070" for i in range(n)]


def _primaries(ring: HashRing) -> list[str]:
    return [ring.primary(k) for k in KEYS]


@pytest.mark.parametrize("n", [4, 8, 32])
def test_adding_or_removing_one_member_moves_about_one_nth(n: int) -> None:
    members = _members(n + 1)
    base = HashRing(members[:n])
    before = _primaries(base)
    grown = _primaries(base.with_members(members))
    shrunk = _primaries(base.with_members(members[1:n]))
    moved_add = sum(a != b for a, b in zip(before, grown, strict=True)) / N_KEYS
    moved_remove = sum(a != b for a, b in zip(before, shrunk, strict=True)) / N_KEYS
    assert moved_add <= 1.25 / (n + 1), moved_add
    assert moved_remove <= 1.25 / n, moved_remove
    # Only keys of the new member move when adding; only the removed member's when removing.
    assert all(b == members[n] for a, b in zip(before, grown, strict=True) if a != b)
    assert all(a == members[0] for a, b in zip(before, shrunk, strict=True) if a != b)


def test_default_vnodes_balance_primaries() -> None:
    ring = HashRing(_members(8))
    assert ring.vnodes == DEFAULT_VNODES
    load = Counter(_primaries(ring))
    assert len(load) == 8
    assert max(load.values()) / (N_KEYS / 8) <= 1.15


def test_owners_distinct_primary_first_and_capped() -> None:
    ring = HashRing(_members(5), replicas=3)
    for key in KEYS[:500]:
        owners = ring.owners(key)
        assert len(owners) == 3 == len(set(owners))
        assert owners[0] == ring.primary(key)
        assert ring.owners(key, 10) == ring.owners(key, 5) and len(ring.owners(key, 10)) == 5
    assert HashRing([]).owners(KEYS[0]) == []


_CHILD = """
import json, sys
from kvtier.peer.ring import HashRing
ring = HashRing([f"node-{i}:7070" for i in range(7)], replicas=3)
print(json.dumps([ring.owners(i.to_bytes(4, "big") * 4) for i in range(2000)]))
"""


def test_owners_identical_across_processes() -> None:
    outputs = []
    for seed in ("1", "98765"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        run = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=60)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    local = HashRing([f"node-{i}:7070" for i in range(7)], replicas=3)
    assert outputs[0] == [local.owners(i.to_bytes(4, "big") * 4) for i in range(2000)]
