"""The ZMQ publisher against a real SUB socket decoding with structs that mirror vLLM's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvtier.events import EventHub
from kvtier.events_zmq import VllmKVEventBatch, ZmqEventPublisher
from kvtier.integrations.vllm_events import event_media
from kvtier.store import TieredStore
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier


# What a vLLM subscriber decodes with (vllm/distributed/kv_events.py), copied field for field.
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    locality: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
K = [bytes([i]) * 16 for i in range(1, 6)]


async def _subscribe(endpoint: str, topic: bytes) -> zmq.asyncio.Socket:
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


async def _recv(sub: zmq.asyncio.Socket) -> list[bytes]:
    return list(await asyncio.wait_for(sub.recv_multipart(), 10))


async def test_subscriber_decodes_vllm_batches() -> None:
    hub = EventHub("node0")
    async with ZmqEventPublisher(hub, "tcp://127.0.0.1:0", model="llama") as pub:
        assert pub.topic == "kv@node0@llama"
        sub = await _subscribe(pub.endpoint, b"kv@node0@")
        try:
            # PUB/SUB joins asynchronously: probe until the subscriber sees a batch.
            first: list[bytes] = []
            for _ in range(100):
                hub.cleared()
                try:
                    first = list(await asyncio.wait_for(sub.recv_multipart(), 0.1))
                    break
                except TimeoutError:
                    continue
            assert first, "subscriber never joined"
            start = int.from_bytes(first[1], "big")
            while True:  # drain probes still in flight
                try:
                    frames = list(await asyncio.wait_for(sub.recv_multipart(), 0.3))
                    start = int.from_bytes(frames[1], "big")
                except TimeoutError:
                    break
            hub.stored(K[:3], tier="dram", medium="cpu", parent=None, block_tokens=256)
            hub.removed(K[:1], tier="dram", medium="cpu")
            hub.stored(K[3:4], tier="lmdb", medium="disk", parent=K[2], block_tokens=256)
            events: list[Any] = []
            seqs = []
            while len(events) < 3:
                topic, seq, payload = await _recv(sub)
                assert topic == b"kv@node0@llama" and len(seq) == 8
                seqs.append(int.from_bytes(seq, "big"))
                events += DECODER.decode(payload).events  # vLLM's struct: no incarnation
                assert msgspec.msgpack.decode(payload, type=VllmKVEventBatch).incarnation \
                    == hub.incarnation
            assert seqs == list(range(start + 1, start + 1 + len(seqs)))
            stored, removed, lower = events
            assert isinstance(stored, BlockStored) and stored.block_hashes == K[:3]
            assert stored.parent_block_hash is None and stored.block_size == 256
            assert stored.medium == "cpu" and stored.token_ids == []
            assert stored.locality is None  # kvtier's spelling: no locality on the wire
            assert isinstance(removed, BlockRemoved) and removed.block_hashes == K[:1]
            assert isinstance(lower, BlockStored) and lower.parent_block_hash == K[2]
            assert lower.medium == "disk"
        finally:
            sub.close(linger=0)


async def test_replay_socket_resends_missed_batches() -> None:
    hub = EventHub("n")
    async with ZmqEventPublisher(hub, "tcp://127.0.0.1:0", model="m",
                                 replay_endpoint="tcp://127.0.0.1:0",
                                 vllm_medium_names=True) as pub:
        for key in K[:3]:  # nobody subscribed to PUB: only the replay buffer keeps them
            hub.stored([key], tier="dram", medium="cpu", block_tokens=16)
            await asyncio.sleep(0.02)  # one batch each
        for _ in range(200):
            if pub.sent_events + pub.dropped_batches >= 4:
                break
            await asyncio.sleep(0.01)
        assert pub.replay_endpoint is not None
        req = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.replay_endpoint)
        try:
            # As llm-d's subscriber does: a DEALER asks from the first sequence it missed
            # (REQ would take only the first of the answers).
            await req.send_multipart((b"", (0).to_bytes(8, "big")))
            events: list[Any] = []
            seqs: list[int] = []
            while True:
                _, seq, payload = await asyncio.wait_for(req.recv_multipart(), 10)
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                seqs.append(int.from_bytes(seq, "big"))
                events += DECODER.decode(payload).events
            assert seqs == list(range(pub.seq))
            # Batch 0 is the publisher's resync (the hub holds nothing: AllBlocksCleared).
            assert [type(e) for e in events] == [AllBlocksCleared] + [BlockStored] * 3
            assert [e.block_hashes for e in events[1:]] == [[k] for k in K[:3]]
            assert {(e.medium, e.locality) for e in events[1:]} == {("CPU", "LOCAL")}
        finally:
            req.close(linger=0)


@pytest.mark.parametrize(("scheme", "kv_medium"), [
    ("hbm", "gpu"), ("dram", "cpu"), ("local", "cpu"), ("lmdb", "disk"),
    ("peers", "shared_storage")])
async def test_vllm_names_agree_with_the_vllm_connector(scheme: str, kv_medium: str) -> None:
    """vllm_medium_names=True spells each medium as the vLLM connector's events do (vLLM
    0.32's offloading connectors: CPU / STORAGE plus a LOCAL / REMOTE locality)."""
    hub = EventHub("n")
    pub = ZmqEventPublisher(hub, "tcp://127.0.0.1:0", vllm_medium_names=True)
    (expected,) = event_media([f"{scheme}://x"])  # the connector's (medium, locality)
    sub = hub.subscribe(resync=False)
    hub.stored([K[0]], tier="t", medium=kv_medium)
    hub.removed([K[0]], tier="t", medium=kv_medium)
    events: list[Any] = []
    batches = sub.batches()
    while len(events) < 2:
        events += DECODER.decode(pub.encode(await asyncio.wait_for(anext(batches), 10))).events
    stored, removed = events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored.medium, stored.locality) == (removed.medium, removed.locality) == expected


async def test_bad_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        ZmqEventPublisher(EventHub("n"), "localhost:5557")


async def test_store_events_reach_a_real_subscriber(tmp_path: Path) -> None:
    # End to end: real tiers -> store.events' hub -> ZMQ PUB -> SUB decoding vLLM's structs.
    block = np.arange(2048, dtype=np.uint16)
    store = TieredStore([DRAMTier(2 * block.nbytes, name="ram"),
                         LMDBTier(tmp_path / "db", capacity=1 << 22, name="disk")],
                        node="node7", block_tokens=16)
    parent = b"p" * 16
    async with ZmqEventPublisher(store.event_hub, "tcp://127.0.0.1:0", model="m",
                                 vllm_medium_names=True) as pub:
        sub = await _subscribe(pub.endpoint, b"kv@node7@m")
        try:
            for _ in range(100):  # PUB/SUB joins asynchronously: probe until it delivers
                store.event_hub.cleared()
                try:
                    await asyncio.wait_for(sub.recv_multipart(), 0.1)
                    break
                except TimeoutError:
                    continue
            else:
                pytest.fail("subscriber never joined")
            while True:  # drain probes still in flight
                try:
                    await asyncio.wait_for(sub.recv_multipart(), 0.3)
                except TimeoutError:
                    break
            await store.put_many([(k, block) for k in K[:2]], parent=parent)
            await store.put(K[2], block)  # evicts one block from RAM into the disk tier
            await store.aclose()  # clears both tiers and ends the publisher's subscription
            events: list[Any] = []
            while sum(isinstance(e, AllBlocksCleared) for e in events) < 2:
                events += DECODER.decode((await _recv(sub))[2]).events
        finally:
            sub.close(linger=0)
    first, demoted, removed, third, flushed, *closing = events
    assert isinstance(first, BlockStored) and first.block_hashes == K[:2]
    assert first.parent_block_hash == parent and first.block_size == 16
    assert (first.medium, first.locality) == ("CPU", "LOCAL") and first.lora_name is None
    assert isinstance(demoted, BlockStored)
    assert (demoted.medium, demoted.locality) == ("STORAGE", "LOCAL")
    assert isinstance(removed, BlockRemoved)
    assert (removed.medium, removed.locality) == ("CPU", "LOCAL")
    assert removed.block_hashes == demoted.block_hashes and demoted.block_hashes[0] in K[:2]
    assert isinstance(third, BlockStored) and third.block_hashes == K[2:3]
    # The close flush copies what RAM held into the disk tier; then each tier's blocks are
    # removed by name and the tier cleared.
    assert isinstance(flushed, BlockStored) and flushed.medium == "STORAGE"
    assert K[2] in flushed.block_hashes
    assert [type(e) for e in closing] == [BlockRemoved, AllBlocksCleared,
                                          BlockRemoved, AllBlocksCleared]
    assert closing[0].medium == "CPU" and closing[2].medium == "STORAGE"
    assert set(closing[2].block_hashes) == set(K[:3])
