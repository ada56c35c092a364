"""One deadline: a store write's timeout cancels the tier's worker-thread calls that have not
started, waits for the ones that have, and its TimeoutError says which (file:// and lmdb://,
with every worker thread of the loop busy)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvtier import TieredStore, open_store
from kvtier.deadline import (
    Deadline,
    DeadlineExceeded,
    acquire,
    after_earlier,
    current,
    in_thread,
)

KEY = b"deadline-key-000"
BLOCK = np.arange(4096, dtype=np.uint16)


@pytest.fixture
def busy_threads() -> Iterator[tuple[ThreadPoolExecutor, threading.Event]]:
    """The loop's worker threads (two), both busy until the event is set."""
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


@pytest.fixture(params=["file", "lmdb"])
async def store(request: pytest.FixtureRequest, tmp_path: Path,
                busy_threads: tuple[ThreadPoolExecutor, threading.Event]
                ) -> AsyncIterator[TieredStore]:
    asyncio.get_running_loop().set_default_executor(busy_threads[0])
    url = f"file://{tmp_path}/blocks" if request.param == "file" else \
        f"lmdb://{tmp_path}/lmdb?capacity=64MiB"
    opened = await open_store([url])
    yield opened
    busy_threads[1].set()
    await opened.aclose()


async def test_a_put_whose_thread_call_never_started_is_cancelled_at_its_deadline(
        store: TieredStore, busy_threads: tuple[ThreadPoolExecutor, threading.Event]) -> None:
    pool, release = busy_threads
    _occupy(pool, release)
    # Safety net so a regression fails instead of hanging: the workers free up after 10 s.
    asyncio.get_running_loop().call_later(10, release.set)
    with pytest.raises(TimeoutError) as caught:
        await store.put(KEY, BLOCK, timeout=0.3)
    # Before: the put waited for the queued write until the busy workers ended (the
    # safety net here, 2.95 s in the issue) and only then raised.
    assert not release.is_set(), "the put waited for a call that had not started"
    assert isinstance(caught.value, DeadlineExceeded)
    assert caught.value.cancelled and not caught.value.awaited
    assert "had not started" in str(caught.value)
    release.set()
    await asyncio.sleep(0.2)  # the freed workers would now run a call left queued
    assert await store.get(KEY) is None  # the cancelled write never ran
    await store.put(KEY, BLOCK, timeout=5)
    got = await store.get(KEY)
    assert got is not None and np.array_equal(got, BLOCK)


async def test_a_delete_whose_thread_call_never_started_leaves_the_key(
        store: TieredStore, busy_threads: tuple[ThreadPoolExecutor, threading.Event]) -> None:
    pool, release = busy_threads
    await store.put(KEY, BLOCK)
    _occupy(pool, release)
    asyncio.get_running_loop().call_later(10, release.set)
    with pytest.raises(TimeoutError) as caught:
        await store.delete(KEY, timeout=0.3)
    assert not release.is_set(), "the delete waited for a call that had not started"
    assert isinstance(caught.value, DeadlineExceeded) and caught.value.cancelled
    release.set()
    await asyncio.sleep(0.2)
    got = await store.get(KEY)  # never deleted later behind the caller's back
    assert got is not None and np.array_equal(got, BLOCK)
    assert await store.delete(KEY, timeout=5) is True


async def test_a_started_call_is_waited_for_and_the_error_says_so() -> None:
    entered = threading.Event()
    release = threading.Event()

    def slow_write() -> str:
        entered.set()
        release.wait(10)
        return "written"

    async def release_soon() -> None:
        await asyncio.to_thread(entered.wait, 10)
        await asyncio.sleep(0.3)  # past the deadline below
        release.set()

    helper = asyncio.ensure_future(release_soon())
    with pytest.raises(DeadlineExceeded) as caught:
        async with Deadline.after(0.1, "put"):
            await in_thread(slow_write, what="slow write")
    await helper
    assert release.is_set()  # raised only once the started call had returned
    assert caught.value.awaited == ("slow write",) and not caught.value.cancelled
    assert "waited for 1 call(s) that had started" in str(caught.value)


async def test_a_nested_deadline_ends_at_the_sooner_one_and_tasks_inherit_it() -> None:
    async with Deadline.after(0.5, "outer") as outer:
        inner = Deadline.after(30, "inner")
        assert inner.at == outer.at
        seen = await asyncio.ensure_future(_current_at())
        assert seen == outer.at
    assert current() is None


async def _current_at() -> float | None:
    deadline = current()
    return None if deadline is None else deadline.at


async def test_a_call_after_the_deadline_never_starts() -> None:
    ran: list[int] = []
    with pytest.raises(DeadlineExceeded) as caught:
        async with Deadline.after(0.05, "op"):
            await asyncio.sleep(0.2)  # cancelled here at the deadline
            await in_thread(ran.append, 1, what="late call")
    assert ran == [] and "no worker-thread call" in str(caught.value)


async def test_a_read_left_running_hands_its_result_to_discard() -> None:
    """A started read its caller left (``wait_started=False``) finishes alone; what it
    returns (a staging slot, say) goes to ``discard`` once it ends, since nobody takes it."""
    started, finish = threading.Event(), threading.Event()
    discarded: list[str] = []
    handed = asyncio.Event()

    def discard(result: str) -> None:
        discarded.append(result)
        handed.set()

    def read() -> str:
        started.set()
        finish.wait(30)
        return "slot 7"

    with ThreadPoolExecutor(1) as pool:
        call = asyncio.ensure_future(in_thread(read, what="read", executor=pool,
                                               wait_started=False, discard=discard))
        await asyncio.to_thread(started.wait, 30)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert discarded == []  # still running
        finish.set()
        async with asyncio.timeout(30):
            await handed.wait()  # the done callback runs on the loop
    assert discarded == ["slot 7"]


async def test_waiting_for_an_earlier_write_is_not_having_started() -> None:
    earlier: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(DeadlineExceeded) as caught:
        async with Deadline.after(0.05, "put"):
            await after_earlier([earlier], "put after an earlier write")
    assert caught.value.cancelled == ("put after an earlier write",)
    assert "had not started" in str(caught.value)
    earlier.set_result(None)
    async with Deadline.after(5, "put"):
        await after_earlier([earlier], "put after an earlier write")  # done: no wait


async def test_waiting_for_a_writer_lock_is_counted_as_cancelled() -> None:
    """The deadline's timer and the lock wait's own timeout fire at the same loop time;
    whichever runs first, the wait is named among the calls the deadline cancelled (it
    was not when the timer won)."""
    lock = asyncio.Lock()
    await lock.acquire()
    with pytest.raises(DeadlineExceeded) as caught:
        async with Deadline.after(0.05, "put"):
            await acquire(lock, "lmdb writer lock")
    assert caught.value.cancelled == ("lmdb writer lock",)
    lock.release()
