"""A pure byte-budget recency (LRU) policy: no I/O, no locks, injected clock.

Every tier with a byte budget keeps one :class:`RecencyPolicy` beside its storage. The tier
asks :meth:`RecencyPolicy.victims` which blocks to evict before admitting a new one, hands
each victim to its demotion callback, and only then calls :meth:`RecencyPolicy.remove`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvtier.errors import BlockTooLargeError, TierFullError

__all__ = ["Clock", "RecencyPolicy"]

Clock = Callable[[], float]


class RecencyPolicy:
    """Least-recently-used order over keys with sizes, a byte budget and pins.

    Parameters
    ----------
    capacity
        Byte budget, or ``None`` for unbounded (never evicts).
    clock
        Returns the current time in seconds; injected so tests control it.
    """

    def __init__(self, capacity: int | None, clock: Clock = time.monotonic) -> None:
        if capacity is not None and (type(capacity) is not int or capacity < 0):
            raise ValueError(f"capacity: expected an int >= 0 or None, got {capacity!r}")
        self._capacity = capacity
        self._clock = clock
        # key -> (size, last access); order is LRU first, MRU last.
        self._entries: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self._used = 0

    @property
    def capacity(self) -> int | None:
        """Byte budget, or ``None`` when unbounded."""
        return self._capacity

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

    def touch_chain(self, keys: Iterable[bytes]) -> None:
        """Refresh a prefix chain from its tail to its head, so the head is the most recent
        and eviction takes the end of a chain before its start."""
        for key in reversed(list(keys)):
            self.touch(key)

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; returns its size or ``None`` if absent. Pins are kept."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._used -= entry[0]
        return entry[0]

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
        return sum(e[0] for k, e in self._entries.items() if k in self._pins)

    def check_fits(self, size: int, name: str = "block") -> None:
        """Raise :class:`BlockTooLargeError` if ``size`` exceeds the whole budget."""
        if self._capacity is not None and size > self._capacity:
            raise BlockTooLargeError(
                f"{name}: {size} bytes exceed the tier's whole capacity of {self._capacity} bytes")

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
        raise TierFullError(
            f"cannot fit {incoming} bytes: {self.pinned_bytes} of {self._capacity} bytes pinned")
