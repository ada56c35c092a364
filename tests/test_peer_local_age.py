"""``placement=local``: a block's age is the time since its last access (a read begins it
again, as in the Global Memory Service), and the ``evict_age`` a member reports is the age
of the block its segment evicts next, so the ages members compare agree with the order
their segments evict in. Against a real `kvtier serve` process."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import TOKEN, pool_processes
from tests.test_peer_local import _client, _dram, _held, _metric

POOL = {"placement": "local", "health_interval": 0.1, "timeout": 5}


def _evict_age(member: str) -> float | None:
    req = urllib.request.Request(f"http://{member}/v1/health",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        age = json.loads(resp.read())["evict_age"]
    return None if age is None else float(age)


def _read(member: str, key: bytes) -> None:
    """GET one block from ``member`` itself (no client cache between)."""
    req = urllib.request.Request(f"http://{member}/v1/blocks/{key.hex()}",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and resp.read()


@pytest.mark.slow
def test_a_read_makes_a_block_young_and_the_reported_age_is_the_next_victims(
        tmp_path: Path) -> None:
    """A member of 10 blocks: 11 stored drop the first as the oldest; the other 10 are read
    again. The member's age is then its next victim's, the least recently read block's,
    which was read after ``mark``: no older than the time since ``mark`` (the first
    victim, stored before ``mark``, was older). The next block stored drops that block,
    the least recently accessed, as the oldest."""
    with pool_processes(tmp_path, 1, lambda i: _dram(10), POOL) as (procs, _):
        [a] = [p.member for p in procs]
        keys = [key_of(i) for i in range(12)]
        with _client([a], a) as store:
            store.put_many([(k, sample_block(i)) for i, k in enumerate(keys[:11])])
            assert _held(a, keys[:11]) == [False] + [True] * 10
            assert _metric(a, "dropped_oldest") == 1
            mark = time.monotonic()  # every read below comes after this
            for key in keys[1:11]:
                _read(a, key)
            age = _evict_age(a)
            assert age is not None
            assert age <= time.monotonic() - mark, "the age of a block stored before the reads"
            store.put(keys[11], sample_block(11))
        assert _held(a, keys) == [False, False] + [True] * 10
        assert _metric(a, "dropped_oldest") == 2
