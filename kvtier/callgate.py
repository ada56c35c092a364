"""``CallGate``: the entry check of every :class:`~kvtier.store.TieredStore` call and the
count of calls in flight.

A store is open until :meth:`~kvtier.store.TieredStore.aclose` and belongs to the event
loop it is first used on. The gate says so at each call (``ClosedError``,
``WrongLoopError``), counts the calls decorated with :func:`in_flight` until they return,
and lets ``aclose`` wait for them before it closes the tiers those calls may still be using
(a demotion, a pool copy).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from kvtier.errors import ClosedError, WrongLoopError

__all__ = ["CallGate", "in_flight"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class CallGate:
    """Open/closed state, the owning event loop and the calls in flight of one store.

    Notes
    -----
    Used from the store's own loop only (the gate is what enforces that).
    """

    def __init__(self) -> None:
        self.closed = False
        #: The loop the store belongs to (``None`` until its first call).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.calls = 0  # calls running now (see in_flight)
        self._idle: asyncio.Event | None = None  # set when they are done, while closing

    def enter(self) -> None:
        """Every call's entry check: open, and on the store's own event loop."""
        if self.closed:
            raise ClosedError("store is closed")
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            self.bind(loop)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make ``loop`` the store's loop; raise ``WrongLoopError`` if it has another."""
        if self.loop is None:
            self.loop = loop
            return
        raise WrongLoopError(
            "TieredStore was opened on another event loop; a store serves only the loop it "
            "was opened on. From synchronous code or threads use kvtier.BlockingStore(urls), "
            "which runs the store on its own loop; asyncio code on another loop opens its "
            "own store.")

    def close(self) -> None:
        """Refuse calls from now on (``ClosedError``); ``WrongLoopError`` from another
        loop than the store's, whose tiers' resources live on that loop."""
        loop = asyncio.get_running_loop()
        if self.loop is not None and loop is not self.loop:
            self.bind(loop)  # raises WrongLoopError
        self.closed = True

    async def idle(self) -> None:
        """Wait until the calls in flight have returned."""
        if self.calls:
            self._idle = asyncio.Event()
            await self._idle.wait()

    def left(self) -> None:
        """One call in flight has returned."""
        self.calls -= 1
        if not self.calls and self._idle is not None:
            self._idle.set()


class _Gated(Protocol):
    _gate: CallGate


_G = TypeVar("_G", bound=_Gated)


def in_flight(method: Callable[Concatenate[_G, _P], Awaitable[_R]]
              ) -> Callable[Concatenate[_G, _P], Coroutine[Any, Any, _R]]:
    """Count a call as in flight until it returns: :meth:`CallGate.idle` waits for it."""

    @functools.wraps(method)
    async def call(self: _G, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        gate = self._gate
        gate.calls += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            gate.left()

    return call
