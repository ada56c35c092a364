"""store.events(): KV events from real tiers (DRAM, LMDB, a peer pool) as blocks come and go."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import InvalidKeyError
from kvtier.events import BlockRemoved, BlockStored, KVEvent, Subscription
from kvtier.peer.server import PeerServer
from kvtier.store import TieredStore, open_store
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier

BLOCK = np.arange(2048, dtype=np.uint16)  # 4 KiB
N = BLOCK.nbytes
K = [bytes([i]) * 16 for i in range(1, 13)]
PARENT = b"p" * 16
TOKEN = "events-test-token"


def view(events: list[KVEvent]) -> list[tuple[object, ...]]:
    """Events without their timestamps, as comparable tuples."""
    out: list[tuple[object, ...]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.tier, e.medium, e.keys, e.parent, e.block_tokens, e.node))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.tier, e.medium, e.keys, e.node))
        else:
            out.append(("cleared", e.tier, e.medium, e.node))
    return out


def subscribe(store: TieredStore, **options: object) -> Subscription:
    """``store.events()`` with its resync taken: the node starts empty, so only the
    ``AllBlocksCleared`` of every tier."""
    sub = store.events(**options)  # type: ignore[arg-type]
    assert view(sub.drain_nowait()) == [("cleared", None, None, store.node)]
    return sub


def two_tier(tmp: Path, ram_blocks: int = 3, **options: object) -> TieredStore:
    return TieredStore([DRAMTier(ram_blocks * N, name="ram"),
                        LMDBTier(tmp / "db", capacity=1 << 22, name="disk")],
                       node="n1", block_tokens=16, **options)  # type: ignore[arg-type]


async def test_put_demote_promote_delete_and_close(tmp_path: Path) -> None:
    store = two_tier(tmp_path)
    sub = subscribe(store)
    await store.put_many([(k, BLOCK) for k in K[:3]], parent=PARENT)
    assert view(sub.drain_nowait()) == [
        ("stored", "ram", "cpu", tuple(K[:3]), PARENT, 16, "n1")]

    # A fourth block evicts one: demoted into the disk tier, then gone from RAM.
    await store.put(K[3], BLOCK)
    demoted, removed, stored = view(sub.drain_nowait())
    victim = demoted[3][0]  # type: ignore[index]
    assert victim in K[:3]
    assert demoted == ("stored", "disk", "disk", (victim,), None, 16, "n1")
    assert removed == ("removed", "ram", "cpu", (victim,), "n1")
    assert stored == ("stored", "ram", "cpu", (K[3],), None, 16, "n1")
    assert await store.tiers[1].contains(victim) and not await store.tiers[0].contains(victim)

    # Reading it back promotes it into RAM, which demotes another block.
    assert await store.get(victim) is not None
    events = view(sub.drain_nowait())
    assert events[-1] == ("stored", "ram", "cpu", (victim,), None, 16, "n1")
    second = events[0][3][0]  # type: ignore[index]
    assert events[:2] == [("stored", "disk", "disk", (second,), None, 16, "n1"),
                          ("removed", "ram", "cpu", (second,), "n1")]

    # A delete removes it from every tier that held it.
    assert await store.delete(victim)
    assert view(sub.drain_nowait()) == [("removed", "ram", "cpu", (victim,), "n1"),
                                        ("removed", "disk", "disk", (victim,), "n1")]
    assert not await store.delete(victim)
    assert sub.drain_nowait() == []

    # Closing flushes RAM into the disk tier, removes what each tier held by name, clears
    # both, and ends the subscription.
    in_ram = set(store.tiers[0].resident_keys() or ())
    await store.aclose()
    rest = view([e async for e in sub])
    flushed = {k for e in rest if e[0] == "stored" for k in e[3]}  # type: ignore[union-attr]
    assert flushed == in_ram and all(e[1] == "disk" for e in rest if e[0] == "stored")
    ram_gone = [e for e in rest if e[0] == "removed" and e[1] == "ram"]
    assert {k for e in ram_gone for k in e[3]} == in_ram  # type: ignore[union-attr]
    disk_gone = {k for e in rest if e[0] == "removed" and e[1] == "disk" for k in e[3]}  # type: ignore[union-attr]
    assert disk_gone == in_ram | {k for k in K[:4] if k != victim}
    assert [e for e in rest if e[0] == "cleared"] == [("cleared", "ram", "cpu", "n1"),
                                                      ("cleared", "disk", "disk", "n1")]
    assert rest[-1] == ("cleared", "disk", "disk", "n1")
    assert sub.dropped == 0


async def test_put_many_runs_name_their_parent(tmp_path: Path) -> None:
    # A block too big for RAM goes to disk: the chain splits into runs, each run's parent
    # is the key before it.
    store = two_tier(tmp_path, ram_blocks=2)
    big = np.zeros(3 * N // 2, np.uint16)
    async with store:
        sub = subscribe(store)
        await store.put_many([(K[0], BLOCK), (K[1], big), (K[2], BLOCK)], parent=PARENT)
        assert view(sub.drain_nowait()) == [
            ("stored", "ram", "cpu", (K[0],), PARENT, 16, "n1"),
            ("stored", "disk", "disk", (K[1],), K[0], 16, "n1"),
            ("stored", "ram", "cpu", (K[2],), K[1], 16, "n1")]


async def test_evictions_of_the_last_tier_are_reported(tmp_path: Path) -> None:
    # The last tier has nothing to demote to (no on_evict): its drops still make events.
    store = TieredStore([DRAMTier(N, name="ram"),
                         LMDBTier(tmp_path / "db", capacity=5 * N // 2, name="disk")],
                        node="n1")  # two framed blocks fit
    async with store:
        sub = subscribe(store)
        for key in K[:4]:
            await store.put(key, BLOCK)
        events = view(sub.drain_nowait())
        gone = [e[3] for e in events if e[0] == "removed" and e[1] == "disk"]
        assert gone == [(K[0],)]
        assert not await store.tiers[1].contains(K[0])

    single = TieredStore([DRAMTier(2 * N, name="only")], node="n1")
    async with single:
        sub = subscribe(single)
        for key in K[:3]:
            await single.put(key, BLOCK)
        assert [e for e in view(sub.drain_nowait()) if e[0] == "removed"] == [
            ("removed", "only", "cpu", (K[0],), "n1")]


async def test_a_slow_consumer_loses_the_oldest_events_and_they_are_counted() -> None:
    store = TieredStore([DRAMTier(name="ram")], node="n1")
    async with store:
        sub = store.events(buffer=4, resync=False)
        for key in K[:10]:
            await store.put(key, BLOCK)  # nobody reads: the store does not wait
        assert sub.dropped == 6
        stats = store.stats()
        assert stats["events_dropped"] == 6 and stats["events_emitted"] == 10
        assert stats["event_subscribers"] == 1 and stats["node"] == "n1"
        assert [e[3] for e in view(sub.drain_nowait())] == [(k,) for k in K[6:10]]


async def test_nothing_is_emitted_without_a_subscriber() -> None:
    store = TieredStore([DRAMTier(2 * N, name="ram")])
    async with store:
        await store.put_many([(k, BLOCK) for k in K[:4]])  # the chain's head K0, K1 stay
        await store.delete(K[1])
        assert store.stats()["events_emitted"] == 0
        sub = store.events()  # its resync (what RAM holds) is not counted as emitted
        assert view(sub.drain_nowait()) == [("cleared", None, None, store.node),
                                            ("stored", "ram", "cpu", (K[0],), None, None,
                                             store.node)]
        await store.put(K[5], BLOCK)  # fits: one event
        sub.close()
        await store.put(K[6], BLOCK)  # a put and an eviction, unobserved
        assert store.stats()["events_emitted"] == 1
        assert store.stats()["event_subscribers"] == 0


async def test_write_through_copies_are_stored_events(tmp_path: Path) -> None:
    store = two_tier(tmp_path, write_policy="write_through")
    async with store:
        sub = subscribe(store)
        await store.put(K[0], BLOCK)
        await store.flush()
        assert view(sub.drain_nowait()) == [
            ("stored", "ram", "cpu", (K[0],), None, 16, "n1"),
            ("stored", "disk", "disk", (K[0],), None, 16, "n1")]


@pytest.fixture
async def peer() -> AsyncIterator[PeerServer]:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await server.start()
    yield server
    await server.stop()


async def test_pool_write_through_is_a_shared_storage_event(peer: PeerServer) -> None:
    urls = ["dram://", f"peers://{peer.member_id}?token={TOKEN}&timeout=2"]
    async with open_store(urls, block_tokens=32) as store:
        sub = subscribe(store)
        await store.put_many([(k, BLOCK) for k in K[:2]], parent=PARENT)
        node = store.node
        assert view(sub.drain_nowait()) == [
            ("stored", "dram", "cpu", tuple(K[:2]), PARENT, 32, node),
            ("stored", "peers", "shared_storage", tuple(K[:2]), PARENT, 32, node)]


async def test_node_defaults_to_the_pool_self_id(peer: PeerServer) -> None:
    url = f"peers://{peer.member_id}?token={TOKEN}&self={peer.member_id}"
    async with open_store(["dram://", url]) as store:
        assert store.node == peer.member_id
    async with open_store(["dram://"], node="router-7") as store:
        assert store.node == "router-7" and store.event_hub.node == "router-7"


async def test_bad_event_options_are_refused() -> None:
    with pytest.raises(ValueError, match="node"):
        TieredStore([DRAMTier()], node="")
    with pytest.raises(ValueError, match="block_tokens"):
        TieredStore([DRAMTier()], block_tokens=0)
    async with TieredStore([DRAMTier()]) as store:
        with pytest.raises(ValueError, match="buffer"):
            store.events(buffer=0)
        with pytest.raises((TypeError, InvalidKeyError), match="parent"):
            await store.put_many([(K[0], BLOCK)], parent="p")  # type: ignore[arg-type]
        assert not await store.contains(K[0])  # nothing written
