"""A call that has returned never acts later: the issue's repros of worker threads that
outlived their caller (LMDB reads into a reused buffer, file:// writes landing after a
newer value, uncounted), each against real tiers whose worker threads start late
(:mod:`kvtier.testing.slow`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from kvtier import BlockingStore, TieredStore
from kvtier.errors import TierError
from kvtier.peer.writeorder import WriteOrder
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.slow import SlowWorkerThreads, slow_worker_threads
from kvtier.tiers.fsspec import BLOCK_SUFFIX, FsspecTier
from kvtier.tiers.lmdb import LMDBTier

T = TypeVar("T")


async def test_lmdb_get_into_that_timed_out_never_writes_the_buffer(tmp_path: Path) -> None:
    threads = slow_worker_threads()
    store = TieredStore([LMDBTier(tmp_path / "db", inline_reads=False)])
    block = sample_block(1)
    await store.put(key_of(1), block)
    out = np.zeros_like(block)
    threads.delay = 0.2
    assert await store.get_into(key_of(1), out, timeout=0.05) is False
    threads.delay = 0.0
    out[...] = 7  # the caller recomputes the block into its buffer
    await threads.idle()
    assert np.all(out == 7)
    await store.aclose()


async def test_file_put_that_timed_out_never_lands_over_a_newer_value(tmp_path: Path) -> None:
    threads = slow_worker_threads()
    tier = FsspecTier(f"file://{tmp_path}/kv", timeout=0.1)
    threads.delay = 0.3
    with contextlib.suppress(TierError):  # a put that gives up must not act later
        await tier.put(key_of(1), sample_block(1))
    threads.delay = 0.0
    await tier.put(key_of(1), sample_block(2))
    await threads.idle()
    got = await tier.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(2).tobytes()
    await tier.aclose()


async def test_file_puts_that_timed_out_are_counted(tmp_path: Path) -> None:
    threads = slow_worker_threads()
    tier = FsspecTier(f"file://{tmp_path}/kv", timeout=0.05, capacity=64 << 10)
    threads.delay = 0.15
    await asyncio.gather(*(tier.put(key_of(i), sample_block(i)) for i in range(8)),
                         return_exceptions=True)
    threads.delay = 0.0
    await threads.idle()
    files = [p for p in (tmp_path / "kv").rglob(f"*{BLOCK_SUFFIX}")]
    assert tier.used == sum(p.stat().st_size for p in files)
    assert len(tier.resident_keys() or []) == len(files)
    await tier.aclose()


class _HeldAfterTheCall(ThreadPoolExecutor):
    """Worker threads whose call has run to its end before ``submit`` returns (the loop
    waits for it, so no timer can fire first), then keeps its thread, and its future undone,
    until :attr:`release` is set: a write that started before its deadline and ends after
    it, in that order whatever the load."""

    def __init__(self) -> None:
        super().__init__(2, thread_name_prefix="kvtier-held")
        self.release = threading.Event()
        self.ran = asyncio.Event()  # submit is called on the loop

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        returned = threading.Event()

        def held() -> T:
            try:
                return fn(*args, **kwargs)
            finally:
                returned.set()
                self.release.wait(30)

        future = super().submit(held)
        assert returned.wait(30), "the worker thread never ran the call"
        self.ran.set()
        return future


async def test_file_write_that_ends_after_the_timeout_is_counted(tmp_path: Path) -> None:
    """A write that had started at the tier's ``timeout`` is waited for; the put then says
    it timed out, and the block it stored is counted (before the fix it sat on disk with
    ``used == 0``: the failure seen at load in the test above)."""
    threads = _HeldAfterTheCall()
    asyncio.get_running_loop().set_default_executor(threads)
    tier = FsspecTier(f"file://{tmp_path}/kv", timeout=0.05, capacity=64 << 10)
    put = asyncio.create_task(tier.put(key_of(1), sample_block(1)))
    await threads.ran.wait()  # the write has run; its thread is held
    await asyncio.sleep(0.1)  # a timer due after the put's deadline: that one fired first
    assert not put.done()  # a started write is waited for
    threads.release.set()
    with pytest.raises(TierError, match=r"write.*had started"):
        await put
    files = list((tmp_path / "kv").rglob(f"*{BLOCK_SUFFIX}"))
    assert len(files) == 1
    assert tier.used == files[0].stat().st_size
    assert tier.resident_keys() == [key_of(1)]
    await tier.aclose()


async def test_file_delete_cancelled_before_it_started_keeps_the_block_counted(
        tmp_path: Path) -> None:
    """A delete still queued at the tier's ``timeout`` never runs: the file stays, and so
    must its count (before the fix the budget forgot it: on disk, ``used == 0``, never
    evicted). One that ran, whatever the deadline said after, is forgotten."""
    tier = FsspecTier(f"file://{tmp_path}/kv", timeout=0.05, capacity=64 << 10)
    await tier.put(key_of(1), sample_block(1))
    await tier.put(key_of(2), sample_block(2))
    used = tier.used
    busy, release = ThreadPoolExecutor(1), threading.Event()
    asyncio.get_running_loop().set_default_executor(busy)
    busy.submit(release.wait, 30)  # the only worker thread is busy: the delete is queued
    with pytest.raises(TierError, match="had not started"):
        await tier.delete(key_of(1))
    release.set()
    files = list((tmp_path / "kv").rglob(f"*{BLOCK_SUFFIX}"))
    assert len(files) == 2
    assert tier.used == used == sum(p.stat().st_size for p in files)
    assert sorted(tier.resident_keys() or []) == [key_of(1), key_of(2)]
    threads = _HeldAfterTheCall()  # now a delete that runs, then outlives its deadline
    asyncio.get_running_loop().set_default_executor(threads)
    delete = asyncio.create_task(tier.delete(key_of(2)))
    await threads.ran.wait()
    await asyncio.sleep(0.1)  # a timer due after the delete's deadline: that one fired first
    threads.release.set()
    with pytest.raises(TierError, match="had started"):
        await delete
    assert tier.resident_keys() == [key_of(1)]
    assert tier.used == used // 2  # two blocks of one size: one left
    await tier.aclose()


async def test_lmdb_commit_that_fails_otherwise_than_lmdb_keeps_victims_counted(
        tmp_path: Path) -> None:
    """A commit whose worker thread dies with something other than an ``lmdb.Error`` (here
    MemoryError) wrote nothing: its victims, still on disk, are deleted or still counted,
    never forgotten by the budget only to come back at the next open."""
    threads = slow_worker_threads()
    capacity = 2 * (1024 + 43)
    tier = LMDBTier(tmp_path / "db", capacity=capacity)

    async def on_evict(key: bytes, block: np.ndarray) -> None:
        threads.fail_next(MemoryError("worker thread out of memory"))  # the commit's

    await tier.put(key_of(1), sample_block(1))
    await tier.put(key_of(2), sample_block(2))
    tier.on_evict = on_evict
    with pytest.raises(MemoryError):
        await tier.put(key_of(3), sample_block(3))
    held = await tier.contains(key_of(1))
    await tier.aclose()
    reopened = LMDBTier(tmp_path / "db", capacity=capacity)
    assert await reopened.contains(key_of(1)) == held
    assert not await reopened.contains(key_of(3))
    await reopened.aclose()


async def test_store_put_and_delete_take_a_deadline(tmp_path: Path) -> None:
    threads = slow_worker_threads()
    store = TieredStore([LMDBTier(tmp_path / "db", capacity=1 << 20)])
    value = sample_block(1)
    threads.delay = 0.2
    with pytest.raises(TimeoutError, match="put"):
        await store.put(key_of(1), value, timeout=0.05)
    value[...] = 0  # the caller's buffer is its own again
    with pytest.raises(TimeoutError, match="put_many"):
        await store.put_many([(key_of(2), sample_block(2))], timeout=0.05)
    threads.delay = 0.0
    await threads.idle()
    for i in (1, 2):  # stored or not, never what the caller wrote after giving up
        got = await store.get(key_of(i))
        assert got is None or got.tobytes() == sample_block(i).tobytes()
    threads.delay = 0.2
    with pytest.raises(TimeoutError, match="delete"):
        await store.delete(key_of(1), timeout=0.05)
    threads.delay = 0.0
    assert await store.get(key_of(1)) is None  # a delete that timed out still finished
    await store.put(key_of(3), sample_block(3), timeout=math.inf)
    assert await store.delete_many([key_of(3)], timeout=5) == [True]
    with pytest.raises(ValueError, match="timeout"):
        await store.put(key_of(4), sample_block(4), timeout=0)
    await store.aclose()


def test_blocking_put_that_timed_out_never_reads_the_buffer_later(tmp_path: Path) -> None:
    with BlockingStore([LMDBTier(tmp_path / "db", capacity=1 << 20)]) as bs:
        threads = bs.submit(_install_slow_threads).result(5)
        bs.put(key_of(9), sample_block(9))  # the environment is open
        value = sample_block(1)
        threads.delay = 0.3
        with pytest.raises(TimeoutError):
            bs.put(key_of(1), value, timeout=0.05)
        value[...] = 0  # the caller reuses its buffer
        threads.delay = 0.0
        bs.submit(lambda s: threads.idle()).result(5)
        got = bs.get(key_of(1))
        assert got is None or got.tobytes() == sample_block(1).tobytes()


async def _install_slow_threads(store: TieredStore) -> SlowWorkerThreads:
    return slow_worker_threads()


async def test_peer_server_write_turns_run_in_arrival_order() -> None:
    order = WriteOrder()
    ran: list[str] = []
    release = asyncio.Event()

    async def write(name: str, keys: list[bytes], hold: bool = False) -> None:
        async with order.turn(keys):
            if hold:
                await release.wait()
            if name == "b":
                raise TierError("segment failed")  # a failed write still ends its turn
            ran.append(name)

    first = asyncio.create_task(write("a", [b"k1", b"k2"], hold=True))
    await asyncio.sleep(0)
    later = [asyncio.create_task(write(n, k)) for n, k in
             (("b", [b"k2"]), ("c", [b"k2", b"k3"]), ("d", [b"k9"]))]
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == ["d"]  # other keys never wait
    release.set()
    await asyncio.gather(first, *later, return_exceptions=True)
    assert ran == ["d", "a", "c"] and len(order) == 0


async def test_a_write_turn_cancelled_while_waiting_still_orders_the_next() -> None:
    order = WriteOrder()
    ran: list[str] = []
    release = asyncio.Event()

    async def write(name: str, hold: bool = False) -> None:
        async with order.turn([b"k"]):
            if hold:
                await release.wait()
            ran.append(name)

    first = asyncio.create_task(write("a", hold=True))
    await asyncio.sleep(0)
    gone = asyncio.create_task(write("b"))  # its client goes away while it waits
    await asyncio.sleep(0)
    last = asyncio.create_task(write("c"))
    await asyncio.sleep(0)
    gone.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == []  # "c" still waits for "a"
    release.set()
    await asyncio.gather(first, last)
    assert ran == ["a", "c"] and len(order) == 0
