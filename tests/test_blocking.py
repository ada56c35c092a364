"""``BlockingStore``: the synchronous, thread-safe facade (its own loop thread)."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import BlockingStore, ClosedError, ConfigError, TieredStore
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Block


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def test_verbs_round_trip(tmp_path: Path) -> None:
    with BlockingStore(["dram://?capacity=1MiB", f"file://{tmp_path}"]) as bs:
        keys = [_key(i) for i in range(4)]
        assert bs.get(keys[0]) is None
        bs.put(keys[0], np.arange(8, dtype=np.uint16))
        bs.put_many([(k, np.full(8, i, np.uint16)) for i, k in enumerate(keys[1:], 1)])
        assert bs.contains(keys[0]) and not bs.contains(_key(99))
        assert bs.contains_many([keys[1], _key(99)]) == [True, False]
        assert bs.lookup_prefix([*keys, _key(99), keys[0]]) == 4
        got = bs.get_many(keys)
        assert [int(b[0]) for b in got if b is not None] == [0, 1, 2, 3]
        outs = [np.empty(8, np.uint16) for _ in range(2)]
        assert bs.get_many_into([keys[2], _key(99)], outs) == [True, False]
        assert outs[0].tolist() == [2] * 8
        bs.pin(keys[:2])
        bs.unpin(keys[:2])
        assert bs.delete(keys[3]) is True and bs.get(keys[3]) is None
        stats = bs.stats()
        assert [t["scheme"] for t in stats["tiers"]] == ["dram", "file"]
        assert stats["puts"] >= 4


def test_many_threads_against_a_dict_model() -> None:
    """Eight threads put/get/delete disjoint key ranges at once; each checks its own model."""
    with BlockingStore(["dram://?capacity=64MiB"]) as bs:
        def worker(tid: int) -> int:
            rng = random.Random(tid)
            model: dict[bytes, int] = {}
            checks = 0
            for _ in range(150):
                key = _key(tid * 1000 + rng.randrange(20))
                op = rng.random()
                if op < 0.45:
                    value = rng.randrange(1 << 16)
                    bs.put(key, np.full(16, value, np.uint16))
                    model[key] = value
                elif op < 0.55:
                    assert bs.delete(key) is (key in model)
                    model.pop(key, None)
                else:
                    block = bs.get(key)
                    if key in model:
                        assert block is not None and int(block[0]) == model[key]
                    else:
                        assert block is None
                    checks += 1
            keys = sorted(model)
            assert [int(b[0]) for b in bs.get_many(keys) if b is not None] == [
                model[k] for k in keys]
            return checks
        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(worker, range(8))) > 0
        assert bs.stats()["tiers"][0]["errors"] == 0


class SlowTier(LatencyTier):
    """A DRAM tier whose puts wait on an event the test sets (on the store's loop)."""

    def __init__(self) -> None:
        super().__init__(delay=0)
        self.release = asyncio.Event()
        self.entered = threading.Event()
        self.blocks: dict[bytes, Block] = {}

    async def _before(self, op: str) -> None:
        if op == "put":
            self.entered.set()
            await self.release.wait()

    async def _put(self, key: bytes, block: Block) -> None:
        await super()._put(key, block)
        self.blocks[key] = np.array(block)


def test_close_while_calls_are_in_flight() -> None:
    tier = SlowTier()
    bs = BlockingStore([tier])
    results: list[object] = []

    def put() -> None:
        try:
            bs.put(_key(1), np.ones(4, np.uint8))
            results.append("ok")
        except BaseException as exc:  # recorded for the assertion below
            results.append(exc)

    writer = threading.Thread(target=put)
    writer.start()
    assert tier.entered.wait(10)
    closer = threading.Thread(target=bs.close)
    closer.start()
    while not bs.closed:  # close() has refused new calls before it waits for the put
        threading.Event().wait(0.01)
    with pytest.raises(ClosedError):
        bs.get(_key(1))
    bs._loop.call_soon_threadsafe(tier.release.set)
    writer.join(10)
    closer.join(10)
    assert not closer.is_alive() and not bs._thread.is_alive()
    assert results == ["ok"]  # the in-flight put finished before the store closed
    assert tier.blocks[_key(1)].tolist() == [1, 1, 1, 1]
    bs.close()  # idempotent


def test_call_after_close_raises_and_close_is_idempotent() -> None:
    bs = BlockingStore(["dram://?capacity=1MiB"])
    bs.put(_key(1), b"abc")
    bs.close()
    bs.close()
    for call in (lambda: bs.get(_key(1)), lambda: bs.put(_key(2), b"x"), bs.stats,
                 lambda: bs.lookup_prefix([_key(1)])):
        with pytest.raises(ClosedError):
            call()
    with pytest.raises(ClosedError), bs:
        pass


def test_write_timeout_cancels_and_raises() -> None:
    tier = SlowTier()
    with BlockingStore([tier], timeout=0.2) as bs:
        with pytest.raises(TimeoutError):
            bs.put(_key(1), b"abc")
        assert _key(1) not in tier.blocks  # cancelled: no effect
        bs._loop.call_soon_threadsafe(tier.release.set)
        bs.put(_key(2), b"def", timeout=5)
        assert bs.get(_key(2)) is not None


def test_store_runs_on_its_own_loop_only() -> None:
    with BlockingStore(["dram://?capacity=1MiB"]) as bs:
        seen: list[asyncio.AbstractEventLoop] = []

        async def where(store: TieredStore) -> int:
            seen.append(asyncio.get_running_loop())
            return await store.lookup_prefix([_key(1)])

        assert bs.submit(where).result(5) == 0
        assert seen == [bs._loop]
        with pytest.raises(RuntimeError, match="own loop thread"):
            asyncio.run_coroutine_threadsafe(_call_from_loop(bs), bs._loop).result(5)


async def _call_from_loop(bs: BlockingStore) -> None:
    bs.get(_key(1))


def test_bad_config_raises_and_stops_the_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError):
        BlockingStore(["dram://?capacity=1MiB"], no_such_option=1)
    with pytest.raises(ValueError, match="timeout"):
        BlockingStore(["dram://?capacity=1MiB"], timeout=-1)
    after = [t for t in threading.enumerate() if t.name == "kvtier-blocking-store"]
    assert "kvtier-blocking-store" in before or not after


def test_exported() -> None:
    assert "BlockingStore" in kvtier.__all__ and kvtier.BlockingStore is BlockingStore


def test_slow_tier_is_a_miss_within_the_read_timeout() -> None:
    tier = LatencyTier(delay=0)
    with BlockingStore([tier]) as bs:
        bs.put(_key(1), b"abc")
        tier.delay = 30  # every later tier call would take 30 s
        assert bs.get(_key(1), timeout=0.2) is None  # the store's deadline: a miss, no raise
        assert bs.lookup_prefix([_key(1)], timeout=0.2) == 0
        tier.delay = 0
        assert bs.get(_key(1), timeout=5) is not None


def test_runs_its_store_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    with BlockingStore(["dram://?capacity=1MiB"], loop_factory=uvloop.new_event_loop) as bs:
        assert isinstance(bs._loop, uvloop.Loop)
        bs.put_many([(_key(i), np.full(4, i, np.uint8)) for i in range(3)])
        assert bs.lookup_prefix([_key(0), _key(1), _key(2), _key(9)]) == 3
        assert int(bs.get(_key(2))[0]) == 2  # type: ignore[index]


def test_events_and_locate_from_a_thread() -> None:
    with BlockingStore(["dram://?capacity=1MiB"], node="n0", block_tokens=16) as bs:
        sub = bs.events(buffer=100)
        keys = [_key(i) for i in range(3)]
        bs.put_many([(k, np.arange(8, dtype=np.uint16)) for k in keys], parent=_key(99))
        first, *events = sub.drain_nowait()  # a subscription starts with AllBlocksCleared
        assert type(first).__name__ == "AllBlocksCleared"
        assert [(type(e).__name__, e.keys, e.parent, e.node) for e in events] == [  # type: ignore[union-attr]
            ("BlockStored", tuple(keys), _key(99), "n0")]
        found = bs.locate_prefix([*keys, _key(7)])
        assert found.node == "n0" and found.pool == 3 and found.nodes["n0"].blocks == 3
        sub.close()
        assert bs.stats()["event_subscribers"] == 0
