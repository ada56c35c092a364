"""KV event hub: batching, bounded buffers that drop (and count) for slow consumers, threads."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from kvtier.events import (
    RESYNC_KEYS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventHub,
    Subscription,
    medium_of,
)

K = [bytes([i]) * 16 for i in range(8)]


async def test_subscriber_receives_events_in_order_as_batches() -> None:
    hub = EventHub("node0")
    sub = hub.subscribe(resync=False)
    hub.stored(K[:2], tier="dram", medium="cpu", parent=None, block_tokens=256)
    hub.removed(K[:1], tier="dram", medium="cpu")
    hub.stored(K[2:3], tier="lmdb", medium="disk", parent=K[1])
    hub.cleared()
    batch = await asyncio.wait_for(sub.next_batch(), 5)
    assert [type(e) for e in batch] == [BlockStored, BlockRemoved, BlockStored, AllBlocksCleared]
    first = batch[0]
    assert isinstance(first, BlockStored)
    assert first.keys == (K[0], K[1]) and first.node == "node0" and first.block_tokens == 256
    third = batch[2]
    assert isinstance(third, BlockStored) and third.parent == K[1] and third.medium == "disk"
    sub.close()
    with pytest.raises(StopAsyncIteration):
        await sub.next_batch()
    assert hub.subscribers == 0


async def test_slow_consumer_loses_oldest_events_and_counts_them() -> None:
    hub = EventHub("n", buffer=4)
    slow = hub.subscribe(resync=False)
    fast = hub.subscribe(buffer=100, resync=False)
    for i in range(10):  # the producer never waits, whatever the consumers do
        hub.stored([bytes([i + 1])], tier="dram", medium="cpu")
    assert slow.dropped == 6 and fast.dropped == 0 and hub.dropped == 6
    kept = await slow.next_batch()
    assert [e.keys[0][0] for e in kept if isinstance(e, BlockStored)] == [7, 8, 9, 10]
    assert len(await fast.next_batch()) == 10
    hub.close()
    assert [e async for e in slow] == []


async def test_async_iteration_and_context_manager_end_on_close() -> None:
    hub = EventHub("n", max_batch=2)
    got = []

    async def consume() -> None:
        async with hub.subscribe(resync=False) as sub:
            async for event in sub:
                got.append(event)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    for key in K[:5]:
        hub.removed([key], tier="dram", medium="cpu")
    await asyncio.sleep(0.01)
    hub.close()
    await asyncio.wait_for(task, 5)
    assert [e.keys[0] for e in got if isinstance(e, BlockRemoved)] == K[:5]


async def test_producer_on_another_thread_wakes_the_consumer() -> None:
    hub = EventHub("n")
    sub = hub.subscribe(resync=False)
    waiter = asyncio.create_task(sub.next_batch())
    await asyncio.sleep(0)
    thread = threading.Thread(target=hub.stored, args=(K[:1],),
                              kwargs={"tier": "lmdb", "medium": "disk"})
    thread.start()
    thread.join()
    batch = await asyncio.wait_for(waiter, 5)
    assert isinstance(batch[0], BlockStored) and batch[0].tier == "lmdb"


async def test_no_subscriber_costs_nothing_and_bad_input_is_refused() -> None:
    hub = EventHub("n")
    hub.stored(K[:1], tier="dram", medium="cpu")
    assert hub.emitted == 0
    sub = hub.subscribe(resync=False)
    with pytest.raises(TypeError, match="keys"):
        hub.stored(["not bytes"], tier="dram", medium="cpu")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="node"):
        EventHub("")
    with pytest.raises(ValueError, match="buffer"):
        hub.subscribe(buffer=0, resync=False)
    assert hub.emitted == 0
    sub.close()


def test_medium_follows_the_tier() -> None:
    class Tier:
        def __init__(self, scheme: str, medium: str | None = None) -> None:
            self.scheme = scheme
            if medium is not None:
                self.medium = medium

    assert medium_of(Tier("dram")) == "cpu"
    # The host daemon's shared-memory DRAM: host memory on this host, as vLLM's own CPU
    # tier (a /dev/shm mapping), not storage.
    assert medium_of(Tier("local")) == "cpu"
    assert medium_of(Tier("lmdb")) == "disk" and medium_of(Tier("file")) == "disk"
    assert medium_of(Tier("peers")) == "shared_storage"
    assert medium_of(Tier("redis")) == "shared_storage"
    assert medium_of(Tier("file", "shared_storage")) == "shared_storage"


async def test_drain_nowait_takes_what_is_buffered() -> None:
    hub = EventHub("n")
    sub = hub.subscribe(resync=False)
    assert sub.drain_nowait() == []
    hub.stored(K[:1], tier="dram", medium="cpu")
    hub.removed(K[:1], tier="dram", medium="cpu")
    hub.removed(K[1:2], tier="dram", medium="cpu")
    first = await sub.__anext__()  # one taken by iteration, two left pending/buffered
    assert isinstance(first, BlockStored)
    rest = sub.drain_nowait()
    assert [e.keys[0] for e in rest if isinstance(e, BlockRemoved)] == [K[0], K[1]]
    assert sub.drain_nowait() == []
    sub.close()


def test_close_from_a_thread_after_the_store_closed() -> None:
    """A thread polling a BlockingStore's subscription closes it after the store closed
    (issue 20 bug 7: ``RuntimeError: Event loop is closed``); closing twice is fine too."""
    from kvtier.blocking import BlockingStore
    from kvtier.tiers.dram import DRAMTier

    store = BlockingStore([DRAMTier()])
    sub = store.events()
    store.put(K[0], b"block")
    store.close()  # ends the subscription on the store's loop, then closes that loop
    assert [type(e) for e in sub.drain_nowait()] == [
        AllBlocksCleared, BlockStored, BlockRemoved, AllBlocksCleared]  # resync, put, close
    sub.close()
    sub.close()

    hub = EventHub("n")
    other = asyncio.run(_subscribe(hub))  # that loop is closed now; the hub is not
    other.close()
    assert hub.subscribers == 0


async def _subscribe(hub: EventHub) -> Subscription:
    return hub.subscribe(resync=False)


def test_counts_are_exact_with_producers_on_many_threads() -> None:
    """``emitted`` and ``dropped`` count every event when producers race on threads."""
    hub = EventHub("n", buffer=8)
    sub = asyncio.run(_subscribe(hub))
    threads, per_thread = 4, 5_000
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        workers = [threading.Thread(target=_emit_many, args=(hub, per_thread))
                   for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(switch)
    assert hub.emitted == threads * per_thread
    assert hub.dropped == sub.dropped == threads * per_thread - 8
    kept = sub.drain_nowait()
    # The last 8 events, in seq order: producers' events leave in the order they were
    # numbered, whichever thread made them.
    assert [e.seq for e in kept] == list(range(threads * per_thread - 7,
                                               threads * per_thread + 1))


def _emit_many(hub: EventHub, n: int) -> None:
    for _ in range(n):
        hub.removed(K[:1], tier="dram", medium="cpu")


async def test_every_subscription_starts_with_a_resync_of_what_the_node_holds() -> None:
    many = [i.to_bytes(4, "big") * 4 for i in range(RESYNC_KEYS + 3)]
    held: dict[str, list[bytes]] = {"dram": K[:2], "lmdb": many}
    hub = EventHub("n", resident=lambda: [(t, "cpu" if t == "dram" else "disk", keys)
                                          for t, keys in held.items()])
    hub.stored(K[2:3], tier="dram", medium="cpu")  # nobody listens: not numbered
    first = hub.subscribe()
    hub.stored(K[3:4], tier="dram", medium="cpu")
    cleared, ram, disk, disk_rest, live = first.drain_nowait()
    assert isinstance(cleared, AllBlocksCleared) and cleared.tier is None
    assert isinstance(ram, BlockStored) and ram.keys == tuple(K[:2]) and ram.medium == "cpu"
    assert isinstance(disk, BlockStored) and isinstance(disk_rest, BlockStored)
    assert disk.keys + disk_rest.keys == tuple(many) and len(disk.keys) == RESYNC_KEYS
    assert {e.seq for e in (cleared, ram, disk, disk_rest)} == {0} and live.seq == 1
    assert {e.incarnation for e in (cleared, ram, live)} == {hub.incarnation}

    # A later subscriber's resync is stamped with the seq of the last event before it.
    held["dram"] = K[:4]
    second = hub.subscribe(buffer=2)
    hub.removed(K[:1], tier="dram", medium="cpu")
    events = second.drain_nowait()
    assert [e.seq for e in events] == [1, 1, 1, 1, 2]
    assert second.dropped == 0  # the resync does not count against buffer=2
    assert [e.seq for e in first.drain_nowait()] == [2]

    # Another hub (a restarted process) has another incarnation.
    assert EventHub("n").incarnation != hub.incarnation
    first.close()
    second.close()
