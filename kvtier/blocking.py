"""``BlockingStore``: the thread-safe synchronous facade over a :class:`~kvtier.TieredStore`.

Engine schedulers and many servers call from plain threads. ``BlockingStore`` owns one
background thread running an event loop, opens the store on that loop, and hands every call
to it with :func:`asyncio.run_coroutine_threadsafe`; the calling thread waits (bounded by a
per-call timeout) on the returned future. The store is only ever touched on its own loop, so
any number of threads may call at once. It is not a set of generated sync twins of the async
methods, and never ``asyncio.run`` per call.

A call's timeout is one :class:`~kvtier.deadline.Deadline` with its rule (cancel what has
not started, wait for what has, say which): counted from when the thread called, it is the
store's deadline for the operation (or, for a verb without one, a ``Deadline`` entered on the
loop around it); a call the loop had not started by then is cancelled there and then (it
never runs, :class:`~kvtier.deadline.DeadlineExceeded` says so); one it had started is
waited for, and the store ends it at the deadline. So a call that returned or raised never
acts later: no read fills a caller's buffer, no write lands, after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

from kvtier.deadline import Deadline, DeadlineExceeded
from kvtier.errors import ClosedError
from kvtier.events import Subscription
from kvtier.explain import Explanation
from kvtier.store import TieredStore, open_store
from kvtier.tierchain import check_timeout
from kvtier.tiers.base import Block, Tier

if TYPE_CHECKING:
    from kvtier.peer.locate import PrefixLocation

__all__ = ["BlockingStore"]

T = TypeVar("T")

_UNSET: Any = object()


class _Start:
    """Whether a call handed to the loop starts there or is cancelled first: starting and
    cancelling take one lock, so exactly one of them wins."""

    __slots__ = ("lock", "state")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = "queued"

    def start(self) -> bool:
        with self.lock:
            if self.state == "queued":
                self.state = "running"
            return self.state == "running"

    def cancel(self) -> bool:
        with self.lock:
            if self.state == "queued":
                self.state = "cancelled"
            return self.state == "cancelled"


class BlockingStore:
    """A :class:`~kvtier.TieredStore` usable from synchronous code and from many threads.

    Parameters
    ----------
    urls
        Tier URLs (or tier objects), top first, as for :func:`kvtier.open_store`.
    timeout
        Default per-call timeout in seconds (``None``: wait forever), one deadline counted
        from the call (see the module's docstring). Reads (``get``, ``get_many``,
        ``get_many_into``, ``contains``, ``lookup_prefix``, ``explain``) pass what is left of
        it to the store as their deadline, so a tier slower than that counts as a miss;
        writes (``put``, ``put_many``, ``delete``) too, and the store raises
        ``TimeoutError`` once nothing the write started can still act. The other calls run
        under a deadline on the loop (cancelled at it: their full effect or none). A call
        the loop had not started by the deadline is cancelled without running, and raises
        :class:`~kvtier.deadline.DeadlineExceeded` (a ``TimeoutError``).
    close_timeout
        How long :meth:`close` waits for calls in flight and for the store to flush.
    loop_factory
        Builds the event loop of the store's thread (default :func:`asyncio.new_event_loop`;
        pass ``uvloop.new_event_loop`` for uvloop).
    tier_options, **options
        As for :func:`kvtier.open_store` (store options such as ``write_policy``).

    Raises
    ------
    ConfigError, TypeError, ValueError
        As :func:`kvtier.open_store` would; the thread is stopped again.

    Notes
    -----
    Concurrency: every method may be called from any thread at once, except from inside the
    store's own loop thread (that would deadlock; it raises ``RuntimeError``). Blocks returned
    by ``get``/``get_many`` may be read-only views owned by the store: copy before mutating.
    Buffers passed to ``get_many_into`` must stay alive and untouched until the call returns.

    :meth:`close` (also run by ``with``) refuses new calls, waits for calls in flight, flushes
    queued writes, closes the tiers and joins the thread; calling it again does nothing. Any
    call after ``close`` raises :class:`~kvtier.ClosedError`.

    Examples
    --------
    >>> import numpy as np
    >>> from kvtier import BlockingStore
    >>> with BlockingStore(["dram://?capacity=64MiB"]) as store:
    ...     store.put(b"k" * 16, np.arange(4, dtype=np.uint16))
    ...     store.get(b"k" * 16).tolist()
    [0, 1, 2, 3]
    """

    def __init__(self, urls: Sequence[str | Tier], *, timeout: float | None = 30.0,
                 close_timeout: float = 60.0,
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
                 tier_options: Mapping[int | str, Mapping[str, Any]] | None = None,
                 **options: Any) -> None:
        self._timeout = check_timeout(timeout)
        checked_close = check_timeout(close_timeout, "close_timeout")
        self._close_timeout = checked_close
        self._lock = threading.Lock()
        self._closed = False
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._loop = (loop_factory or asyncio.new_event_loop)()
        self._thread = threading.Thread(target=self._run_loop, name="kvtier-blocking-store",
                                        daemon=True)
        self._thread.start()
        async def open_on_loop() -> TieredStore:
            # The store binds to the loop it is opened on: this thread's loop.
            return await open_store(urls, tier_options=tier_options, **options)

        opening = asyncio.run_coroutine_threadsafe(open_on_loop(), self._loop)
        try:
            self._store: TieredStore = opening.result()
        except BaseException:
            self._closed = True
            self._stop_loop()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    # ------------------------------------------------------------------ plumbing
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    @property
    def store(self) -> TieredStore:
        """The underlying store. Use it only through :meth:`submit` (it belongs to the loop)."""
        return self._store

    def submit(self, fn: Callable[[TieredStore], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Schedule ``fn(store)`` on the store's loop and return its future without waiting.

        This is the non-blocking form engines use to overlap I/O with compute, e.g.
        ``fut = bs.submit(lambda s: s.put_many(items))``; ``fut.result(timeout)`` or
        ``fut.done()`` later. Cancelling the future cancels the operation.

        Raises
        ------
        ClosedError
            After :meth:`close`.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("BlockingStore called from its own loop thread (would deadlock); "
                               "await the TieredStore (BlockingStore.store) directly there")
        with self._lock:
            if self._closed:
                raise ClosedError("BlockingStore is closed")

            async def call() -> T:
                return await fn(self._store)

            future = asyncio.run_coroutine_threadsafe(call(), self._loop)
            self._inflight.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(future)

    def _timeout_of(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is _UNSET else check_timeout(timeout)

    def _call(self, what: str, fn: Callable[[TieredStore, float | None], Awaitable[T]],
              timeout: float | None, *, store_deadline: bool = True) -> T:
        """``fn(store, seconds left)`` on the loop under the call's deadline: the store's
        (``store_deadline``: ``fn`` hands it the seconds left) or a :class:`Deadline` around
        ``fn``. Cancelled if the loop has not started it by the deadline, else waited for:
        the deadline ends it there."""
        seconds = self._timeout_of(timeout)
        called = time.monotonic()
        start = _Start()

        async def run(store: TieredStore) -> T:
            if not start.start():
                raise asyncio.CancelledError(f"{what}: cancelled before it started")
            left = None if seconds is None else \
                max(seconds - (time.monotonic() - called), 1e-9)  # > 0: the store's rule
            if store_deadline:
                return await fn(store, left)
            async with Deadline.after(left, what):
                return await fn(store, left)

        future = self.submit(run)
        try:
            return future.result(seconds)
        except concurrent.futures.TimeoutError:
            if start.cancel():
                future.cancel()
                raise DeadlineExceeded(
                    f"{what}: did not finish within {seconds:.3g} s; cancelled 1 call(s) "
                    f"that had not started (the store's loop had not run it)",
                    cancelled=(what,)) from None
        return future.result()  # started: it ends at the deadline (or after a started call)

    # ------------------------------------------------------------------ reads
    def get(self, key: bytes, *, timeout: float | None = _UNSET) -> Block | None:
        """:meth:`TieredStore.get`: the block, or ``None`` on a miss."""
        return self._call("get", lambda s, t: s.get(key, timeout=t), timeout)

    def get_many(self, keys: Sequence[bytes], *, timeout: float | None = _UNSET
                 ) -> list[Block | None]:
        """:meth:`TieredStore.get_many`: blocks or ``None``, in key order."""
        return self._call("get_many", lambda s, t: s.get_many(keys, timeout=t), timeout)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      timeout: float | None = _UNSET) -> list[bool]:
        """:meth:`TieredStore.get_many_into`: fill caller buffers; ``False`` where missing."""
        return self._call("get_many_into",
                          lambda s, t: s.get_many_into(keys, outs, timeout=t), timeout)

    def contains(self, key: bytes, *, timeout: float | None = _UNSET) -> bool:
        """:meth:`TieredStore.contains` (refreshes no recency)."""
        return self._call("contains", lambda s, t: s.contains(key, timeout=t), timeout)

    def contains_many(self, keys: Sequence[bytes], *, timeout: float | None = _UNSET
                      ) -> list[bool]:
        """:meth:`TieredStore.contains_many`: whether some tier holds each key."""
        return self._call("contains_many", lambda s, t: s.contains_many(keys, timeout=t),
                          timeout)

    def lookup_prefix(self, keys: Sequence[bytes], *, timeout: float | None = _UNSET) -> int:
        """:meth:`TieredStore.lookup_prefix`: how many leading keys some tier holds."""
        return self._call("lookup_prefix", lambda s, t: s.lookup_prefix(keys, timeout=t),
                          timeout)

    def explain(self, keys: Sequence[bytes], *, timeout: float | None = _UNSET
                ) -> list[Explanation]:
        """:meth:`TieredStore.explain`: where each key was looked for and why it missed."""
        return self._call("explain", lambda s, t: s.explain(keys, timeout=t), timeout)

    def locate_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None
                      ) -> PrefixLocation:
        """:meth:`TieredStore.locate_prefix`; ``timeout`` is its deadline for the members'
        answers (default: the store's, else 0.05 s), not this facade's call timeout."""
        return self._call("locate_prefix", lambda s, _: s.locate_prefix(keys, timeout=timeout),
                          _UNSET, store_deadline=False)

    def route(self, keys: Sequence[bytes], candidates: Sequence[str],
              load: Mapping[str, float] | None = None) -> str:
        """:meth:`TieredStore.route`: the pool member a router sends this prompt to (run on
        the store's loop, which owns the pool's placement state; no network request)."""
        async def route(store: TieredStore) -> str:
            return store.route(keys, candidates, load)
        return self._call("route", lambda s, _: route(s), _UNSET, store_deadline=False)

    def events(self, *, buffer: int | None = None) -> Subscription:
        """:meth:`TieredStore.events`, subscribed on the store's loop. A thread polls it with
        ``Subscription.drain_nowait()`` (never blocks); ``sub.close()`` ends it."""
        async def subscribe(store: TieredStore) -> Subscription:
            return store.events(buffer=buffer)
        return self._call("events", lambda s, _: subscribe(s), _UNSET, store_deadline=False)

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, value: object, *, timeout: float | None = _UNSET) -> None:
        """:meth:`TieredStore.put` with ``timeout`` as its deadline."""
        self._call("put", lambda s, t: s.put(key, value, timeout=t), timeout)

    def put_many(self, items: Iterable[tuple[bytes, object]], *,
                 timeout: float | None = _UNSET, parent: bytes | None = None) -> None:
        """:meth:`TieredStore.put_many` with ``timeout`` as its deadline (``items`` is
        materialised on the calling thread; ``parent``: the key before the chain, for KV
        events)."""
        pairs = list(items)
        self._call("put_many", lambda s, t: s.put_many(pairs, parent=parent, timeout=t),
                   timeout)

    def delete(self, key: bytes, *, timeout: float | None = _UNSET) -> bool:
        """:meth:`TieredStore.delete` with ``timeout`` as its deadline: whether some tier
        held ``key``."""
        return self._call("delete", lambda s, t: s.delete(key, timeout=t), timeout)

    def pin(self, keys: Sequence[bytes], *, tier: int | None = None,
            timeout: float | None = _UNSET) -> None:
        """:meth:`TieredStore.pin`."""
        self._call("pin", lambda s, _: s.pin(keys, tier=tier), timeout, store_deadline=False)

    def unpin(self, keys: Sequence[bytes], *, tier: int | None = None,
              timeout: float | None = _UNSET) -> None:
        """:meth:`TieredStore.unpin`."""
        self._call("unpin", lambda s, _: s.unpin(keys, tier=tier), timeout,
                   store_deadline=False)

    def stats(self, *, timeout: float | None = _UNSET) -> dict[str, Any]:
        """:meth:`TieredStore.stats`, read on the store's loop."""
        async def read(store: TieredStore) -> dict[str, Any]:
            return store.stats()
        return self._call("stats", lambda s, _: read(s), timeout, store_deadline=False)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Refuse new calls, wait for those in flight, flush and close the store, join the thread.

        Calling it again (from any thread) does nothing. Calls still running after
        ``close_timeout`` are cancelled.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("BlockingStore.close() called from its own loop thread")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._inflight)
        _, not_done = concurrent.futures.wait(pending, timeout=self._close_timeout)
        for future in not_done:
            future.cancel()
        closing = asyncio.run_coroutine_threadsafe(self._store.aclose(), self._loop)
        try:
            closing.result(self._close_timeout)
        except concurrent.futures.TimeoutError:
            closing.cancel()
            raise TimeoutError(f"BlockingStore.close: the store did not flush within "
                               f"{self._close_timeout} s") from None
        finally:
            self._stop_loop()

    def __enter__(self) -> Self:
        if self._closed:
            raise ClosedError("BlockingStore is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<BlockingStore {state} {self._store!r}>"
