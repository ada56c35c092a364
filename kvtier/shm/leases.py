"""The daemon's table of arena slots lent to engine processes.

A **read lease** holds the block an engine copies a hit from: the daemon's DRAM tier may
evict or overwrite the key meanwhile, but a slot of the arena is reused only once nothing
references its array (:mod:`kvtier.tiers.dram_arena`), and the lease is such a reference.
So the bytes under a valid lease are the block the lease was granted for; the engine copies,
then releases, and trusts the copy only if the release says the lease was still valid.

A **write lease** holds a fresh slot an engine copies a save into, until it commits (the
daemon puts the block, with no second copy) or aborts.

Leases end when released, when their process exits (the server watches each client's pidfd),
or at their time bound (``ttl``), whichever comes first. An expired read lease fails its
release (the engine's copy is a miss: the slot may have been reused while it read).

Write order: every write lease takes a sequence number, and a commit lands only if no
later-prepared write of its key (or a delete) has already landed, so a commit an engine gave
up on that arrives late never replaces a newer value.

Pure and synchronous (an injected clock, no I/O): the server calls it from its loop.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Lease", "LeaseTable"]


@dataclass(eq=False)
class Lease:
    """One slot lent to one process."""

    id: int
    pid: int
    write: bool
    key: bytes
    #: The block (read) or the raw slot (write): holding it keeps the slot out of reuse.
    held: npt.NDArray[Any]
    offset: int
    expires: float
    dtype: np.dtype[Any] = field(default_factory=lambda: np.dtype(np.uint8))
    shape: tuple[int, ...] = ()
    seq: int = 0


class LeaseTable:
    """Leases by id and by process.

    Parameters
    ----------
    ttl
        Seconds a lease lives at most.
    clock
        Monotonic time source (``time.monotonic`` is one clock for every process of the host,
        so deadlines engines send compare with it).
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._by_pid: dict[int, set[int]] = {}
        self._next = 1
        self._seq = 0
        self._pending: Counter[bytes] = Counter()  # write leases out, per key
        self._landed: dict[bytes, int] = {}  # newest landed seq of keys with writes out
        # Running totals (the daemon's /metrics counters): leases granted (read, write),
        # read leases released while valid, leases past their time bound, leases of
        # processes that exited.
        self.granted_reads = 0
        self.granted_writes = 0
        self.released = 0
        self.expired = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._leases)

    def counts(self) -> dict[str, int]:
        """Levels: ``leases`` (read), ``prepared`` (write), ``clients`` (processes holding
        any), ``leased_bytes`` and ``prepared_bytes`` (arena bytes under each)."""
        writes = [lease.held.nbytes for lease in self._leases.values() if lease.write]
        held = sum(lease.held.nbytes for lease in self._leases.values())
        return {"leases": len(self._leases) - len(writes), "prepared": len(writes),
                "clients": len(self._by_pid), "leased_bytes": held - sum(writes),
                "prepared_bytes": sum(writes)}

    def _add(self, lease: Lease) -> Lease:
        self._leases[lease.id] = lease
        self._by_pid.setdefault(lease.pid, set()).add(lease.id)
        return lease

    def _take_id(self) -> int:
        lease_id, self._next = self._next, self._next + 1
        return lease_id

    def grant_read(self, pid: int, key: bytes, block: npt.NDArray[Any], offset: int) -> Lease:
        """Lend ``block`` (at ``offset`` in the arena) to ``pid``."""
        self.granted_reads += 1
        return self._add(Lease(self._take_id(), pid, False, key, block, offset,
                               self._clock() + self.ttl, block.dtype, block.shape))

    def grant_write(self, pid: int, key: bytes, raw: npt.NDArray[np.uint8], offset: int,
                    dtype: np.dtype[Any], shape: tuple[int, ...]) -> Lease:
        """Lend the fresh slot ``raw`` to ``pid`` for a save of ``key``."""
        self._seq += 1
        self._pending[key] += 1
        self.granted_writes += 1
        return self._add(Lease(self._take_id(), pid, True, key, raw, offset,
                               self._clock() + self.ttl, dtype, shape, self._seq))

    def _pop(self, lease_id: int) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        ids = self._by_pid.get(lease.pid)
        if ids is not None:
            ids.discard(lease_id)
            if not ids:
                del self._by_pid[lease.pid]
        if lease.write:
            self._pending[lease.key] -= 1
            if self._pending[lease.key] <= 0:
                del self._pending[lease.key]
                self._landed.pop(lease.key, None)  # any later write takes a larger seq
        return lease

    def _live(self, pid: int, lease_id: int, write: bool) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.pid != pid or lease.write != write:
            return None
        if lease.expires < self._clock():
            self._pop(lease_id)
            self.expired += 1
            return None
        return lease

    def release(self, pid: int, ids: Iterable[int]) -> list[bool]:
        """End ``pid``'s read leases ``ids``; whether each was still valid (an unknown,
        foreign or expired one is not)."""
        valid = []
        for lease_id in ids:
            lease = self._live(pid, lease_id, write=False)
            if lease is not None:
                self._pop(lease_id)
                self.released += 1
            valid.append(lease is not None)
        return valid

    def take_writes(self, pid: int, ids: Iterable[int]) -> list[Lease | None]:
        """End ``pid``'s write leases ``ids`` for a commit or an abort: each lease, or
        ``None`` where it was unknown, foreign or expired. Pass each lease taken to
        :meth:`lands` (a commit) or :meth:`abandon` (an abort)."""
        taken: list[Lease | None] = []
        for lease_id in ids:
            lease = self._live(pid, lease_id, write=True)
            taken.append(lease if lease is None else self._pop_write(lease))
        return taken

    def _pop_write(self, lease: Lease) -> Lease:
        # The landed mark outlives the pop only while other writes of the key are out.
        self._leases.pop(lease.id)
        ids = self._by_pid.get(lease.pid)
        if ids is not None:
            ids.discard(lease.id)
            if not ids:
                del self._by_pid[lease.pid]
        self._pending[lease.key] -= 1
        return lease

    def lands(self, lease: Lease) -> bool:
        """Whether a taken write lease's commit lands (no newer write or delete of its key
        landed first); records it as landed when it does. Call once per taken lease."""
        newer = self._landed.get(lease.key, 0) > lease.seq
        if not newer:
            self._landed[lease.key] = lease.seq
        self._forget_if_done(lease.key)
        return not newer

    def abandon(self, lease: Lease) -> None:
        """A taken write lease that will not be committed (an abort)."""
        self._forget_if_done(lease.key)

    def note_delete(self, key: bytes) -> None:
        """A delete of ``key`` landed: writes prepared before it never land after it."""
        if self._pending.get(key, 0) > 0:
            self._seq += 1
            self._landed[key] = self._seq

    def _forget_if_done(self, key: bytes) -> None:
        if self._pending.get(key, 0) <= 0:
            self._pending.pop(key, None)
            self._landed.pop(key, None)

    def drop_pid(self, pid: int) -> int:
        """End every lease of ``pid`` (its process exited); how many."""
        ids = list(self._by_pid.get(pid, ()))
        for lease_id in ids:
            self._pop(lease_id)
        self.dropped += len(ids)
        return len(ids)

    def expire(self) -> float | None:
        """End every lease past its time bound; the next expiry (``None``: no lease)."""
        now = self._clock()
        for lease in [lease for lease in self._leases.values() if lease.expires < now]:
            self._pop(lease.id)
            self.expired += 1
        return min((lease.expires for lease in self._leases.values()), default=None)
