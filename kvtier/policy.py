"""A pure byte-budget recency (LRU) policy: no I/O, no locks, injected clock.

Every tier with a byte budget keeps one :class:`RecencyPolicy` beside its storage. The tier
asks :meth:`RecencyPolicy.victims` which blocks to evict before admitting a new one, hands
each victim to its demotion callback, and only then calls :meth:`RecencyPolicy.remove`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvtier.errors import BlockTooLargeError, TierFullError

__all__ = ["ARCPolicy", "Clock", "RecencyPolicy", "S3FIFOPolicy"]

Clock = Callable[[], float]


class _PinsAndBudget(ABC):
    """What every policy here shares: the validated byte budget, counted pins, the budget
    check and tail-first chain touches. Subclasses keep the order and the sizes."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and (type(capacity) is not int or capacity < 0):
            raise ValueError(f"capacity: expected an int >= 0 or None, got {capacity!r}")
        self._capacity = capacity
        self._pins: dict[bytes, int] = {}

    @abstractmethod
    def touch(self, key: bytes) -> bool:
        """Record an access of ``key``. Returns ``False`` if absent."""

    @abstractmethod
    def _present(self) -> Iterable[tuple[bytes, int]]:
        """(key, size) of every present block that :meth:`victims` may still choose."""

    @property
    def capacity(self) -> int | None:
        """Byte budget, or ``None`` when unbounded."""
        return self._capacity

    def touch_chain(self, keys: Iterable[bytes]) -> None:
        """Touch a prefix chain from its tail to its head, so the head counts as the most
        recent and eviction takes the end of a chain before its start."""
        for key in reversed(list(keys)):
            self.touch(key)

    def pin(self, key: bytes) -> None:
        """Protect ``key`` from eviction (counted: each pin needs one unpin)."""
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        """Release one pin of ``key``; unpinning an unpinned key does nothing."""
        count = self._pins.get(key, 0)
        if count <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count - 1

    def is_pinned(self, key: bytes) -> bool:
        """Whether ``key`` holds at least one pin."""
        return key in self._pins

    @property
    def pinned_bytes(self) -> int:
        """Bytes of present blocks that are pinned."""
        return sum(size for key, size in self._present() if key in self._pins)

    def check_fits(self, size: int, name: str = "block") -> None:
        """Raise :class:`BlockTooLargeError` if ``size`` exceeds the whole budget."""
        if self._capacity is not None and size > self._capacity:
            raise BlockTooLargeError(
                f"{name}: {size} bytes exceed the tier's whole capacity of {self._capacity} bytes")

    def _full(self, incoming: int) -> TierFullError:
        return TierFullError(
            f"cannot fit {incoming} bytes: {self.pinned_bytes} of {self._capacity} bytes pinned")


class RecencyPolicy(_PinsAndBudget):
    """Least-recently-used order over keys with sizes, a byte budget and pins.

    Parameters
    ----------
    capacity
        Byte budget, or ``None`` for unbounded (never evicts).
    clock
        Returns the current time in seconds; injected so tests control it.
    """

    def __init__(self, capacity: int | None, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity)
        self._clock = clock
        # key -> (size, last access); order is LRU first, MRU last.
        self._entries: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._used = 0

    @property
    def used(self) -> int:
        """Bytes currently accounted."""
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        # Membership never refreshes recency.
        return key in self._entries

    def size_of(self, key: bytes) -> int | None:
        """Size of ``key`` in bytes, or ``None`` if absent (no recency refresh)."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def last_access(self, key: bytes) -> float | None:
        """Clock time of the last admit/touch of ``key``, or ``None`` if absent."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def lru_order(self) -> Iterator[bytes]:
        """Iterate keys from least to most recently used."""
        return iter(list(self._entries))

    def admit(self, key: bytes, size: int, *, last_access: float | None = None) -> None:
        """Insert or replace ``key`` as most recently used. Does not evict: call
        :meth:`victims` first and remove them.

        ``last_access`` restores a saved timestamp (warm restart); restore entries in
        increasing ``last_access`` order so recency order matches the timestamps."""
        if size < 0:
            raise ValueError(f"size: expected >= 0, got {size}")
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= old[0]
        self._entries[key] = (size, self._clock() if last_access is None else last_access)
        self._used += size

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` most recently used. Returns ``False`` if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._entries[key] = (entry[0], self._clock())
        self._entries.move_to_end(key)
        return True

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; returns its size or ``None`` if absent. Pins are kept."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._used -= entry[0]
        return entry[0]

    def _present(self) -> Iterable[tuple[bytes, int]]:
        return ((key, entry[0]) for key, entry in self._entries.items())

    def victims(self, incoming: int, replacing: bytes | None = None) -> list[bytes]:
        """Keys to evict, least recent first, so that ``incoming`` more bytes fit.

        Parameters
        ----------
        incoming
            Size of the block about to be admitted.
        replacing
            Key the incoming block overwrites (its old size is freed, and it is never a
            victim).

        Raises
        ------
        BlockTooLargeError
            If ``incoming`` exceeds the whole capacity.
        TierFullError
            If pinned blocks leave no room.
        """
        self.check_fits(incoming)
        if self._capacity is None:
            return []
        freed = (self.size_of(replacing) or 0) if replacing is not None else 0
        excess = self._used - freed + incoming - self._capacity
        chosen: list[bytes] = []
        if excess <= 0:
            return chosen
        for key, (size, _) in self._entries.items():
            if key == replacing or key in self._pins:
                continue
            chosen.append(key)
            excess -= size
            if excess <= 0:
                return chosen
        raise self._full(incoming)


class S3FIFOPolicy(_PinsAndBudget):
    """S3-FIFO (Yang et al., SOSP '23): a scan-resistant alternative to LRU, same interface as
    :class:`RecencyPolicy` (byte budget, pins, ``victims`` then ``remove``).

    New keys enter a small FIFO (``small_fraction`` of the budget). A key evicted from it
    that was touched at least ``promote_after`` times since admission moves to the main FIFO;
    others leave and are remembered in a ghost list, so a key that returns soon after goes
    straight to main. The main FIFO gives each key up to 3 second chances (one per touch).
    One-hit blocks (a long prompt read once) therefore never flush the blocks that are
    reused, which is where a plain LRU thrashes when the working set exceeds the budget.
    A touch is a counter increment: no reordering.

    Parameters
    ----------
    capacity
        Byte budget, or ``None`` for unbounded (never evicts).
    clock
        Accepted for interface parity with :class:`RecencyPolicy`; S3-FIFO keeps no times.
    small_fraction
        Share of the budget for the probationary FIFO (0 < f < 1).
    promote_after
        Touches needed in the small FIFO to move to main.
    """

    def __init__(self, capacity: int | None, clock: Clock = time.monotonic, *,
                 small_fraction: float = 0.1, promote_after: int = 1) -> None:
        super().__init__(capacity)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction: expected 0 < f < 1, got {small_fraction!r}")
        if type(promote_after) is not int or promote_after < 1:
            raise ValueError(f"promote_after: expected an int >= 1, got {promote_after!r}")
        self._small_target = 0 if capacity is None else max(1, int(capacity * small_fraction))
        self._promote_after = promote_after
        self._sizes: dict[bytes, int] = {}
        self._freq: dict[bytes, int] = {}
        self._small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._pending: set[bytes] = set()  # chosen by victims(), awaiting remove()
        self._used = 0
        self._small_used = 0

    @property
    def used(self) -> int:
        """Bytes currently accounted."""
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def size_of(self, key: bytes) -> int | None:
        """Size of ``key`` in bytes, or ``None`` if absent."""
        return self._sizes.get(key)

    def lru_order(self) -> Iterator[bytes]:
        """Keys in eviction-candidate order: small FIFO first, then main FIFO."""
        return iter([*self._small, *self._main])

    def admit(self, key: bytes, size: int) -> None:
        """Insert ``key`` (into main if it is a recent ghost, else small), or replace its size.
        Does not evict: call :meth:`victims` first and remove them."""
        if size < 0:
            raise ValueError(f"size: expected >= 0, got {size}")
        old = self._sizes.get(key)
        if old is not None:
            self._used += size - old
            if key in self._small:
                self._small_used += size - old
            self._sizes[key] = size
            return
        self._sizes[key] = size
        self._freq[key] = 0
        self._used += size
        if self._ghost.pop(key, 0) is None:
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_used += size

    def touch(self, key: bytes) -> bool:
        """Count an access of ``key`` (capped at 3). Returns ``False`` if absent."""
        freq = self._freq.get(key)
        if freq is None:
            return False
        if freq < 3:
            self._freq[key] = freq + 1
        return True

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; returns its size or ``None`` if absent. Pins are kept."""
        size = self._sizes.pop(key, None)
        if size is None:
            return None
        del self._freq[key]
        self._used -= size
        self._pending.discard(key)
        self._main.pop(key, 0)
        if self._small.pop(key, 0) is None:
            self._small_used -= size
        return size

    def _present(self) -> Iterable[tuple[bytes, int]]:
        return self._sizes.items()

    def _remember_ghost(self, key: bytes) -> None:
        self._ghost[key] = None
        # The ghost list remembers about as many keys as the cache holds.
        while len(self._ghost) > max(1, len(self._sizes)):
            self._ghost.popitem(last=False)

    def victims(self, incoming: int, replacing: bytes | None = None) -> list[bytes]:
        """Keys to evict so that ``incoming`` more bytes fit (queue moves happen here).

        Raises
        ------
        BlockTooLargeError
            If ``incoming`` exceeds the whole capacity.
        TierFullError
            If pinned blocks leave no room.
        """
        self.check_fits(incoming)
        if self._capacity is None:
            return []
        freed = (self.size_of(replacing) or 0) if replacing is not None else 0
        excess = self._used - freed + incoming - self._capacity
        excess -= sum(self._sizes[k] for k in self._pending)
        chosen: list[bytes] = []
        # Each key is looked at a bounded number of times (3 chances in main, one move out
        # of small, one pass over pinned keys) so the loop ends even when all are pinned.
        budget = 5 * (len(self._small) + len(self._main)) + 1
        held_in_small = 0  # pinned (or replaced) keys rotated in small since one left it
        while excess > 0 and budget > 0:
            budget -= 1
            # Once a whole pass over small found only keys it must keep, main gives instead.
            from_small = (bool(self._small) and held_in_small < len(self._small)
                          and (self._small_used > self._small_target or not self._main))
            queue = self._small if from_small else self._main
            if not queue:
                break
            key, _ = queue.popitem(last=False)
            size = self._sizes[key]
            if from_small:
                self._small_used -= size
            if key == replacing or key in self._pins:
                queue[key] = None
                if from_small:
                    self._small_used += size
                    held_in_small += 1
                continue
            if from_small:
                held_in_small = 0
            freq = self._freq[key]
            if from_small and freq >= self._promote_after:
                self._freq[key] = 0
                self._main[key] = None
                continue
            if not from_small and freq > 0:
                self._freq[key] = freq - 1
                self._main[key] = None
                continue
            if from_small:
                self._remember_ghost(key)
            self._pending.add(key)
            chosen.append(key)
            excess -= size
        if excess > 0:
            for key in chosen:  # put them back: nothing changes on failure
                self._pending.discard(key)
                self._main[key] = None
            raise self._full(incoming)
        return chosen


class ARCPolicy(_PinsAndBudget):
    """Adaptive replacement (Megiddo and Modha, FAST '03) over a byte budget, with the
    interface of :class:`RecencyPolicy` (``victims`` then ``remove``, pins).

    Keys seen once live in a recency list T1, keys seen again in a frequency list T2, both
    in LRU order. Evicted keys are remembered (B1, B2 ghosts); a miss on a ghost moves the
    T1 target size toward the list that would have kept it. So the policy behaves like LRU
    when reuse is recent (a conversation's next turn) and protects the reused blocks (shared
    system prompts, an agent's context) when one-pass traffic would flush an LRU. Touching a
    prefix chain tail-first keeps the head most recent in T2, so chains lose tails first.

    Parameters
    ----------
    capacity
        Byte budget, or ``None`` for unbounded (never evicts).
    clock
        Accepted for interface parity with :class:`RecencyPolicy`; ARC keeps no times.
    """

    def __init__(self, capacity: int | None, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[bytes, int] = OrderedDict()  # key -> size, LRU first
        self._t2: OrderedDict[bytes, int] = OrderedDict()
        self._b1: OrderedDict[bytes, int] = OrderedDict()
        self._b2: OrderedDict[bytes, int] = OrderedDict()
        self._t1_used = self._t2_used = self._b1_used = self._b2_used = 0
        self._target = 0.0  # bytes T1 should hold
        self._pending: dict[bytes, int] = {}  # chosen by victims(), awaiting remove()

    @property
    def used(self) -> int:
        """Bytes currently accounted."""
        return self._t1_used + self._t2_used + sum(self._pending.values())

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._pending

    def size_of(self, key: bytes) -> int | None:
        """Size of ``key`` in bytes, or ``None`` if absent."""
        for table in (self._t1, self._t2, self._pending):
            if key in table:
                return table[key]
        return None

    def lru_order(self) -> Iterator[bytes]:
        """Keys in eviction-candidate order: T1 then T2, least recent first."""
        return iter([*self._t1, *self._t2])

    def admit(self, key: bytes, size: int) -> None:
        """Insert ``key`` (into T2 if it is a ghost, adapting the target; else T1), or
        replace its size. Does not evict: call :meth:`victims` first and remove them."""
        if size < 0:
            raise ValueError(f"size: expected >= 0, got {size}")
        if key in self:
            self.remove(key)
            self._t2[key] = size
            self._t2_used += size
            return
        cap = self._capacity or 0
        if key in self._b1:
            delta = max(1.0, self._b2_used / max(self._b1_used, 1)) * max(size, 1)
            self._target = min(float(cap), self._target + delta)
            self._b1_used -= self._b1.pop(key)
            self._t2[key] = size
            self._t2_used += size
        elif key in self._b2:
            delta = max(1.0, self._b1_used / max(self._b2_used, 1)) * max(size, 1)
            self._target = max(0.0, self._target - delta)
            self._b2_used -= self._b2.pop(key)
            self._t2[key] = size
            self._t2_used += size
        else:
            self._t1[key] = size
            self._t1_used += size
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        cap = self._capacity
        if cap is None:
            self._b1.clear()
            self._b2.clear()
            self._b1_used = self._b2_used = 0
            return
        # ARC's invariants: |T1| + |B1| <= c and the whole directory <= 2c.
        while self._b1 and self._t1_used + self._b1_used > cap:
            self._b1_used -= self._b1.popitem(last=False)[1]
        while self._b2 and self.used + self._b1_used + self._b2_used > 2 * cap:
            self._b2_used -= self._b2.popitem(last=False)[1]

    def touch(self, key: bytes) -> bool:
        """A hit: move ``key`` to the most recent end of T2. Returns ``False`` if absent."""
        size = self._t1.pop(key, None)
        if size is not None:
            self._t1_used -= size
            self._t2[key] = size
            self._t2_used += size
            return True
        if key in self._t2:
            self._t2.move_to_end(key)
            return True
        return key in self._pending

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; returns its size or ``None`` if absent. Pins are kept."""
        size = self._pending.pop(key, None)
        if size is not None:
            return size
        size = self._t1.pop(key, None)
        if size is not None:
            self._t1_used -= size
            return size
        size = self._t2.pop(key, None)
        if size is not None:
            self._t2_used -= size
        return size

    def _present(self) -> Iterable[tuple[bytes, int]]:
        return (*self._t1.items(), *self._t2.items())

    def _pop_lru(self, from_t1: bool, replacing: bytes | None) -> tuple[bytes, int] | None:
        table = self._t1 if from_t1 else self._t2
        for key, size in table.items():
            if key != replacing and key not in self._pins:
                del table[key]
                if from_t1:
                    self._t1_used -= size
                    self._b1[key] = size
                    self._b1_used += size
                else:
                    self._t2_used -= size
                    self._b2[key] = size
                    self._b2_used += size
                return key, size
        return None

    def victims(self, incoming: int, replacing: bytes | None = None) -> list[bytes]:
        """Keys to evict, so that ``incoming`` more bytes fit (ARC's REPLACE).

        Raises
        ------
        BlockTooLargeError
            If ``incoming`` exceeds the whole capacity.
        TierFullError
            If pinned blocks leave no room.
        """
        self.check_fits(incoming)
        if self._capacity is None:
            return []
        freed = (self.size_of(replacing) or 0) if replacing is not None else 0
        excess = self._t1_used + self._t2_used - freed + incoming - self._capacity
        chosen: list[tuple[bytes, int, bool]] = []
        while excess > 0:
            from_t1 = bool(self._t1) and (self._t1_used > self._target or not self._t2)
            got = self._pop_lru(from_t1, replacing) or self._pop_lru(not from_t1, replacing)
            if got is None:
                for key, size, was_t1 in chosen:  # put them back: nothing changes on failure
                    self._pending.pop(key, None)
                    self._unghost(key, size, was_t1)
                raise self._full(incoming)
            key, size = got
            chosen.append((key, size, key in self._b1))
            self._pending[key] = size
            excess -= size
        self._trim_ghosts()
        return [key for key, _, _ in chosen]

    def _unghost(self, key: bytes, size: int, was_t1: bool) -> None:
        ghosts, table = (self._b1, self._t1) if was_t1 else (self._b2, self._t2)
        if ghosts.pop(key, None) is not None:
            if was_t1:
                self._b1_used -= size
                self._t1_used += size
            else:
                self._b2_used -= size
                self._t2_used += size
            table[key] = size
            table.move_to_end(key, last=False)
