"""The daemon's shared presence index (kvtier.shm.index): the table itself, readers racing a
writer in another process, and ``local://`` answering presence from it against a real
`kvtier serve --shm` subprocess (no socket call, deletes and evictions, a restart)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError, TierError
from kvtier.integrations.vllm_local import LocalLookups
from kvtier.shm.files import SHM_DIR
from kvtier.shm.index import IndexReader, PresenceIndex, fingerprint
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.local import LocalTier
from tests.helpers.shm_helpers import daemon, daemon_name, remove_files, running_daemon


@pytest.fixture
def index_path() -> Iterator[Path]:
    path = SHM_DIR / f"kvtier-test-{os.urandom(6).hex()}.index"
    yield path
    path.unlink(missing_ok=True)


def test_insert_remove_and_rebuild(index_path: Path) -> None:
    index = PresenceIndex(index_path, 64)
    reader = IndexReader(str(index_path), 64)
    try:
        keys = [key_of(i) for i in range(48)]  # 3/4 of 64: all fit
        index.apply(keys, [])
        assert reader.present_many(keys) == [True] * 48
        assert index.count == 48 and index.refused == 0
        index.apply([key_of(99)], [])  # past 3/4 with nothing deleted: refused
        assert index.refused == 1 and reader.present_many([key_of(99)]) == [False]
        index.apply([], keys[:24])
        assert reader.present_many(keys) == [False] * 24 + [True] * 24
        # Deleted entries fill the table until a rebuild drops them; nothing is lost.
        more = [key_of(100 + i) for i in range(24)]
        index.apply(more, [])
        assert reader.present_many(keys[24:] + more) == [True] * 48
        assert index.refused == 1
        assert reader.prefix([keys[30], keys[31], keys[0], keys[32]]) == 2
        index.clear()
        assert reader.present_many(more) == [False] * 24
    finally:
        reader.close()
        index.close()
    assert not index_path.exists()
    assert fingerprint(b"") > 1


def test_reader_checks_the_file(index_path: Path) -> None:
    with pytest.raises(ConfigError, match="power of two"):
        PresenceIndex(index_path, 100)
    index = PresenceIndex(index_path, 128)
    try:
        with pytest.raises(OSError, match="slots"):
            IndexReader(str(index_path), 64)  # announced size does not match the header
        reader = IndexReader(str(index_path), 128)
        assert not reader.stale()
        index.close()  # the daemon stops: unlinked, the mapping stays readable
        assert reader.stale()
        assert reader.present_many([key_of(1)]) == [False]
        reader.close()
    finally:
        index.close()


def _flip(path: str, rounds: int, xs: list[bytes], ys: list[bytes]) -> None:
    """Writer process: switch the table between 'all xs' and 'all ys', one change each."""
    index = PresenceIndex(Path(path), 256)
    try:
        index.apply(xs, [])
        for i in range(rounds):
            if i % 2:
                index.apply(xs, ys)
            else:
                index.apply(ys, xs)
            if i % 8 == 0:
                time.sleep(0.0001)  # gaps between changes, so some reads get through
    finally:
        index._words.release()  # leave the file for the reader; the test unlinks it
        index._map.close()


def test_readers_never_see_a_torn_table(index_path: Path) -> None:
    """A reader racing a writer in another process sees one of the writer's states whole:
    all of xs or all of ys, never a mix, and never a key that was never inserted."""
    xs = [key_of(i) for i in range(40)]
    ys = [key_of(1000 + i) for i in range(40)]
    never = [key_of(5000 + i) for i in range(40)]
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_flip, args=(str(index_path), 8000, xs, ys))
    writer.start()
    try:
        while not index_path.exists() or index_path.stat().st_size == 0:
            pass
        reader = None
        while reader is None:
            try:
                reader = IndexReader(str(index_path), 256)
            except OSError:  # the header is not written yet
                continue
        seen: set[tuple[bool, bool]] = set()
        seqs: set[int] = set()
        while writer.is_alive() or len(seen) < 1:
            found = reader.present_many(xs + ys + never)
            assert not any(found[80:]), "reported a key that was never inserted"
            got_x, got_y = found[:40], found[40:80]
            assert got_x in ([True] * 40, [False] * 40), "a torn read: part of xs"
            assert got_y in ([True] * 40, [False] * 40), "a torn read: part of ys"
            seen.add((got_x[0], got_y[0]))
            seqs.add(int(reader._words[2]))
        assert (True, True) not in seen  # never both states at once
        assert len(seqs) > 1  # the reads overlapped the writer's changes
        reader.close()
    finally:
        writer.join(60)
    assert writer.exitcode == 0


async def test_local_tier_answers_presence_without_the_daemon(tmp_path: Path) -> None:
    """With the daemon stopped (SIGSTOP) presence still answers, from the index; a delete
    and an eviction by the daemon remove keys from it."""
    with running_daemon(tmp_path, capacity="16MiB") as proc:
        tier = LocalTier(proc.shm_name, timeout=0.5)
        await tier.open()
        try:
            block = sample_block(1, nbytes=1 << 20)
            await tier.put_many([(key_of(i), block) for i in range(4)])
            assert await tier.contains_many([key_of(i) for i in range(5)]) == \
                [True] * 4 + [False]
            lookups = LocalLookups(f"local://{proc.shm_name}?timeout=0.5")
            assert lookups.lookup_prefix([key_of(9)]) == 0  # maps the arena and the index
            proc.signal(signal.SIGSTOP)
            try:
                assert await tier.contains_many([key_of(0), key_of(9)]) == [True, False]
                assert lookups.lookup_prefix([key_of(0), key_of(1), key_of(9)]) == 2
            finally:
                proc.signal(signal.SIGCONT)
            lookups.close()
            assert tier.stats()["index_lookups"] >= 2
            assert await tier.delete_many([key_of(1)]) == [True]
            assert await tier.contains_many([key_of(1)]) == [False]
            # 16 MiB of DRAM and no tier below: older blocks are evicted, and leave the index.
            await tier.put_many([(key_of(100 + i), block) for i in range(40)])
            keys = [key_of(i) for i in (0, 2, 3)] + [key_of(100 + i) for i in range(40)]
            present = await tier.contains_many(keys)
            socket_says = (await tier._client.call(
                "/v1/contains", {"keys": [k.hex() for k in keys]}))["present"]
            assert present == socket_says
            assert 0 < sum(present) <= 16 < len(keys)
            stats = await tier.daemon_stats()
            assert stats["index_keys"] == sum(present) and stats["index_refused"] == 0
        finally:
            await tier.aclose()


async def test_engine_remaps_a_restarted_daemons_index(tmp_path: Path) -> None:
    name = daemon_name()
    first = daemon(tmp_path, name)
    first.start()
    tier = LocalTier(name, timeout=2)
    try:
        await tier.open()
        block = sample_block(2, nbytes=64 << 10)
        await tier.put(key_of(1), block)
        assert await tier.contains_many([key_of(1)]) == [True]
        old = tier._client.index
        assert old is not None
        first.signal(signal.SIGKILL)
        first.proc.wait()  # type: ignore[union-attr]
        # Dead, not replaced: its index file is still linked, so the hint says present,
        # and the lease that follows turns it into a miss.
        assert await tier.contains_many([key_of(1)]) == [True]
        with pytest.raises(TierError):
            await tier.get(key_of(1))  # the lease step: a miss (a store counts it so)
        restarted = daemon(tmp_path, name)
        restarted.start()
        try:
            assert old.stale()  # the new daemon unlinked it (never truncated)
            assert await tier.contains_many([key_of(1)]) == [False]
            assert tier._client.index is not old
            await tier.put(key_of(2), block)
            assert await tier.contains_many([key_of(1), key_of(2)]) == [False, True]
            got = await tier.get(key_of(2))
            assert got is not None and np.array_equal(got, block)
        finally:
            restarted.stop()
    finally:
        await tier.aclose()
        remove_files(name)


async def test_index_slots_flag_bounds_the_table(tmp_path: Path) -> None:
    """`--shm-index-slots 64`: the table takes 48 keys; the rest are refused and counted
    (false negatives: the daemon still serves them)."""
    with running_daemon(tmp_path, None, "64MiB", "--shm-index-slots", "64") as proc:
        tier = LocalTier(proc.shm_name, timeout=2)
        await tier.open()
        try:
            block = sample_block(3, nbytes=4096)
            await tier.put_many([(key_of(i), block) for i in range(60)])
            stats = await tier.daemon_stats()
            assert stats["index_keys"] == 48 and stats["index_refused"] == 12
            present = await tier.contains_many([key_of(i) for i in range(60)])
            assert sum(present) == 48
            unlisted = key_of(present.index(False))
            assert await tier.get(unlisted) is not None  # not in the index, still served
        finally:
            await tier.aclose()


async def test_feed_follows_tiers_and_resyncs_after_lost_events(
        index_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key stays while any tier holds it (a demotion keeps it); a tier's AllBlocksCleared
    removes only what that tier alone held; a subscription that lost events is replaced and
    the index rebuilt from what the tiers hold."""
    from kvtier.events import EventHub
    from kvtier.shm import index_feed

    held = {"dram": [key_of(1)], "disk": [key_of(2)]}
    hub = EventHub("n0", resident=lambda: [(t, "cpu", ks) for t, ks in held.items()])
    index = PresenceIndex(index_path, 256)
    reader = IndexReader(str(index_path), 256)
    feed = index_feed.IndexFeed(hub, index)
    feed.start()
    try:
        assert reader.present_many([key_of(1), key_of(2)]) == [True, True]  # the resync
        hub.stored([key_of(3)], tier="dram", medium="cpu")
        hub.stored([key_of(3)], tier="disk", medium="disk")  # demoted: in both, then
        hub.removed([key_of(3)], tier="dram", medium="cpu")  # only on disk
        feed.sync()
        assert reader.present_many([key_of(3)]) == [True]
        hub.cleared(tier="disk", medium="disk")
        feed.sync()
        assert reader.present_many([key_of(1), key_of(2), key_of(3)]) == [True, False, False]
        monkeypatch.setattr(index_feed, "_BUFFER", 4)
        await feed.stop()
        feed = index_feed.IndexFeed(hub, index)
        feed.start()
        held["dram"] = [key_of(i) for i in range(10, 20)]  # what the tiers hold now
        for i in range(10, 20):  # ten events into a buffer of four: six are lost
            hub.stored([key_of(i)], tier="dram", medium="cpu")
        feed.sync()
        assert feed.resyncs == 1
        assert reader.present_many([key_of(i) for i in range(10, 20)]) == [True] * 10
        assert reader.present_many([key_of(1)]) == [False]  # gone from the tiers' listing
    finally:
        await feed.stop()
        reader.close()
        index.close()
