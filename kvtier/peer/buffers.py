"""Reusable body buffers: the peer server's PUT bodies and the peer client's answers.

A fresh multi-MiB buffer costs a page fault per 4 KiB page when the socket first writes it,
which at 16-64 MiB bodies is a large part of a request, so large buffers are kept and taken
again. Kept buffers are anonymous memory maps of their own (not the allocator's heap): one
that is dropped goes back to the operating system at once, and a burst's buffers are
dropped once no body has been taken for ``linger`` seconds, so a server's (or a client's)
memory after a burst returns to what it was before.

A client that must not pay those faults on its first large answer (an inference server's
first cache hit after it started) reserves warm buffers up front (:meth:`BodyBuffers.reserve`):
faulted in once, in a worker thread, and kept through idle periods. On the benchmark VM a
fresh 16 MiB buffer took 15-60 ms to fault in, against about 1 ms to copy 16 MiB into memory
already mapped.
"""

from __future__ import annotations

import asyncio
import mmap
import sys

import numpy as np
import numpy.typing as npt

from kvtier.tiers.dram_arena import fault_in

__all__ = ["REUSE_MIN", "BodyBuffers", "new_buffer"]

# Bodies at least this large go into reusable, separately mapped buffers; smaller ones are
# cheap to allocate (and too small for a mapping of their own to pay).
REUSE_MIN = 256 << 10
Buffer = npt.NDArray[np.uint8]


def new_buffer(length: int) -> Buffer:
    """``length`` writable bytes (contents undefined, no zero-fill pass). From
    :data:`REUSE_MIN` on, an anonymous mapping of their own, unmapped (returned to the
    operating system) as soon as nothing references them; a heap block of that size could
    stay with the process after a burst."""
    if length < REUSE_MIN:
        return np.empty(length, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, length), dtype=np.uint8)


def _refs(held: list[Buffer], i: int) -> int:
    return sys.getrefcount(held[i])


def _free_fit(held: list[Buffer], length: int) -> int:
    """Index of the smallest buffer of ``held`` that fits ``length`` bytes and nothing else
    references, or -1."""
    best = -1
    for i in range(len(held)):
        size = held[i].nbytes
        if size >= length and _refs(held, i) == _ALONE \
                and (best < 0 or size < held[best].nbytes):
            best = i
    return best


def _warm_buffers(length: int, count: int, into: list[Buffer]) -> None:
    for _ in range(count):
        buf = new_buffer(length)
        fault_in(buf)
        into.append(buf)


# What _refs() reports for a buffer only ``held`` references, measured rather than assumed
# (interpreters differ in the temporary references they count).
_ALONE = _refs([np.empty(1, dtype=np.uint8)], 0)


class BodyBuffers:
    """Body buffers, reused once nothing references them any more.

    Every body (and every array decoded from it) is a view of its buffer, and any live view
    keeps a reference to it, so a buffer whose only reference is this pool's list is provably
    unused: a caller's array never changes under it. At most ``budget`` bytes are held (the
    oldest go first), and none once no buffer has been taken for ``linger`` seconds.

    Parameters
    ----------
    budget
        Most bytes of buffers held for reuse.
    linger
        Seconds after the last :meth:`take` before the held buffers are dropped.
    """

    def __init__(self, budget: int, linger: float = 5.0) -> None:
        self.budget = budget
        self.linger = linger
        self.reused = 0
        self._held: list[Buffer] = []
        self._warm: list[Buffer] = []  # reserved: outside the budget, never trimmed
        self._last_take = 0.0
        self._trim: asyncio.TimerHandle | None = None

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers held for reuse (some may be in use by their last taker), the
        reserved ones excluded."""
        return sum(b.nbytes for b in self._held)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of warm buffers kept by :meth:`reserve`."""
        return sum(b.nbytes for b in self._warm)

    async def reserve(self, length: int, count: int = 1) -> None:
        """Fault in ``count`` buffers of ``length`` bytes now (in a worker thread, off the
        loop) and keep them for good: a later :meth:`take` of up to ``length`` bytes gets
        warm memory even after an idle period. They are not counted in ``budget``."""
        if length < REUSE_MIN or count < 1:
            return
        made: list[Buffer] = []
        await asyncio.to_thread(_warm_buffers, length, count, made)
        # Only the pool may reference them: a buffer referenced elsewhere counts as in use.
        self._warm += made
        made.clear()

    def take(self, length: int) -> memoryview:
        """A writable buffer of exactly ``length`` bytes (contents undefined)."""
        if length < REUSE_MIN:
            return new_buffer(length).data.cast("B")
        warm = _free_fit(self._warm, length)
        if warm >= 0:
            self.reused += 1
            return self._warm[warm].data.cast("B")[:length]
        best = _free_fit(self._held, length)
        if best >= 0:
            self.reused += 1
            buf = self._held.pop(best)
        else:
            buf = new_buffer(length)
        self._held.append(buf)
        while self.held_bytes > self.budget:
            self._held.pop(0)
        self._arm_trim()
        return buf.data.cast("B")[:length]

    def _arm_trim(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_take = loop.time()
        if self._trim is None:
            self._trim = loop.call_later(self.linger, self._trim_idle)

    def _trim_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last_take
        if idle < self.linger:
            self._trim = loop.call_later(self.linger - idle, self._trim_idle)
            return
        self._trim = None
        self.clear()

    def clear(self) -> None:
        """Drop every held buffer, the reserved ones kept (one still in use is freed when its
        taker drops it)."""
        self._held.clear()
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
