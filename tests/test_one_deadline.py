"""One deadline for the read path, ``BlockingStore`` and a tier URL's ``timeout``: what has
not started is cancelled, what has is waited for, and the error (or the miss's reason)
says which (kvtier.deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import BlockingStore, KVTierError, open_store
from kvtier.deadline import DeadlineExceeded, in_thread
from kvtier.tiers.dram import DRAMTier

KEY = b"one-deadline-key"
BLOCK = np.arange(2048, dtype=np.uint16)


@pytest.fixture
def busy_threads() -> Iterator[tuple[ThreadPoolExecutor, threading.Event]]:
    """Two worker threads, both busy (from :func:`_occupy`) until the event is set."""
    pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-test-busy")
    release = threading.Event()
    yield pool, release
    release.set()
    pool.shutdown(wait=True)


def _occupy(pool: ThreadPoolExecutor, release: threading.Event) -> None:
    started = threading.Barrier(3)

    def hold() -> None:
        started.wait()
        release.wait(30)

    for _ in range(2):
        pool.submit(hold)
    started.wait()


async def test_a_read_past_its_deadline_says_which_calls_it_cancelled(
        tmp_path: Path, busy_threads: tuple[ThreadPoolExecutor, threading.Event]) -> None:
    pool, release = busy_threads
    asyncio.get_running_loop().set_default_executor(pool)
    url = f"file://{tmp_path}/blocks?nowait=0"
    store = await open_store([url])
    await store.put(KEY, BLOCK)
    await store.aclose()
    store = await open_store([url])  # a store that knows its blocks from the disk only
    try:
        _occupy(pool, release)
        asyncio.get_running_loop().call_later(10, release.set)  # a regression fails, not hangs
        assert await store.get(KEY, timeout=0.3) is None  # a miss at the read deadline
        [why] = await store.explain([KEY], timeout=0.3)
        # Before: "the call's deadline ran out before file answered", no word of the calls.
        assert "cancelled 1 call(s) that had not started (file exists)" in str(why), str(why)
        assert not release.is_set()
    finally:
        release.set()
        await store.aclose()


async def test_a_tier_urls_timeout_cancels_a_write_that_never_started(
        tmp_path: Path, busy_threads: tuple[ThreadPoolExecutor, threading.Event]) -> None:
    pool, release = busy_threads
    asyncio.get_running_loop().set_default_executor(pool)
    store = await open_store([f"file://{tmp_path}/blocks?nowait=0&timeout=0.3"])
    try:
        _occupy(pool, release)
        asyncio.get_running_loop().call_later(10, release.set)
        with pytest.raises(KVTierError) as caught:
            await store.put(KEY, BLOCK)  # no store timeout: the tier's own
        # Before: the write waited for its queued thread call (here until the safety net
        # freed the workers after 10 s) and then succeeded.
        assert not release.is_set(), "the put waited for a call that had not started"
        assert "had not started (file write)" in str(caught.value)
        release.set()
        await asyncio.sleep(0.3)  # the freed workers would run a call left queued now
        assert await store.get(KEY) is None  # the cancelled write never ran
        await store.put(KEY, BLOCK)
        got = await store.get(KEY)
        assert got is not None and np.array_equal(got, BLOCK)
    finally:
        release.set()
        await store.aclose()


class _SlowCopyTier(DRAMTier):
    """A tier whose batch read copies into the caller's buffers in a worker thread that,
    once started, takes ``seconds`` (a device copy that cannot be taken back)."""

    seconds = 1.6

    async def _get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        def copy() -> list[bool]:
            time.sleep(self.seconds)
            for out in outs:
                out[...] = 7
            return [True] * len(keys)

        return await in_thread(copy, what="slow copy")


def test_blocking_read_waits_for_a_started_copy_into_the_callers_buffer() -> None:
    with BlockingStore([_SlowCopyTier()], timeout=0.2) as bs:
        out = np.zeros(16, dtype=np.uint8)
        with contextlib.suppress(TimeoutError):  # before: raised after 1 s of grace
            bs.get_many_into([KEY], [out])
        returned = out.copy()
        time.sleep(_SlowCopyTier.seconds)
        # Before: the copy wrote into the buffer 0.4 s after the call had raised.
        assert np.array_equal(out, returned), "the buffer was written after the call returned"


def test_blocking_call_the_loop_never_started_is_cancelled_at_its_deadline() -> None:
    with BlockingStore(["dram://?capacity=1MiB"], timeout=5) as bs:
        stalled, freed = threading.Event(), threading.Event()

        def stall() -> None:  # the store's loop held up (a blocking call in a callback)
            stalled.set()
            time.sleep(0.6)
            freed.set()

        bs._loop.call_soon_threadsafe(stall)
        stalled.wait(5)
        with pytest.raises(DeadlineExceeded) as caught:
            bs.put(KEY, BLOCK, timeout=0.2)
        # Before: the put waited for the loop, ran 0.4 s past its deadline and succeeded.
        assert caught.value.cancelled == ("put",) and "had not started" in str(caught.value)
        assert freed.wait(5)
        assert bs.get(KEY) is None, "a put cancelled before it started ran later"
        bs.put(KEY, BLOCK, timeout=5)
        got = bs.get(KEY)
        assert got is not None and np.array_equal(got, BLOCK)
