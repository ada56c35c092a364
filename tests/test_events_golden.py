"""Events a router can replay (issue 31): the events of real DRAM and LMDB tiers, replayed
into a router's index, give what the tiers really hold, through puts, evictions, deletes,
promotions, a clean close, a warm restart, a crash and a wiped disk.

Two indexes replay them: kvtier's own events into :class:`KvtierIndex` (strict: a block
removed before it was stored, or a new incarnation that does not start with
``AllBlocksCleared``, fails the test), and the vLLM wire format (``ZmqEventPublisher``'s
encoding, vLLM's medium names) into :class:`LlmdIndex`, built the way llm-d's KV index is
(``pkg/kvevents/pool.go``: per block hash the ``(pod, device tier)`` entries, the tier the
lower-cased ``medium``; ``BlockRemoved`` evicts one entry; ``AllBlocksCleared`` clears the
pod) with the three behaviours llm-d users hit as switches: replay off, so a sequence that
goes back to 0 is not noticed (llm-d/llm-d-router#2853); ``AllBlocksCleared`` ignored
(llm-d/llm-d-kv-cache#593); token-less ``BlockStored`` kept only for hashes already known
(llm-d/llm-d-router#878). With ``per_tier`` the index files entries under ``(medium,
tier)``, ``tier`` being the field kvtier adds to vLLM's events: two tiers of one medium
(``lmdb://`` and ``file://``, both ``STORAGE``) then stay apart, which a medium alone cannot
do.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtier.events import AllBlocksCleared, BlockStored, KVEvent, Subscription
from kvtier.events_zmq import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventBatch,
    ZmqEventPublisher,
)
from kvtier.store import TieredStore
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier

BLOCK = np.arange(2048, dtype=np.uint16)  # 4 KiB
N = BLOCK.nbytes
DRAM_BLOCKS = 8
LMDB_BLOCKS = 20
NODE = "pod-a"
DECODER = msgspec.msgpack.Decoder(type=VllmKVEventBatch)
#: kvtier tier name -> the device tier llm-d's index files it under (vLLM's medium names).
DEVICE_TIER = {"dram": "cpu", "lmdb": "storage", "file": "storage"}


def chain(start: int, count: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 4 for i in range(start, start + count)]


class KvtierIndex:
    """A router's view from kvtier's events: tier -> keys, replayed strictly."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}
        self.incarnation = ""
        self.seq = 0

    def apply(self, event: KVEvent) -> None:
        if event.incarnation != self.incarnation:  # a new process: it must say so first
            assert isinstance(event, AllBlocksCleared) and event.tier is None, event
            self.incarnation, self.seq = event.incarnation, event.seq
        assert event.seq in (self.seq, self.seq + 1), f"gap: {self.seq} -> {event.seq}"
        self.seq = event.seq
        if isinstance(event, AllBlocksCleared):
            if event.tier is None:
                self.held.clear()
            else:
                self.held.pop(event.tier, None)
        elif isinstance(event, BlockStored):
            self.held.setdefault(event.tier, set()).update(event.keys)
        else:
            held = self.held.get(event.tier, set())
            early = [k.hex() for k in event.keys if k not in held]
            assert not early, f"BlockRemoved({event.tier}) before its BlockStored: {early}"
            held.difference_update(event.keys)

    def view(self) -> dict[str, set[bytes]]:
        return {tier: keys for tier, keys in self.held.items() if keys}


@dataclass
class LlmdIndex:
    """An index built the way llm-d's is (see the module docstring)."""

    replay: bool = False  # False: a sequence reset goes unnoticed (#2853)
    honours_clear: bool = True  # False: AllBlocksCleared is only logged (#593)
    token_less: str = "index"  # "known": a token-less store counts only known hashes (#878)
    per_tier: bool = False  # entries under (medium, kvtier's tier field), not medium alone
    entries: dict[int, set[tuple[str, str]]] = field(default_factory=dict)
    known: set[int] = field(default_factory=set)
    last_seq: int = -1

    @staticmethod
    def engine_key(block_hash: bytes | int) -> int:
        # llm-d's getHashAsUint64: the last 8 bytes of a byte hash, big-endian.
        if isinstance(block_hash, int):
            return block_hash
        return int.from_bytes(block_hash[-8:].rjust(8, b"\0"), "big")

    def receive(self, pod: str, seq: int, payload: bytes) -> None:
        if self.replay and seq < self.last_seq:  # a restarted publisher: reset the pod
            self._clear(pod)
        self.last_seq = seq
        for event in DECODER.decode(payload).events:
            if isinstance(event, VllmBlockStored):
                tier = self.device_tier(event.medium, event.tier)
                for key in map(self.engine_key, event.block_hashes):
                    if event.token_ids or self.token_less == "index" or key in self.known:
                        self.entries.setdefault(key, set()).add((pod, tier))
                        if event.token_ids:
                            self.known.add(key)
            elif isinstance(event, VllmBlockRemoved):
                tier = self.device_tier(event.medium, event.tier)
                for key in map(self.engine_key, event.block_hashes):
                    self.entries.get(key, set()).discard((pod, tier))
            elif isinstance(event, VllmAllBlocksCleared) and self.honours_clear:
                scoped = self.per_tier and event.tier is not None
                self._clear(pod, self.device_tier(event.medium, event.tier) if scoped else None)

    def device_tier(self, medium: str | None, tier: str | None) -> str:
        name = (medium or "gpu").lower()
        return f"{name}/{tier}" if self.per_tier and tier else name

    def _clear(self, pod: str, tier: str | None = None) -> None:
        for pods in self.entries.values():
            pods.difference_update({e for e in pods
                                    if e[0] == pod and tier in (None, e[1])})

    def view(self, pod: str) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for key, pods in self.entries.items():
            for who, tier in pods:
                if who == pod:
                    out.setdefault(tier, set()).add(key)
        return out


@dataclass
class Router:
    """Both indexes, fed one incarnation (one publisher: batch seq from 0) at a time."""

    llmd: list[LlmdIndex]
    kvtier: KvtierIndex = field(default_factory=KvtierIndex)
    publisher: ZmqEventPublisher | None = None
    seq: int = 0

    def attach(self, store: TieredStore) -> Subscription:
        # encode() only: the socket path is tests/test_events_zmq.py's.
        self.publisher = ZmqEventPublisher(store.event_hub, "tcp://127.0.0.1:0",
                                           vllm_medium_names=True)
        self.seq = 0
        return store.events()

    def feed(self, sub: Subscription) -> None:
        events = sub.drain_nowait()
        if not events:
            return
        for event in events:
            self.kvtier.apply(event)
        assert self.publisher is not None
        payload = self.publisher.encode(events)
        for index in self.llmd:
            index.receive(NODE, self.seq, payload)
        self.seq += 1


def truth(store: TieredStore) -> dict[str, set[bytes]]:
    held = {t.name: set(t.resident_keys() or ()) for t in store.tiers}
    return {name: keys for name, keys in held.items() if keys}


def as_llmd(view: dict[str, set[bytes]], per_tier: bool = False) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for t, keys in view.items():
        device = f"{DEVICE_TIER[t]}/{t}" if per_tier else DEVICE_TIER[t]
        out.setdefault(device, set()).update(LlmdIndex.engine_key(k) for k in keys)
    return out


async def open_two_tier(path: Path) -> TieredStore:
    disk = LMDBTier(path, capacity=LMDB_BLOCKS * N + N // 2, name="lmdb")
    await disk.open()  # as open_store does: the blocks a previous run left are listed
    return TieredStore([DRAMTier(DRAM_BLOCKS * N, name="dram"), disk],
                       node=NODE, block_tokens=16)


def check(router: Router, store: TieredStore | None, exact: list[LlmdIndex],
          subset: list[LlmdIndex]) -> None:
    """kvtier's index and the ``exact`` ones hold what the tiers hold; the ``subset`` ones
    never claim a block the node does not hold."""
    real = truth(store) if store is not None else {}
    assert router.kvtier.view() == real
    for index in exact:
        assert index.view(NODE) == as_llmd(real, index.per_tier), index
    for index in subset:
        for tier, keys in index.view(NODE).items():
            assert keys <= as_llmd(real, index.per_tier).get(tier, set()), index


async def test_a_batch_bigger_than_dram_reports_stored_before_removed(tmp_path: Path) -> None:
    """The table row: a put_many of 12 blocks into a DRAM tier that holds 8 (LMDB below)."""
    store = await open_two_tier(tmp_path / "db")
    router = Router([LlmdIndex()])
    async with store:
        sub = router.attach(store)
        keys = chain(0, 12)
        await store.put_many([(k, BLOCK) for k in keys])
        events = sub.drain_nowait()
        for event in events:
            router.kvtier.apply(event)  # raises on a BlockRemoved before its BlockStored
        assert len(truth(store)["dram"]) == DRAM_BLOCKS
        assert router.kvtier.view() == truth(store)
        assert truth(store)["dram"] == set(keys[:DRAM_BLOCKS])  # the chain's head stays
        # Each BlockStored run names the key before it as its parent.
        for event in events:
            if isinstance(event, BlockStored) and event.tier == "dram" and event.seq:
                first = keys.index(event.keys[0])
                assert event.parent == (keys[first - 1] if first else None)
                assert list(event.keys) == keys[first:first + len(event.keys)]


@pytest.mark.parametrize("replay", [False, True], ids=["replay-off", "replay-on"])
async def test_replayed_events_match_the_tiers_through_restarts(tmp_path: Path,
                                                                replay: bool) -> None:
    today = LlmdIndex(replay=replay)
    ignores_clear = LlmdIndex(replay=replay, honours_clear=False)
    known_only = LlmdIndex(replay=replay, token_less="known")
    router = Router([today, ignores_clear, known_only])
    db = tmp_path / "db"

    # Incarnation 1: puts that overflow DRAM and LMDB, a promotion, deletes, a clean close.
    store = await open_two_tier(db)
    sub = router.attach(store)
    router.feed(sub)
    check(router, store, [today, ignores_clear], [known_only])
    for start in (0, 12, 24):
        await store.put_many([(k, BLOCK) for k in chain(start, 12)])
        router.feed(sub)
        check(router, store, [today, ignores_clear], [known_only])
    lower = sorted(truth(store)["lmdb"] - truth(store)["dram"])[0]
    assert await store.get(lower) is not None  # promoted into DRAM, which demotes one
    for key in (lower, chain(30, 1)[0], chain(2, 1)[0]):
        await store.delete(key)
    router.feed(sub)
    check(router, store, [today, ignores_clear], [known_only])
    await store.aclose()  # close flush into LMDB, then every block removed by name
    router.feed(sub)
    check(router, None, [today, ignores_clear], [known_only])

    # Incarnation 2: a warm restart; the first events clear the node and list LMDB's keys.
    store = await open_two_tier(db)
    assert truth(store)["lmdb"]
    sub = router.attach(store)
    router.feed(sub)
    check(router, store, [today, ignores_clear], [known_only])
    await store.put_many([(k, BLOCK) for k in chain(40, 10)])
    router.feed(sub)
    check(router, store, [today, ignores_clear], [known_only])
    # ... then the process dies: nothing more reaches the router (a crash sends nothing).
    sub.close()
    await store.aclose()

    # Incarnation 3: the disk was wiped meanwhile. The router has stale blocks; the new
    # incarnation's first event clears them (a router that ignores AllBlocksCleared cannot
    # learn that from anyone: the process that held them is gone).
    shutil.rmtree(db)
    store = await open_two_tier(db)
    sub = router.attach(store)
    router.feed(sub)
    # With replay on, the sequence going back to 0 resets the pod as well (#2853's fix).
    exact = [today, ignores_clear] if replay else [today]
    check(router, store, exact, [known_only])
    assert router.kvtier.view() == {} and today.view(NODE) == {}
    if not replay:  # what no publisher can fix: the blocks' holder died without a word
        assert ignores_clear.view(NODE) != {}
    await store.put_many([(k, BLOCK) for k in chain(60, 12)])
    router.feed(sub)
    check(router, store, exact, [known_only])
    await store.aclose()
    router.feed(sub)
    check(router, None, exact, [known_only])


async def test_two_tiers_of_one_medium_stay_apart_by_their_tier_field(tmp_path: Path) -> None:
    """LMDB and a file tier are both STORAGE: an index keyed by medium alone loses the
    file tier's copy when a block is demoted out of LMDB (stored in file, then removed from
    lmdb, both "storage"); keyed by ``(medium, tier)`` it matches the tiers."""
    disk = LMDBTier(tmp_path / "db", capacity=6 * N + N // 2, name="lmdb", watch=0)
    await disk.open()
    files = FsspecTier(f"file://{tmp_path}/files", name="file", use_log=False, watch=0)
    store = TieredStore([DRAMTier(2 * N, name="dram"), disk, files], node=NODE,
                        block_tokens=16)
    by_tier, by_medium = LlmdIndex(per_tier=True), LlmdIndex()
    router = Router([by_tier, by_medium])
    async with store:
        sub = router.attach(store)
        for start in (0, 8, 16):
            await store.put_many([(k, BLOCK) for k in chain(start, 8)])
            router.feed(sub)
            check(router, store, [by_tier], [by_medium])
        assert truth(store)["file"]
        held = as_llmd(truth(store))["storage"]
        assert by_medium.view(NODE)["storage"] < held  # the limit a medium alone has
        await store.delete(chain(20, 1)[0])
        router.feed(sub)
        check(router, store, [by_tier], [by_medium])
    router.feed(sub)
    check(router, None, [by_tier, by_medium], [])
