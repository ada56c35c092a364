"""Shared state and per-tier call helpers of :class:`~kvtier.store.TieredStore`.

``StoreCore`` declares what the store's constructor sets up and holds the helpers that more
than one group of operations uses (deadlines, tier error accounting, writing a block into
one tier, refreshing recency). The operations live in ``kvtier/store_read.py`` (get,
get_many, promotion), ``kvtier/store_lookup.py`` (get_into, presence, prefix lookup) and
``kvtier/store_write.py`` (put, delete, demotion, pins); ``kvtier/store.py`` combines them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar

from kvtier.errors import BlockTooLargeError, ClosedError, TierFullError
from kvtier.keys import validate_key
from kvtier.singleflight import KeyRegistry
from kvtier.stats import StoreCounters, TierCounters
from kvtier.tiers.base import Block, Tier
from kvtier.writethrough import WriteThrough

__all__ = ["Promote", "StoreCore", "WritePolicy"]

# The store's logger for every store module (tests and users filter on this name).
log = logging.getLogger("kvtier.store")
T = TypeVar("T")
Promote = Literal["all", "top"] | int
WritePolicy = Literal["write_back", "write_through"]

# Raised by a tier when a block cannot go *there* (too big, everything pinned): the store
# moves on to another tier without counting a tier error.
_NOT_HERE = (BlockTooLargeError, TierFullError)


def _check_timeout(value: object, name: str = "timeout") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected seconds as a number or None, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name}: expected > 0 seconds (math.inf: no limit), got {value!r}")
    return None if math.isinf(value) else float(value)


def _check_promote(value: object) -> Promote:
    if value in ("all", "top"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"promote: expected 'all', 'top' or an int >= 1 (hits before promoting), "
                     f"got {value!r}")


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _keys_list(keys: object, name: str = "keys") -> list[bytes]:
    if isinstance(keys, bytes | str) or not isinstance(keys, Iterable):
        raise TypeError(f"{name}: expected a sequence of bytes keys, got {type(keys).__name__}")
    return [validate_key(k, f"{name}[{i}]") for i, k in enumerate(keys)]


class StoreCore:
    """State and helpers shared by the store's read, lookup and write operations.

    The attributes are set by :meth:`kvtier.store.TieredStore.__init__`.
    """

    _tiers: list[Tier]
    _tier_counters: list[TierCounters]
    _counters: StoreCounters
    _keys: KeyRegistry
    _hit_counts: OrderedDict[bytes, int]
    _writes: WriteThrough
    _promote: Promote
    _timeout: float | None
    _write_policy: WritePolicy
    _counter_size: int
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store is closed")

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self._timeout if timeout is None else _check_timeout(timeout)
        return None if seconds is None else asyncio.get_running_loop().time() + seconds

    async def _bounded(self, deadline: float | None, fn: Callable[..., Awaitable[T]],
                       *args: Any) -> T:
        """Await ``fn(*args)`` within ``deadline``; TimeoutError if none is left."""
        if deadline is None:
            return await fn(*args)
        if asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError
        async with asyncio.timeout_at(deadline):
            return await fn(*args)

    def _tier_error(self, index: int, op: str, exc: BaseException) -> None:
        self._tier_counters[index].errors += 1
        log.warning("tier %s (%d) failed %s: %s: %s", self._tiers[index].name, index, op,
                    type(exc).__name__, exc)

    async def _write_into(self, index: int, key: bytes, block: Block, why: str) -> bool:
        """Put into one tier, counting it as a promotion/demotion; False if it refused."""
        try:
            await self._tiers[index].put(key, block)
        except _NOT_HERE:
            return False
        except Exception as exc:
            self._tier_error(index, why, exc)
            return False
        c = self._tier_counters[index]
        if why == "promote":
            c.promotions += 1
        elif why == "demote":
            c.demotions += 1
        c.bytes_in += block.nbytes
        return True

    async def _touch(self, index: int, keys: list[bytes]) -> None:
        if not keys:
            return
        try:
            await self._tiers[index].touch_chain(keys)
        except Exception as exc:
            self._tier_error(index, "touch_chain", exc)
