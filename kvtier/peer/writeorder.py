"""Writes of one key, applied in the order they arrived.

A peer server keeps serving a PUT whose client gave up (its deadline passed): the block is
valid, so it is stored anyway. Without an order, that older write could finish after a newer
PUT or DELETE of the same key that the client sent next (a slow decode in a worker thread, a
slow segment), and the older value would win. :class:`WriteOrder` hands out turns per key in
arrival order; a write waits for the earlier writes of its keys to finish, never for others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

__all__ = ["WriteOrder"]


class WriteOrder:
    """Per-key turns: ``async with order.turn(keys):`` runs after every earlier turn that
    named one of ``keys`` has ended."""

    def __init__(self) -> None:
        self._last: dict[bytes, asyncio.Future[None]] = {}
        self._releasing: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        """Keys with a write in flight."""
        return len(self._last)

    @contextlib.asynccontextmanager
    async def turn(self, keys: Iterable[bytes]) -> AsyncIterator[None]:
        """Wait for the earlier writes of ``keys``, then hold their turn while the body runs.
        The turn is taken when this is entered (all keys at once, so turns of several keys
        cannot wait on each other in a cycle)."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        unique = list(dict.fromkeys(keys))
        earlier = {id(f): f for k in unique if (f := self._last.get(k)) is not None}
        for key in unique:
            self._last[key] = mine
        try:
            for before in earlier.values():
                await asyncio.shield(before)
            yield
        finally:
            waiting = [f for f in earlier.values() if not f.done()]
            if waiting:  # cancelled while waiting: later turns still wait for the earlier
                task = asyncio.ensure_future(self._end_after(waiting, mine, unique))
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)
            else:
                self._end(mine, unique)

    async def _end_after(self, waiting: list[asyncio.Future[None]], turn: asyncio.Future[None],
                         keys: list[bytes]) -> None:
        await asyncio.wait(waiting)
        self._end(turn, keys)

    def _end(self, turn: asyncio.Future[None], keys: list[bytes]) -> None:
        turn.set_result(None)
        for key in keys:
            if self._last.get(key) is turn:
                del self._last[key]
