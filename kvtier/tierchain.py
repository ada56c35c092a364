"""The tier chain as every store part sees it: the tiers, what the store observed of each,
the few guarded calls all parts make (one tier write, one quiet delete, a chain touch,
deadlines), and the KV events of blocks entering and leaving tiers.

A :class:`TierChain` is built once by :class:`~kvtier.store.TieredStore` and handed to each
part (read path, placement, write-through, close flush); it owns no policy of its own.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Literal, TypeVar

from kvtier.deadline import Deadline
from kvtier.errors import BlockTooLargeError, ConfigError, TierFullError
from kvtier.event_order import OwedStored
from kvtier.events import RESYNC_KEYS, EventHub, Resident, medium_of
from kvtier.keys import validate_key
from kvtier.misses import MissLedger, MissReason
from kvtier.stats import StoreCounters, TierCounters
from kvtier.tiers.base import Block, Tier, run_to_end
from kvtier.warnsummary import WarningSummary

__all__ = ["NOT_HERE", "TierChain", "finish_even_if_cancelled", "keys_list", "log"]

# The store's logger for every store part (tests and users filter on this name).
log = logging.getLogger("kvtier.store")
T = TypeVar("T")
WriteKind = Literal["promote", "demote", "write_through", "pool", "close_flush"]

#: Raised by a tier when a block cannot go *there* (too big, everything pinned): the store
#: moves on to another tier without counting a tier error.
NOT_HERE = (BlockTooLargeError, TierFullError)


def check_timeout(value: object, name: str = "timeout") -> float | None:
    """Seconds as a positive float, ``None`` for no limit (``math.inf`` too)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected seconds as a number or None, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name}: expected > 0 seconds (math.inf: no limit), got {value!r}")
    return None if math.isinf(value) else float(value)


def check_positive_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 1 (not a bool); ``ConfigError`` (a ``ValueError``)
    otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def keys_list(keys: object, name: str = "keys") -> list[bytes]:
    """Validate a sequence of keys (the message names the bad one)."""
    if isinstance(keys, bytes | str) or not isinstance(keys, Iterable):
        raise TypeError(f"{name}: expected a sequence of bytes keys, got {type(keys).__name__}")
    return [validate_key(k, f"{name}[{i}]") for i, k in enumerate(keys)]


async def finish_even_if_cancelled(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion even if the caller is cancelled meanwhile.

    For multi-step changes (a delete over every tier, a put and its pool copy) whose partial
    effect could expose an older value: a cancellation waits for the steps already started
    to finish, then propagates. Cancelling costs at most the steps' own duration, which each
    tier bounds by its timeouts.
    """
    return await run_to_end(asyncio.get_running_loop().create_task(coro))


class TierChain:
    """The tiers (top first) with the store's per-tier counters and guarded calls.

    Parameters
    ----------
    tiers
        Tier objects, fastest first.
    counters
        The store-wide counters (shared with every part).
    events
        Where :meth:`stored` / :meth:`removed` go (``BlockStored`` / ``BlockRemoved``);
        default: a hub of its own (node ``"local"``).
    block_tokens
        Tokens per block, stamped on ``BlockStored`` (``None``: unknown).
    misses
        Where evictions and the tiers' miss reports are noted (default: a ledger of its
        own, :data:`~kvtier.misses.DEFAULT_MISS_RECORD_SIZE` keys per tier).

    Notes
    -----
    Every method runs on the store's event loop; none takes a lock. The guarded calls turn a
    tier's failure into a counted, logged error and a ``False``/``None`` result, never an
    exception, except for the caller's own cancellation. Without a subscriber the events
    cost one check each.
    """

    def __init__(self, tiers: list[Tier], counters: StoreCounters,
                 events: EventHub | None = None, block_tokens: int | None = None,
                 misses: MissLedger | None = None) -> None:
        self.tiers = tiers
        self.counters = counters
        self.tier_counters = [TierCounters() for _ in tiers]
        self.events = events if events is not None else EventHub(node="local")
        self.block_tokens = block_tokens
        self.mediums = [medium_of(t) for t in tiers]
        self.misses = misses if misses is not None else MissLedger(len(tiers))
        self._owed: list[OwedStored] = []  # batch writes in flight that owe BlockStored
        # One line per tier and operation per interval: a tier failing every block (an
        # unwritable directory) must not log a line per block.
        self.warnings = WarningSummary(log)
        for index, tier in enumerate(tiers):
            tier.on_drop = self._dropper(index, str(getattr(tier, "policy_name", "") or ""))
            tier.on_clear = self._clearer(index)
            tier.on_miss = self._misser(index)

    # ------------------------------------------------------------------ events
    def stored(self, index: int, keys: Sequence[bytes], parent: bytes | None = None) -> None:
        """``BlockStored``: tier ``index`` admitted ``keys`` (a chain run after ``parent``)."""
        self.events.stored(keys, tier=self.tiers[index].name, medium=self.mediums[index],
                           parent=parent, block_tokens=self.block_tokens)

    def stored_runs(self, where: Sequence[int | None], keys: Sequence[bytes],
                    parent: bytes | None = None) -> None:
        """One ``BlockStored`` per run of consecutive ``keys`` (a prefix chain after
        ``parent``) admitted by one tier; ``where[j]`` is the tier of ``keys[j]`` (``None``:
        not admitted anywhere). A run's parent is the key before it in the chain."""
        if not self.events.subscribers:
            return
        start = 0
        for j in range(1, len(keys) + 1):
            if j < len(keys) and where[j] == where[start]:
                continue
            index = where[start]
            if index is not None:
                self.stored(index, keys[start:j], keys[start - 1] if start else parent)
            start = j

    def removed(self, index: int, keys: Sequence[bytes]) -> None:
        """``BlockRemoved``: ``keys`` left tier ``index`` (after the ``BlockStored`` a batch
        write in flight still owed for any of them, see :mod:`kvtier.event_order`)."""
        for owed in self._owed:
            for run, parent in owed.take_removed(index, keys):
                self.stored(index, run, parent)
        self.events.removed(keys, tier=self.tiers[index].name, medium=self.mediums[index])

    def owe_batch(self, keys: Sequence[bytes], parent: bytes | None = None
                  ) -> OwedStored | None:
        """Start a batch write of the chain ``keys`` whose ``BlockStored`` it announces at
        its end (:meth:`announce`); ``None`` without a subscriber."""
        if not self.events.subscribers:
            return None
        owed = OwedStored(keys, parent)
        self._owed.append(owed)
        return owed

    def announce(self, owed: OwedStored | None) -> None:
        """End a batch write: ``BlockStored`` for what it wrote and has not announced, one
        per run of consecutive chain keys in one tier. Call it in ``finally``."""
        if owed is None:
            return
        self._owed.remove(owed)
        for index, keys, parent in owed.runs():
            self.stored(index, keys, parent)

    def _dropper(self, index: int, policy: str) -> Callable[[Sequence[bytes]], None]:
        def dropped(keys: Sequence[bytes]) -> None:
            self.misses.note_many(index, keys, MissReason.EVICTED, policy)
            self.removed(index, keys)
        return dropped

    def _clearer(self, index: int) -> Callable[[], None]:
        def cleared() -> None:
            self.events.cleared(tier=self.tiers[index].name, medium=self.mediums[index])
        return cleared

    def _misser(self, index: int) -> Callable[[Sequence[bytes], MissReason, str], None]:
        def missed(keys: Sequence[bytes], reason: MissReason, detail: str) -> None:
            self.misses.note_many(index, keys, reason, detail)
        return missed

    def resident(self) -> Resident:
        """What each tier that can list its keys holds now (a subscription's resync)."""
        out = []
        for index, tier in enumerate(self.tiers):
            keys = tier.resident_keys()
            if keys:
                out.append((tier.name, self.mediums[index], keys))
        return out

    async def aclose(self) -> None:
        """Close every tier (a failure is counted, not raised), each followed by
        ``BlockRemoved`` for what it held and its ``AllBlocksCleared``; then flush the
        rate-limited warnings."""
        for index, tier in enumerate(self.tiers):
            # Each block leaves by name before the tier's AllBlocksCleared: a router
            # that ignores AllBlocksCleared (llm-d-kv-cache#593) still ends up right.
            held = tier.resident_keys() if self.events.subscribers else None
            try:
                await tier.aclose()
            except Exception as exc:
                self.error(index, "aclose", exc)
            medium = self.mediums[index]
            for start in range(0, len(held or ()), RESYNC_KEYS):
                self.events.removed((held or [])[start:start + RESYNC_KEYS],
                                    tier=tier.name, medium=medium)
            self.events.cleared(tier=tier.name, medium=medium)
        self.warnings.flush()

    def __len__(self) -> int:
        return len(self.tiers)

    @staticmethod
    def deadline(seconds: float | None) -> float | None:
        """Loop time ``seconds`` from now (``None`` stays ``None``)."""
        return None if seconds is None else asyncio.get_running_loop().time() + seconds

    @staticmethod
    async def bounded(deadline: float | None, fn: Callable[..., Awaitable[T]], *args: Any,
                      what: str = "read") -> T:
        """Await ``fn(*args)`` within ``deadline`` (a :class:`~kvtier.deadline.Deadline`:
        the tier's worker-thread calls still queued at it are cancelled, the started ones
        that can still act waited for); ``TimeoutError`` if none is left, else the
        :class:`~kvtier.deadline.DeadlineExceeded` that says which calls it cancelled."""
        if deadline is None:
            return await fn(*args)
        if asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError
        async with Deadline.until(deadline, what):
            return await fn(*args)

    def error(self, index: int, op: str, exc: BaseException) -> None:
        """Count one tier failure and log it (rate-limited: see :class:`WarningSummary`)."""
        self.tier_counters[index].errors += 1
        self.warnings.warn(f"tier {self.tiers[index].name} ({index})", op,
                           f"{type(exc).__name__}: {exc}")

    async def write(self, index: int, key: bytes, block: Block, why: WriteKind) -> bool:
        """Put into one tier, counted by ``why``; ``False`` if it refused or failed."""
        try:
            await self.tiers[index]._put(key, block)  # keys and blocks reach here validated
        except NOT_HERE:
            return False
        except Exception as exc:
            self.error(index, why, exc)
            return False
        c = self.tier_counters[index]
        if why == "promote":
            c.promotions += 1
        elif why == "demote":
            c.demotions += 1
        c.bytes_in += block.nbytes
        self.stored(index, (key,))
        return True

    async def quiet_delete(self, index: int, keys: list[bytes]) -> bool:
        """Delete ``keys`` from one tier; ``False`` (counted) if the tier failed."""
        try:
            gone = await self.tiers[index]._delete_many(keys)
        except Exception as exc:
            self.error(index, "delete", exc)
            return False
        self.removed_where(index, keys, gone)
        return True

    def removed_where(self, index: int, keys: Sequence[bytes], gone: Sequence[bool]) -> None:
        """``BlockRemoved`` for the ``keys`` a delete in tier ``index`` found (``gone``)."""
        if self.events.subscribers:
            self.removed(index, [k for k, g in zip(keys, gone, strict=True) if g])

    async def touch(self, index: int, keys: list[bytes]) -> None:
        """Refresh a chain's recency in one tier, tail to head."""
        if not keys:
            return
        try:
            await self.tiers[index]._touch_chain(keys)
        except Exception as exc:
            self.error(index, "touch_chain", exc)
