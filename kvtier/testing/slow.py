"""A slow storage backend for tests, made real: worker threads that start late.

:class:`SlowWorkerThreads` is a :class:`~concurrent.futures.ThreadPoolExecutor` that sleeps
``delay`` seconds in the worker thread before it calls the function it was given. Installed
as an event loop's default executor (:func:`slow_worker_threads`), it delays every blocking
call a tier hands to ``asyncio.to_thread`` or ``run_in_executor(None, ...)`` (an LMDB
transaction, a file write, a device copy) exactly as a slow disk would: the tier's own code
runs unchanged, only later. A tier with an executor of its own passes an instance to it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

__all__ = ["SlowWorkerThreads", "slow_worker_threads"]

P = ParamSpec("P")
T = TypeVar("T")

_installed: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SlowWorkerThreads] = \
    weakref.WeakKeyDictionary()


class SlowWorkerThreads(ThreadPoolExecutor):
    """A thread pool whose calls start ``delay`` seconds late (``0``: on time).

    ``delay`` is read when a call is submitted, so calls made while it is set are slow and
    later ones are not. ``hold`` is the same after the call: its thread stays busy (and its
    future undone) that long after the function returned, as a call that has started and
    takes long would. :meth:`idle` waits until every submitted call has returned.
    :meth:`fail_next` makes the next calls die in their worker thread before they start, as
    a thread that runs out of memory does.
    """

    def __init__(self, max_workers: int | None = None) -> None:
        super().__init__(max_workers, thread_name_prefix="kvtier-slow")
        self.delay = 0.0
        self.hold = 0.0
        #: Calls that started late so far.
        self.delayed = 0
        self._submitted: set[Future[Any]] = set()
        self._count_lock = threading.Lock()
        self._failures: list[BaseException] = []

    def fail_next(self, error: BaseException, count: int = 1) -> None:
        """Make the next ``count`` calls raise ``error`` in their worker thread instead of
        running."""
        with self._count_lock:
            self._failures += [error] * count

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        delay, hold = self.delay, self.hold
        with self._count_lock:
            failure = self._failures.pop(0) if self._failures else None

        def late() -> T:
            if failure is not None:
                raise failure
            if delay > 0:
                time.sleep(delay)
                with self._count_lock:
                    self.delayed += 1
            result = fn(*args, **kwargs)
            if hold > 0:
                time.sleep(hold)
            return result

        future = super().submit(late)
        with self._count_lock:
            self._submitted.add(future)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future[Any]) -> None:
        with self._count_lock:
            self._submitted.discard(future)

    @property
    def pending(self) -> int:
        """Calls submitted that have not returned yet."""
        return len(self._submitted)

    async def idle(self) -> None:
        """Wait until every call submitted so far has returned, then let the loop run the
        callbacks their ends scheduled."""
        while self._submitted:
            with self._count_lock:
                running = [asyncio.wrap_future(f) for f in self._submitted]
            await asyncio.wait(running)
        for _ in range(3):
            await asyncio.sleep(0)


def slow_worker_threads(loop: asyncio.AbstractEventLoop | None = None) -> SlowWorkerThreads:
    """The :class:`SlowWorkerThreads` installed as ``loop``'s default executor (installed on
    first use; default: the running loop). Install it before the tier under test makes its
    first worker-thread call."""
    loop = loop or asyncio.get_running_loop()
    threads = _installed.get(loop)
    if threads is None:
        threads = SlowWorkerThreads()
        loop.set_default_executor(threads)
        _installed[loop] = threads
    return threads


