"""The daemon's lease table (pure, fake clock) and a lease that outlives its time bound
against a real daemon: the copy under it is a miss."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from kvtier.shm.leases import LeaseTable
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.local import LocalTier
from tests.helpers.shm_helpers import running_daemon

K = b"k" * 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _raw() -> np.ndarray:
    return np.zeros(64, np.uint8)


def test_release_is_valid_once_for_its_own_process_only() -> None:
    table = LeaseTable(10.0, Clock())
    lease = table.grant_read(7, K, _raw(), 0)
    assert table.release(8, [lease.id]) == [False]  # another process cannot end it
    assert table.release(7, [lease.id, 999]) == [True, False]
    assert table.release(7, [lease.id]) == [False]
    assert len(table) == 0


def test_expired_lease_fails_its_release() -> None:
    clock = Clock()
    table = LeaseTable(10.0, clock)
    lease = table.grant_read(7, K, _raw(), 0)
    clock.now += 11
    assert table.release(7, [lease.id]) == [False]
    assert table.expired == 1 and len(table) == 0


def test_expire_drops_past_leases_and_says_when_the_next_ends() -> None:
    clock = Clock()
    table = LeaseTable(10.0, clock)
    table.grant_read(7, K, _raw(), 0)
    clock.now += 5
    later = table.grant_read(7, K, _raw(), 64)
    clock.now += 6
    assert table.expire() == later.expires
    assert len(table) == 1


def test_dead_process_loses_every_lease() -> None:
    table = LeaseTable(10.0, Clock())
    table.grant_read(7, K, _raw(), 0)
    table.grant_write(7, K, _raw(), 64, np.dtype(np.uint8), (64,))
    other = table.grant_read(8, K, _raw(), 128)
    assert table.counts()["prepared_bytes"] == 64
    assert table.drop_pid(7) == 2
    assert table.counts() == {"leases": 1, "prepared": 0, "clients": 1, "leased_bytes": 64,
                              "prepared_bytes": 0}
    assert table.release(8, [other.id]) == [True]
    # Running totals: granted, released while valid, dropped with their process.
    assert (table.granted_reads, table.granted_writes, table.released, table.dropped) == \
        (2, 1, 1, 2)


def test_a_late_commit_never_lands_over_a_newer_write() -> None:
    table = LeaseTable(10.0, Clock())
    older = table.grant_write(7, K, _raw(), 0, np.dtype(np.uint8), (64,))
    newer = table.grant_write(7, K, _raw(), 64, np.dtype(np.uint8), (64,))
    (taken_newer,) = table.take_writes(7, [newer.id])
    assert taken_newer is not None and table.lands(taken_newer)
    (taken_older,) = table.take_writes(7, [older.id])
    assert taken_older is not None and not table.lands(taken_older)
    # Nothing of the key is out any more: a fresh write lands again.
    fresh = table.grant_write(7, K, _raw(), 0, np.dtype(np.uint8), (64,))
    (taken,) = table.take_writes(7, [fresh.id])
    assert taken is not None and table.lands(taken)


def test_a_delete_supersedes_writes_prepared_before_it() -> None:
    table = LeaseTable(10.0, Clock())
    before = table.grant_write(7, K, _raw(), 0, np.dtype(np.uint8), (64,))
    table.note_delete(K)
    after = table.grant_write(7, K, _raw(), 64, np.dtype(np.uint8), (64,))
    (taken_before,) = table.take_writes(7, [before.id])
    assert taken_before is not None and not table.lands(taken_before)
    (taken_after,) = table.take_writes(7, [after.id])
    assert taken_after is not None and table.lands(taken_after)


async def test_a_copy_under_a_lease_that_outlived_its_time_bound_is_a_miss(
        tmp_path: Path) -> None:
    with running_daemon(tmp_path, None, "64MiB", "--shm-lease-ttl", "0.3") as proc:
        tier = LocalTier(proc.shm_name, timeout=5)
        await tier.open()
        try:
            await tier.put(key_of(1), sample_block(1, nbytes=1 << 20))
            slots = await tier._lease([key_of(1)])
            # The engine stalls past the bound; the daemon may reuse the slot meanwhile.
            await tier.delete(key_of(1))
            await asyncio.sleep(0.6)
            await tier.put(key_of(2), sample_block(2, nbytes=1 << 20))
            assert await tier._finish(slots) == [False]
            assert tier.stats()["expired_leases"] == 1
            stats = await tier.daemon_stats()
            assert stats["leases"] == 0 and stats["expired"] == 1
        finally:
            await tier.aclose()
