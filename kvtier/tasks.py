"""``TaskSet``: the tasks (and worker-thread futures) an object started and awaits at its
close.

Why one helper: a bare ``asyncio`` task can be garbage-collected mid-flight unless something
references it, and a close that returns while one of them still runs lets it act after
the close (write a file, land a copy, touch a closed environment). Every owner of
background work needs the same three things: a strong reference until the task is done,
a wait that also covers tasks started while it waits, and a cancel that waits until the
cancelled tasks have ended. Several closes at once (two callers of ``aclose``) wait on the
same tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["TaskSet"]

T = TypeVar("T")


class TaskSet:
    """Tasks started by one owner, referenced until done and awaited at its close.

    Concurrency: on the owner's event loop only. :meth:`wait` and :meth:`cancel_all` may be
    awaited by several callers at once.
    """

    def __init__(self) -> None:
        self._items: set[asyncio.Future[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, T], *, name: str | None = None
              ) -> asyncio.Task[T]:
        """Run ``coro`` as a task held here until it is done."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.track(task)
        return task

    def track(self, future: asyncio.Future[T]) -> asyncio.Future[T]:
        """Hold ``future`` (a task, a worker-thread call) here until it is done."""
        if not future.done():
            self._items.add(future)
            future.add_done_callback(self._items.discard)
        return future

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[asyncio.Future[Any]]:
        return iter(list(self._items))

    async def wait(self) -> None:
        """Wait until every task is done, including tasks started meanwhile (their
        outcomes are their owners' business: errors are not raised here)."""
        while self._items:
            await asyncio.gather(*self._items, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel every task and wait until all are done."""
        while self._items:
            items = list(self._items)
            for item in items:
                item.cancel()
            await asyncio.gather(*items, return_exceptions=True)
