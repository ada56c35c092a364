"""The eviction template's state in flight (:class:`EvictionState`) and its victims
(:class:`Leaving`), kept apart from the template in :mod:`kvtier.tiers.budget` so that budgeted
tiers ask one object instead of reaching into the template's fields."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.base import Block

__all__ = ["EvictionState", "Leaving"]


@dataclass(eq=False, slots=True)
class Leaving:
    """A victim between detach and drop: still stored, still readable."""

    key: bytes
    size: int
    block: Block | None  # held in memory by the tier (dram), else read back from storage
    done: asyncio.Future[None] | None = None  # made when someone waits (settled)
    dropping: bool = False  # its drop from storage began: no longer claimed or read


class EvictionState:
    """What the eviction template has in flight, behind one interface: the victims leaving
    (still stored, still readable), the bytes puts claim beyond their victims, the keys puts
    write while they wait for room, the puts waiting for room, and the shielded commits.

    Subclasses of :class:`~kvtier.tiers.budget.BudgetedTier` only ask it (``self._eviction_state``):
    :meth:`leaving_entry`, :meth:`is_leaving`, :meth:`is_writing`, :attr:`busy`,
    :attr:`committing`. The template alone changes it.
    """

    __slots__ = ("_claimed", "_commits", "_leaving", "_leaving_bytes", "_room", "_writing")

    def __init__(self) -> None:
        self._leaving: dict[bytes, Leaving] = {}
        self._leaving_bytes = 0
        self._claimed = 0  # net bytes puts add beyond their victims, until admitted
        self._room: list[asyncio.Future[None]] = []
        self._commits: set[asyncio.Future[Any]] = set()
        # Keys a put is writing while it waits for room: their current bytes are part of
        # that put's reservation, so another put or a delete of the key waits for it (else
        # the bytes it frees would be handed out twice).
        self._writing: dict[bytes, asyncio.Future[None]] = {}

    # ------------------------------------------------------------------ queries
    def leaving_entry(self, key: bytes) -> Leaving | None:
        """``key``'s eviction while it is leaving, else ``None``."""
        return self._leaving.get(key)

    def is_leaving(self, key: bytes) -> bool:
        """Whether ``key`` is a victim between detach and the end of its drop."""
        return key in self._leaving

    def is_writing(self, key: bytes) -> bool:
        """Whether a put that is still making room is writing ``key``."""
        return key in self._writing

    @property
    def busy(self) -> bool:
        """Whether any eviction or evicting put is in flight."""
        return bool(self._leaving or self._writing)

    @property
    def committing(self) -> bool:
        """Whether shielded commits are still running."""
        return bool(self._commits)

    @property
    def leaving_count(self) -> int:
        """Victims leaving now."""
        return len(self._leaving)

    @property
    def leaving_bytes(self) -> int:
        """Budget bytes of the victims leaving now (still counted as used)."""
        return self._leaving_bytes

    @property
    def claimed(self) -> int:
        """Bytes puts claim beyond their victims until their blocks are admitted."""
        return self._claimed

    # ------------------------------------------------------------------ changes
    def add_leaving(self, entry: Leaving) -> None:
        """Count ``entry`` as leaving (detached from the policy, still readable)."""
        self._leaving[entry.key] = entry
        self._leaving_bytes += entry.size

    def remove_leaving(self, entry: Leaving) -> bool:
        """Take ``entry`` out of the leaving map; ``False`` when it is no longer there."""
        if self._leaving.get(entry.key) is not entry:
            return False
        del self._leaving[entry.key]
        self._leaving_bytes -= entry.size
        return True

    def forget_leaving(self) -> None:
        """Let go of every victim's entry (a closing tier releasing its blocks)."""
        self._leaving.clear()

    def claim(self, nbytes: int) -> None:
        """Claim ``nbytes`` for a put beyond its victims."""
        self._claimed += nbytes

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` a put claimed (admitted, or the put failed)."""
        self._claimed -= nbytes

    def start_writing(self, keys: Iterable[bytes], done: asyncio.Future[None]) -> None:
        """Mark ``keys`` as written by the put whose end resolves ``done``."""
        for key in keys:
            self._writing[key] = done

    def written(self, keys: Iterable[bytes], done: asyncio.Future[None]) -> None:
        """The put of ``keys`` ended: unmark them and wake whoever waits on ``done``."""
        for key in keys:
            if self._writing.get(key) is done:
                del self._writing[key]
        if not done.done():
            done.set_result(None)

    async def settled(self, keys: Sequence[bytes]) -> None:
        """Wait until none of ``keys`` is leaving (its demotion and drop have finished) or
        being written by a put that is still making room."""
        while self._leaving or self._writing:
            entry = next((self._leaving[k] for k in keys if k in self._leaving), None)
            if entry is not None:
                if entry.done is None:
                    entry.done = asyncio.get_running_loop().create_future()
                await asyncio.shield(entry.done)
                continue
            writing = next((self._writing[k] for k in keys if k in self._writing), None)
            if writing is None:
                return
            await asyncio.shield(writing)

    def room_changed(self) -> None:
        """Wake the puts waiting for room (an eviction or put ended)."""
        waiters, self._room = self._room, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_for_room(self) -> None:
        """Wait until an eviction or put in flight ends (:meth:`room_changed`)."""
        fut = asyncio.get_running_loop().create_future()
        self._room.append(fut)
        await fut

    def track_commit(self, task: asyncio.Future[None]) -> None:
        """Keep a shielded commit until it ends (see :meth:`commits_done`)."""
        self._commits.add(task)
        task.add_done_callback(self._commit_done)

    def _commit_done(self, task: asyncio.Future[None]) -> None:
        self._commits.discard(task)
        if not task.cancelled():
            task.exception()  # the put that awaited it raised it, or was cancelled first

    async def commits_done(self) -> None:
        """Wait for shielded commits still running."""
        while self._commits:
            await asyncio.gather(*list(self._commits), return_exceptions=True)
