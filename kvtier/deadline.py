"""One deadline, passed from the store down to tiers and their worker-thread calls.

The rule, for every deadline kvtier applies (``put``/``delete(timeout=)``, a tier URL's
``timeout``, the open probe's timeout, the read deadline): **cancel what has not started,
wait for what has, and say which**.

- A worker-thread call that is still queued when the deadline passes (every worker busy,
  or it waits for the tier's writer lock) is cancelled: it never runs, and the awaiting
  coroutine sees an :class:`asyncio.CancelledError` that says so, and unwinds as any
  cancelled call does, running its cleanup.
- One that has started is waited for: no cancellation stops a thread, and a call that
  returned while its thread still wrote would act later (land an older value over a newer
  one, read a buffer the caller reuses).
- The scope that set the deadline then raises :class:`DeadlineExceeded` (a
  :class:`TimeoutError`) naming the calls it cancelled and the ones it waited for.

How it travels: :class:`Deadline` is an async context manager; inside it,
:func:`current` returns it, in the task that entered it and in every task that task
creates (a context variable, copied into new tasks), so a tier's commit task and its
worker-thread calls see the store's deadline without a parameter on every tier method.
A nested scope (a tier's own ``timeout`` inside a store deadline) ends at the sooner of the
two. :func:`in_thread` is the one way a tier hands blocking work to a thread under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable, Collection, Iterator
from concurrent.futures import Executor
from functools import partial
from types import TracebackType
from typing import Any, Self, TypeVar

from kvtier.errors import KVTierError
from kvtier.tasks import TaskSet

__all__ = ["Deadline", "DeadlineExceeded", "acquire", "after_earlier", "current", "exempt",
           "in_thread"]

T = TypeVar("T")

_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "kvtier_deadline", default=None)


class DeadlineExceeded(KVTierError, TimeoutError):
    """A deadline passed: what it cancelled before it started, what it waited for.

    Attributes
    ----------
    cancelled
        Names of the worker-thread calls cancelled while still queued (they never ran).
    awaited
        Names of the calls that had started and were waited for to their end.
    """

    def __init__(self, message: str, cancelled: tuple[str, ...] = (),
                 awaited: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.cancelled = cancelled
        self.awaited = awaited

    @property
    def which(self) -> str:
        """What it cancelled and what it waited for, in words (``""``: no call)."""
        parts = []
        if self.cancelled:
            parts.append(f"cancelled {len(self.cancelled)} call(s) that had not started "
                         f"({', '.join(sorted(set(self.cancelled)))})")
        if self.awaited:
            parts.append(f"waited for {len(self.awaited)} call(s) that had started "
                         f"({', '.join(sorted(set(self.awaited)))})")
        return "; ".join(parts)


def _not_started(what: str, why: str) -> asyncio.CancelledError:
    # A plain CancelledError, not a subclass: asyncio.timeout (Python 3.11) turns only
    # exactly that type into its TimeoutError.
    return asyncio.CancelledError(f"{what}: {why}")


class _Call:
    """A function for a worker thread that starts only if it was not cancelled first:
    starting and cancelling take the same lock, so exactly one of them wins."""

    __slots__ = ("args", "fn", "lock", "state", "what")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> None:
        self.fn = fn
        self.args = args
        self.what = what
        self.state = "queued"
        self.lock = threading.Lock()

    def run(self) -> Any:
        with self.lock:
            if self.state != "queued":
                return None  # cancelled meanwhile: nobody awaits the result
            self.state = "running"
        return self.fn(*self.args)

    def cancel(self) -> bool:
        """Whether it was cancelled now (``False``: it has started already)."""
        with self.lock:
            if self.state == "queued":
                self.state = "cancelled"
            return self.state == "cancelled"


class Deadline:
    """A point in loop time by which an operation ends, and what happened at it.

    ``async with Deadline.after(seconds, what):`` runs its body under the deadline: at
    it, the queued worker-thread calls made under it are cancelled and the body is
    cancelled; a call that had started is waited for where it is awaited; and the ``async
    with`` raises :class:`DeadlineExceeded` once the body has unwound.

    Parameters
    ----------
    at
        Loop time (:meth:`asyncio.AbstractEventLoop.time`) of the deadline, ``None``: none.
    what
        The operation, for the error message (``"put"``, ``"file:// probe"``).
    """

    __slots__ = ("_cancelling", "_committed", "_fired", "_parent", "_queued", "_started",
                 "_task", "_task_cancelled", "_timer", "_token", "_within", "at", "awaited",
                 "cancelled", "what")

    def __init__(self, at: float | None, what: str, *, within: Deadline | None = None) -> None:
        self.at = at
        self.what = what
        # A scope that ends with the deadline it is nested in (``within``) sets no timer:
        # that one fires, and its calls are that one's, so one error says what it did.
        self._within = within
        #: Calls cancelled before they started, and calls waited for after the deadline.
        self.cancelled: list[str] = []
        self.awaited: list[str] = []
        # Calls made under it and not finished: their future, and whether a cancelled
        # caller waits for them once started.
        self._queued: dict[_Call, tuple[asyncio.Future[Any], bool]] = \
            {} if within is None else within._queued
        self._parent: Deadline | None = None
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._token: contextvars.Token[Deadline | None] | None = None
        self._fired = False
        self._task_cancelled = False
        self._committed = False
        self._started = 0.0
        self._cancelling = 0

    @classmethod
    def after(cls, seconds: float | None, what: str) -> Deadline:
        """A deadline ``seconds`` from now (``None``: none), never later than the one the
        caller runs under."""
        loop = asyncio.get_running_loop()
        return cls.until(None if seconds is None else loop.time() + seconds, what)

    @classmethod
    def until(cls, at: float | None, what: str) -> Deadline:
        """A deadline at loop time ``at`` (``None``: none), never later than the one the
        caller runs under."""
        outer = current()
        if outer is not None and outer.at is not None and (at is None or outer.at <= at):
            return cls(outer.at, what, within=outer)
        return cls(at, what)

    def remaining(self) -> float | None:
        """Seconds left (never below 0; ``None``: no deadline)."""
        if self.at is None:
            return None
        return max(0.0, self.at - asyncio.get_running_loop().time())

    def commit(self) -> None:
        """From now on cancel nothing under this deadline (and the ones it is nested in):
        for an operation that must not be left half done once a part of it has acted (a
        delete that has removed a key from one tier finishes in the others, so no older
        copy below is served). At the deadline its calls are then waited for."""
        deadline: Deadline | None = self
        while deadline is not None:
            deadline._committed = True
            deadline = deadline._parent

    @property
    def cancels(self) -> bool:
        """Whether the deadline has passed and still cancels what has not started."""
        return self.expired and not self.committed

    @property
    def committed(self) -> bool:
        """Whether :meth:`commit` was called on it or a deadline it is nested in."""
        deadline: Deadline | None = self
        while deadline is not None:
            if deadline._committed:
                return True
            deadline = deadline._parent
        return False

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self._owner()._fired or (self.at is not None
                                        and asyncio.get_running_loop().time() >= self.at)

    # --------------------------------------------------------------- the scope
    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._cancelling = 0 if self._task is None else self._task.cancelling()
        self._parent = current()
        self._token = _CURRENT.set(self)
        self._started = loop.time()
        if self.at is not None and self._within is None:
            self._timer = loop.call_at(self.at, self._expire)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._token is not None:
            _CURRENT.reset(self._token)
        if self._parent is not None:
            self._parent.cancelled += self.cancelled
            self._parent.awaited += self.awaited
        if not self._fired or self._task is None or self._within is not None:
            return  # (nested: the deadline it ends with raises, once the body unwound)
        # Our own cancellation is absorbed here, whatever the body did with it; a call the
        # deadline refused to start (it had passed, the timer not run yet) raised one too.
        pending = self._task.uncancel() if self._task_cancelled else self._task.cancelling()
        ours = pending <= self._cancelling  # else someone else cancelled it too: theirs
        if ours and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            raise self.error() from None

    def _cancel_queued(self) -> None:
        """Cancel every call made under this deadline that has not started; note the
        started ones that will be waited for."""
        self._fired = True
        for call, (future, wait_started) in list(self._queued.items()):
            if not self.committed and call.cancel():
                self.cancelled.append(call.what)
                future.cancel()
            elif wait_started:
                self.awaited.append(call.what)
        self._queued.clear()

    def _owner(self) -> Deadline:
        """The deadline whose timer ends this one (itself unless nested ``within``)."""
        deadline = self
        while deadline._within is not None:
            deadline = deadline._within
        return deadline

    def _expire(self) -> None:
        self._cancel_queued()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            self._task_cancelled = True

    def error(self) -> DeadlineExceeded:
        """The :class:`DeadlineExceeded` that says what this deadline did."""
        seconds = 0.0 if self.at is None else self.at - self._started
        error = DeadlineExceeded("", tuple(self.cancelled), tuple(self.awaited))
        error.args = (f"{self.what}: did not finish within {seconds:.3g} s; "
                      f"{error.which or 'no worker-thread call was in flight'}",)
        return error


def current() -> Deadline | None:
    """The innermost deadline the calling task runs under (``None``: none)."""
    return _CURRENT.get()


@contextlib.contextmanager
def exempt() -> Iterator[None]:
    """Run the block (and the tasks it creates) under no deadline: for cleanup that must
    happen whatever the caller's deadline says (a victim's file leaves storage once the
    budget stopped counting it). Shield it from the caller's cancellation too
    (:func:`kvtier.tiers.base.run_to_end`)."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


async def in_thread(fn: Callable[..., T], /, *args: Any, what: str,
                    executor: Executor | None = None, wait_started: bool = True,
                    track: TaskSet | None = None,
                    discard: Callable[[T], object] | None = None) -> T:
    """``fn(*args)`` in a worker thread (``executor``; default: the loop's), under the
    current deadline's rule.

    Cancelled (by the caller, or by the deadline passing) while still queued, the call
    never runs and :class:`asyncio.CancelledError` is raised. Cancelled once started, it
    is waited for to its end and the cancellation is raised after it
    (``wait_started=False``, for a read into memory the tier owns: the caller leaves at
    once and the thread finishes alone).
    Called after the deadline has passed, it does not start at all.

    Parameters
    ----------
    fn, args
        The blocking call.
    what
        Its name in a :class:`DeadlineExceeded` message (``"lmdb write"``).
    executor
        Where it runs (``None``: the loop's default executor).
    wait_started
        Whether a cancelled caller waits for a started call.
    track
        Where the call's future is held until it ends (a tier's ``aclose`` waits for it).
    discard
        Called with the result of a call that ended after its caller left (a read into a
        staging slot the tier must free), on the loop.
    """
    deadline = current()
    if deadline is not None and deadline.cancels:
        deadline = deadline._owner()  # it raises, once the caller unwound
        deadline._cancel_queued()
        deadline.cancelled.append(what)
        raise _not_started(what, "its deadline had passed")
    call = _Call(fn, args, what)
    future: asyncio.Future[T] = asyncio.get_running_loop().run_in_executor(executor, call.run)
    if deadline is not None:
        deadline._queued[call] = (future, wait_started)
    if track is not None:
        track.track(future)
    interrupted = False
    try:
        while True:
            try:
                result = await asyncio.shield(future)
            except asyncio.CancelledError:
                if future.cancelled():
                    raise _not_started(what, "cancelled before it started") from None
                if future.done():
                    _discard_result(future, discard)
                    raise
                if (deadline is None or not deadline.committed) and call.cancel():
                    future.cancel()
                    if deadline is not None:
                        deadline.cancelled.append(what)
                    raise _not_started(what, "cancelled before it started") from None
                if not wait_started:
                    future.add_done_callback(partial(_discard_result, discard=discard))
                    raise
                interrupted = True
                continue
            if interrupted:
                _discard_result(future, discard)
                raise asyncio.CancelledError
            return result
    finally:
        if deadline is not None:
            deadline._queued.pop(call, None)


def _discard_result(future: asyncio.Future[T], discard: Callable[[T], object] | None) -> None:
    """Hand the result of a call nobody will take to ``discard``."""
    if discard is not None and not future.cancelled() and future.exception() is None:
        discard(future.result())


async def acquire(lock: asyncio.Lock, what: str) -> None:
    """Take ``lock`` (a tier's writer lock) under the current deadline: waiting for it is
    not having started, so a deadline that passes meanwhile gives up the wait
    (:class:`asyncio.CancelledError`, counted as cancelled)."""
    await _before_start(lock.acquire(), what)


async def after_earlier(earlier: Collection[asyncio.Future[Any]], what: str) -> None:
    """Wait until every ``earlier`` future (a tier's writes of the same keys, still in
    flight) is done, under the current deadline: as for a lock (:func:`acquire`), waiting
    for one's turn is not having started, so a deadline that passes meanwhile gives up the
    wait (:class:`asyncio.CancelledError`, counted as cancelled)."""
    if earlier:
        await _before_start(asyncio.wait(earlier), what)


async def _before_start(waiting: Awaitable[Any], what: str) -> None:
    deadline = current()
    if deadline is None or deadline.at is None or deadline.committed:
        await waiting
        return
    try:
        async with asyncio.timeout_at(deadline.at):
            await waiting
    except TimeoutError:
        deadline.cancelled.append(what)
        raise _not_started(what, "its deadline passed while it waited") from None
    except asyncio.CancelledError:
        if deadline.expired:  # the deadline's own timer fired first and cancelled the task
            deadline.cancelled.append(what)
        raise
