"""``TieredStore``: one async facade over a chain of tiers, fastest first.

Reads walk the chain top-down and promote hits upward; writes land in the top tier (and, with
``write_through``, in the background below it); a block a tier evicts by budget is demoted
into the next tier before that tier stops serving it. See ``docs/architecture.md``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Self, TypeVar

from kvtier.codec import as_block
from kvtier.errors import (
    BlockTooLargeError,
    ClosedError,
    ConfigError,
    TierError,
    TierFullError,
)
from kvtier.keys import validate_key
from kvtier.singleflight import Flight, KeyRegistry, KeyState, LeaderGone
from kvtier.stats import StoreCounters, TierCounters
from kvtier.tiers.base import Block, EvictionCallback, Tier, copy_into
from kvtier.tiers.registry import tier_from_url
from kvtier.writethrough import WriteThrough

__all__ = ["TieredStore", "open_store"]

log = logging.getLogger("kvtier.store")
T = TypeVar("T")
Promote = Literal["all", "top"] | int
WritePolicy = Literal["write_back", "write_through"]

# Raised by a tier when a block cannot go *there* (too big, everything pinned): the store
# moves on to another tier without counting a tier error.
_NOT_HERE = (BlockTooLargeError, TierFullError)
_STORE_OPTIONS = ("promote", "write_policy", "timeout", "write_queue_size", "write_workers",
                  "promote_counter_size")


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


class TieredStore:
    """A chain of tiers behind one async API (``get``/``put``/batch/prefix forms).

    Parameters
    ----------
    tiers
        Tier objects, fastest first. The store takes ownership: it sets each tier's
        ``on_evict`` (except the last tier's) to demote into the tiers below, and closes them
        in :meth:`aclose`.
    promote
        Where a hit in a lower tier is copied: ``"all"`` (every tier above it, the default),
        ``"top"`` (the top tier only) or an int ``N`` (into every tier above, once the key
        has hit ``N`` times below; counts are kept for at most ``promote_counter_size`` keys).
    write_policy
        ``"write_back"`` (lower tiers receive a block only when it is evicted above) or
        ``"write_through"`` (every put is also written to the lower tiers by background
        workers through a bounded queue; a full queue makes ``put`` wait).
    timeout
        Default deadline in seconds for read calls (``get``, ``get_many``, ``get_into``,
        ``get_many_into``, ``contains``, ``contains_many``, ``lookup_prefix``); ``None``: none.
        A tier that has not answered by the deadline counts as a miss.
    write_queue_size, write_workers
        Bound of the write-through queue and number of workers draining it.
    promote_counter_size
        Keys whose lower-tier hits are counted for ``promote=N``.

    Raises
    ------
    TypeError, ValueError
        For a malformed argument (the message names it).

    Examples
    --------
    >>> import numpy as np
    >>> from kvtier import DRAMTier, TieredStore
    >>> store = TieredStore([DRAMTier(capacity=1 << 30), DRAMTier(capacity=8 << 30)])
    >>> async def demo() -> None:
    ...     async with store:
    ...         await store.put(b"k" * 16, np.zeros(1024, np.uint16))
    ...         assert (await store.get(b"k" * 16)).shape == (1024,)
    >>> import asyncio; asyncio.run(demo())
    """

    def __init__(self, tiers: Sequence[Tier], *, promote: Promote = "all",
                 write_policy: WritePolicy = "write_back", timeout: float | None = None,
                 write_queue_size: int = 256, write_workers: int = 4,
                 promote_counter_size: int = 65536) -> None:
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence) or not tiers:
            raise TypeError("tiers: expected a non-empty sequence of Tier objects")
        for i, tier in enumerate(tiers):
            if not isinstance(tier, Tier):
                raise TypeError(f"tiers[{i}]: expected a Tier, got {type(tier).__name__}")
        if len({id(t) for t in tiers}) != len(tiers):
            raise ValueError("tiers: the same tier object appears twice")
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"write_policy: expected 'write_back' or 'write_through', "
                             f"got {write_policy!r}")
        self._promote = _check_promote(promote)
        self._timeout = _check_timeout(timeout)
        self._write_policy: WritePolicy = write_policy
        self._counter_size = _check_positive_int(promote_counter_size, "promote_counter_size")
        self._tiers: list[Tier] = list(tiers)
        self._tier_counters = [TierCounters() for _ in self._tiers]
        self._counters = StoreCounters()
        self._keys = KeyRegistry()
        self._hit_counts: OrderedDict[bytes, int] = OrderedDict()
        self._writes = WriteThrough(
            keys=self._keys, write=self._write_through, n_tiers=len(self._tiers),
            size=_check_positive_int(write_queue_size, "write_queue_size"),
            workers=_check_positive_int(write_workers, "write_workers"), counters=self._counters)
        self._closed = False
        for i, tier in enumerate(self._tiers[:-1]):
            tier.on_evict = self._demoter(i)

    # ------------------------------------------------------------------ properties
    @property
    def tiers(self) -> list[Tier]:
        """The tier objects, top (fastest) first."""
        return list(self._tiers)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._closed

    @property
    def write_policy(self) -> WritePolicy:
        """``"write_back"`` or ``"write_through"``."""
        return self._write_policy

    # ------------------------------------------------------------------ helpers
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

    def _first_fitting(self, nbytes: int, name: str) -> int:
        top = self._tiers[0].capacity
        if top is None or nbytes <= top:
            return 0
        for i, tier in enumerate(self._tiers):
            cap = tier.capacity
            if cap is None or nbytes <= cap:
                return i
        raise BlockTooLargeError(
            f"{name}: {nbytes} bytes exceed the capacity of every tier "
            f"(largest {max(t.capacity or 0 for t in self._tiers)} bytes)")

    # ------------------------------------------------------------------ get
    async def get(self, key: bytes, *, timeout: float | None = None) -> Block | None:  # noqa: ASYNC109
        """Return the block stored under ``key``, or ``None`` on a miss.

        Walks the tiers top-down; a hit below the top is promoted per the ``promote`` policy.
        Concurrent gets of one key that miss the top tier share one lower-tier fetch.

        Parameters
        ----------
        key
            ``bytes`` of 1..128 bytes.
        timeout
            Deadline in seconds for the whole call (default: the store's); ``math.inf``
            disables the store default for this call.

        Returns
        -------
        numpy.ndarray or None
            The block (possibly a read-only zero-copy view) or ``None``.
        """
        if self._closed:
            raise ClosedError("store is closed")
        validate_key(key)
        counters = self._counters
        counters.gets += 1
        if timeout is None and self._timeout is None:
            # Hot path (a top-tier hit without a deadline), inlined: every coroutine frame
            # and timeout context costs ~0.3-0.5 us against a ~1.5 us DRAM hit.
            deadline = None
            c = self._tier_counters[0]
            start = time.perf_counter_ns()
            try:
                block = await self._tiers[0]._get(key)  # key validated above
            except Exception as exc:
                self._tier_error(0, "get", exc)
                block = None
            else:
                c.get_latency.record(time.perf_counter_ns() - start)
                if block is not None:
                    c.hits += 1
                    c.bytes_out += block.nbytes
                    counters.hits += 1
                    return block
                c.misses += 1
        else:
            deadline = self._deadline(timeout)
            block = await self._tier_get(0, key, deadline)
        if block is None and len(self._tiers) > 1:
            block = await self._get_lower(key, deadline)
        if block is None:
            counters.misses += 1
        else:
            counters.hits += 1
        return block

    async def _tier_get(self, index: int, key: bytes, deadline: float | None) -> Block | None:
        """One tier's get with stats; errors and timeouts are misses."""
        tier = self._tiers[index]
        c = self._tier_counters[index]
        start = time.perf_counter_ns()
        try:  # keys reach here validated, so the tier's own check is skipped
            if deadline is None:
                block = await tier._get(key)
            else:
                block = await self._bounded(deadline, tier._get, key)
        except TimeoutError:
            c.timeouts += 1
            return None
        except Exception as exc:
            self._tier_error(index, "get", exc)
            return None
        c.get_latency.record(time.perf_counter_ns() - start)
        if block is None:
            c.misses += 1
        else:
            c.hits += 1
            c.bytes_out += block.nbytes
        return block

    async def _get_lower(self, key: bytes, deadline: float | None) -> Block | None:
        """Below the top tier, with single flight: one fetch per key at a time."""
        flight = self._keys.flight(key)
        if flight is not None:
            self._counters.single_flight_joins += 1
            return await self._join_flight(key, flight, deadline)
        flight = self._keys.lead(key)
        state = self._keys.watch(key)
        gen = state.gen
        try:
            block, index = await self._walk(key, 1, deadline)
            flight.set_result(block)
            if block is not None:
                await self._promote_one(key, block, index, state, gen)
            return block
        finally:
            self._keys.finish(key, flight)
            self._keys.unwatch(key, state)

    async def _join_flight(self, key: bytes, flight: Flight, deadline: float | None
                           ) -> Block | None:
        """Wait (no longer than ``deadline``) for another call's fetch of ``key``."""
        result = await KeyRegistry.join(flight, deadline)
        if isinstance(result, LeaderGone):
            return await self._get_lower(key, deadline)
        return result

    async def _walk(self, key: bytes, start: int, deadline: float | None
                    ) -> tuple[Block | None, int]:
        for index in range(start, len(self._tiers)):
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                break  # out of budget: the remaining tiers are misses, not timeouts
            block = await self._tier_get(index, key, deadline)
            if block is not None:
                return block, index
        return None, -1

    def _promotion_targets(self, key: bytes, found: int) -> range:
        """Tiers above ``found`` that a hit there should be copied into (may be empty)."""
        policy = self._promote
        if policy == "all":
            return range(found)
        if policy == "top":
            return range(1) if found > 0 else range(0)
        assert isinstance(policy, int)
        counts = self._hit_counts
        seen = counts.pop(key, 0) + 1
        if seen >= policy:
            return range(found)
        counts[key] = seen
        if len(counts) > self._counter_size:
            counts.popitem(last=False)
        return range(0)

    async def _promote_one(self, key: bytes, block: Block, found: int, state: KeyState,
                           gen: int) -> None:
        for index in self._promotion_targets(key, found):
            if state.gen != gen or self._closed:
                return  # put/deleted meanwhile: this value is stale
            await self._write_into(index, key, block, "promote")

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

    # ------------------------------------------------------------------ demotion
    def _demoter(self, index: int) -> EvictionCallback:
        async def demote(key: bytes, block: Block) -> None:
            # The evicting tier keeps the block readable until this returns.
            state = self._keys.state(key)
            if state is not None and state.deleting:
                return  # being deleted: moving it down would resurrect it
            for below in range(index + 1, len(self._tiers)):
                if await self._write_into(below, key, block, "demote"):
                    # A failed tier in between might still hold an older copy that would now
                    # shadow this one; drop it (best effort).
                    for skipped in range(index + 1, below):
                        await self._quiet_delete(skipped, key)
                    return
            self._counters.dropped += 1
            log.info("block %s left the pool: no tier below %s accepted it", key.hex(),
                     self._tiers[index].name)

        return demote

    async def _quiet_delete(self, index: int, key: bytes) -> bool:
        try:
            return await self._tiers[index].delete(key)
        except Exception as exc:
            self._tier_error(index, "delete", exc)
            return False

    # ------------------------------------------------------------------ put
    async def put(self, key: bytes, value: object) -> None:
        """Store ``value`` under ``key`` in the top tier that can hold it.

        The block goes into the first tier (top-down) whose capacity fits it; if that tier
        fails, the next one is tried. Older copies in tiers above the one that took it are
        deleted. With ``write_through`` the block is then queued for the tiers below (``put``
        waits while the queue is full).

        Parameters
        ----------
        key
            ``bytes`` of 1..128 bytes.
        value
            A C-contiguous numpy array of a fixed-size dtype, or a bytes-like object.

        Raises
        ------
        TypeError, ValueError
            For a bad key or value (nothing is written).
        BlockTooLargeError
            If the block exceeds every tier's capacity (nothing is written).
        TierError
            If every tier that could hold the block failed.
        """
        self._check_open()
        validate_key(key)
        block = as_block(value)
        first = self._first_fitting(block.nbytes, "value")
        self._counters.puts += 1
        self._keys.invalidate(key)
        placed = await self._place(key, block, first)
        if self._write_policy == "write_through":
            await self._writes.enqueue(key, block, placed + 1)

    async def _place(self, key: bytes, block: Block, first: int) -> int:
        """Put into the first tier from ``first`` that accepts; return its index."""
        failures: list[str] = []
        for index in range(first, len(self._tiers)):
            tier = self._tiers[index]
            try:
                await tier._put(key, block)  # validated once by the store
            except _NOT_HERE as exc:
                failures.append(f"{tier.name}: {exc}")
                continue
            except Exception as exc:
                self._tier_error(index, "put", exc)
                failures.append(f"{tier.name}: {type(exc).__name__}: {exc}")
                continue
            self._tier_counters[index].bytes_in += block.nbytes
            for above in range(index):
                # A copy above would shadow the new value.
                await self._quiet_delete(above, key)
            return index
        raise TierError(f"put {key.hex()}: no tier accepted the block ({'; '.join(failures)})")

    async def put_many(self, items: Iterable[tuple[bytes, object]]) -> None:
        """Store ``(key, value)`` pairs; all are validated before anything is written.

        Blocks that fit the top tier go there in one batch call, and the chain's recency is
        refreshed tail-to-head so eviction takes the end of a prefix chain first. A repeated
        key keeps its last value.

        Raises
        ------
        TypeError, ValueError, BlockTooLargeError
            For a bad item (nothing is written); the message names it (``items[i]``).
        TierError
            If every tier that could hold one of the blocks failed.
        """
        self._check_open()
        if isinstance(items, bytes | str | Mapping) or not isinstance(items, Iterable):
            raise TypeError(f"items: expected an iterable of (key, value) pairs, "
                            f"got {type(items).__name__}")
        # Only a repeated key's last value is observable, and writing just that one keeps
        # the order of puts into different tiers from mattering.
        last: dict[bytes, tuple[Block, int]] = {}
        count = 0
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"items[{i}]: expected a (key, value) tuple")
            key = validate_key(item[0], f"items[{i}] key")
            block = as_block(item[1], f"items[{i}] value")
            first = self._first_fitting(block.nbytes, f"items[{i}] value")
            last.pop(key, None)
            last[key] = (block, first)
            count += 1
        if not last:
            return
        self._counters.puts += count
        for key in last:
            self._keys.invalidate(key)
        top = [(k, b) for k, (b, first) in last.items() if first == 0]
        placed: dict[bytes, int] = {}
        if top:
            try:
                await self._tiers[0].put_many(top)
            except Exception as exc:
                if not isinstance(exc, _NOT_HERE):
                    self._tier_error(0, "put_many", exc)
            else:
                self._tier_counters[0].bytes_in += sum(b.nbytes for _, b in top)
                placed.update((k, 0) for k, _ in top)
                await self._touch(0, [k for k, _ in top])
        for key, (block, first) in last.items():
            if key not in placed:
                placed[key] = await self._place(key, block, first)
        if self._write_policy == "write_through":
            for key, (block, _) in last.items():
                await self._writes.enqueue(key, block, placed[key] + 1)

    async def _touch(self, index: int, keys: list[bytes]) -> None:
        if not keys:
            return
        try:
            await self._tiers[index].touch_chain(keys)
        except Exception as exc:
            self._tier_error(index, "touch_chain", exc)

    # ------------------------------------------------------------------ write-through
    async def _write_through(self, index: int, key: bytes, block: Block) -> bool:
        return await self._write_into(index, key, block, "write_through")

    async def flush(self) -> None:
        """Wait until every queued write-through write has been attempted."""
        await self._writes.flush()

    # ------------------------------------------------------------------ batch reads
    async def get_many(self, keys: Sequence[bytes], *, timeout: float | None = None  # noqa: ASYNC109
                       ) -> list[Block | None]:
        """Batch :meth:`get`: one batch call per tier for the keys still missing.

        Below the top tier, keys another call is already fetching are waited for instead of
        read again (single flight). Hits below the top are promoted, and every tier that
        served or received part of the chain has its recency refreshed tail-to-head (``keys``
        is taken as a prefix chain).

        Returns
        -------
        list
            Blocks or ``None``, in the order of ``keys``.
        """
        self._check_open()
        key_list = _keys_list(keys)
        deadline = self._deadline(timeout)
        results: list[Block | None] = [None] * len(key_list)
        held: list[list[int]] = [[] for _ in self._tiers]
        found_at: list[tuple[int, int]] = []  # (key index, tier index) of lower-tier hits
        missing = await self._read_batch(0, key_list, list(range(len(key_list))), results, held,
                                         found_at, deadline)
        if missing and len(self._tiers) > 1:
            await self._get_many_lower(key_list, missing, results, held, found_at, deadline)
        for index, idxs in enumerate(held):
            if idxs:
                await self._touch(index, [key_list[j] for j in sorted(set(idxs))])
        counters = self._counters
        misses = sum(1 for block in results if block is None)
        counters.gets += len(key_list)
        counters.misses += misses
        counters.hits += len(key_list) - misses
        return results

    async def _read_batch(self, index: int, keys: list[bytes], idxs: list[int],
                          results: list[Block | None], held: list[list[int]],
                          found_at: list[tuple[int, int]], deadline: float | None
                          ) -> list[int] | None:
        """One tier's batch get for ``keys[j] for j in idxs``; returns the indices still
        missing (all of them if the tier failed), or ``None`` when the deadline passed."""
        c = self._tier_counters[index]
        start = time.perf_counter_ns()
        try:
            blocks = await self._bounded(deadline, self._tiers[index].get_many,
                                         [keys[j] for j in idxs])
        except TimeoutError:
            c.timeouts += 1
            return None
        except Exception as exc:
            self._tier_error(index, "get_many", exc)
            return idxs
        c.get_latency.record(time.perf_counter_ns() - start)
        still: list[int] = []
        for j, block in zip(idxs, blocks, strict=True):
            if block is None:
                still.append(j)
                continue
            results[j] = block
            held[index].append(j)
            c.bytes_out += block.nbytes
            if index:
                found_at.append((j, index))
        c.hits += len(idxs) - len(still)
        c.misses += len(still)
        return still

    async def _get_many_lower(self, keys: list[bytes], missing: list[int],
                              results: list[Block | None], held: list[list[int]],
                              found_at: list[tuple[int, int]], deadline: float | None) -> None:
        """Below the top tier for a batch, with single flight per key: keys another call is
        already fetching are joined; this call leads (batch-fetches) the rest."""
        mine: dict[bytes, Flight] = {}
        lead: list[int] = []
        joined: list[tuple[int, Flight]] = []
        for j in missing:
            key = keys[j]
            flight = mine[key] if key in mine else self._keys.flight(key)
            if flight is not None:
                if key not in mine:
                    self._counters.single_flight_joins += 1
                joined.append((j, flight))
                continue
            mine[key] = self._keys.lead(key)
            lead.append(j)
        states: dict[bytes, tuple[KeyState, int]] = {}
        try:
            for j in lead:
                state = self._keys.watch(keys[j])
                states[keys[j]] = (state, state.gen)
            remaining: list[int] | None = lead
            for index in range(1, len(self._tiers)):
                if not remaining:
                    break
                remaining = await self._read_batch(index, keys, remaining, results, held,
                                                   found_at, deadline)
                if remaining is None:
                    break
            for j in lead:  # followers get their blocks before this call promotes
                if not mine[keys[j]].done():
                    mine[keys[j]].set_result(results[j])
            await self._promote_batch(keys, results, found_at, states, held)
        finally:
            for key, flight in mine.items():
                self._keys.finish(key, flight)
            for key, (state, _) in states.items():
                self._keys.unwatch(key, state)
        for j, flight in joined:
            results[j] = await self._join_flight(keys[j], flight, deadline)

    async def _promote_batch(self, keys: list[bytes], results: list[Block | None],
                             found_at: list[tuple[int, int]],
                             states: dict[bytes, tuple[KeyState, int]],
                             held: list[list[int]]) -> None:
        per_target: dict[int, list[int]] = {}
        for j, found in found_at:
            for target in self._promotion_targets(keys[j], found):
                per_target.setdefault(target, []).append(j)
        for target in sorted(per_target):
            fresh = [j for j in per_target[target]
                     if states[keys[j]][0].gen == states[keys[j]][1]]
            if not fresh or self._closed:
                continue
            items: list[tuple[bytes, Block]] = []
            for j in fresh:
                block = results[j]
                assert block is not None
                items.append((keys[j], block))
            try:
                await self._tiers[target].put_many(items)
            except Exception:
                # One refused block must not stop the others: fall back to one by one.
                for key, block in items:
                    await self._write_into(target, key, block, "promote")
            else:
                c = self._tier_counters[target]
                c.promotions += len(items)
                c.bytes_in += sum(b.nbytes for _, b in items)
            held[target].extend(fresh)

    async def get_into(self, key: bytes, out: Any, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Copy the block into caller-owned ``out``; ``False`` on a miss.

        Each tier's own ``get_into`` validates ``out`` (numpy, or device buffers where a tier
        supports them). A hit below the top that is due for promotion is read as a block,
        copied into ``out`` and promoted.

        Raises
        ------
        TypeError, ShapeMismatchError
            If ``out`` does not fit the block; ``out`` is then left untouched. (A tier's
            ``TypeError``/``ValueError`` here is taken as a complaint about ``out`` and
            propagates; other tier failures are misses.)
        """
        self._check_open()
        validate_key(key)
        deadline = self._deadline(timeout)
        self._counters.gets += 1
        hit = await self._get_into_walk(key, out, deadline)
        if hit:
            self._counters.hits += 1
        else:
            self._counters.misses += 1
        return hit

    async def _get_into_walk(self, key: bytes, out: Any, deadline: float | None) -> bool:
        state: KeyState | None = None
        gen = 0
        try:
            for index, tier in enumerate(self._tiers):
                c = self._tier_counters[index]
                promote = (index > 0 and self._promote in ("all", "top")) or (
                    isinstance(self._promote, int) and index > 0
                    and self._hit_counts.get(key, 0) + 1 >= self._promote)
                if index == 1:
                    state = self._keys.watch(key)
                    gen = state.gen
                start = time.perf_counter_ns()
                try:
                    if promote:
                        block = await self._bounded(deadline, tier.get, key)
                        hit = block is not None
                        if block is not None:
                            copy_into(block, out)
                    else:
                        block = None
                        hit = await self._bounded(deadline, tier.get_into, key, out)
                except (TypeError, ValueError):
                    raise  # a bad ``out`` is the caller's error (ShapeMismatchError too)
                except TimeoutError:
                    c.timeouts += 1
                    return False
                except Exception as exc:
                    self._tier_error(index, "get_into", exc)
                    continue
                c.get_latency.record(time.perf_counter_ns() - start)
                if not hit:
                    c.misses += 1
                    continue
                c.hits += 1
                if block is not None:
                    c.bytes_out += block.nbytes
                    assert state is not None
                    await self._promote_one(key, block, index, state, gen)
                elif index:
                    self._promotion_targets(key, index)  # counts the hit toward promote=N
                return True
            return False
        finally:
            if state is not None:
                self._keys.unwatch(key, state)

    async def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                            timeout: float | None = None) -> list[bool]:  # noqa: ASYNC109
        """Batch :meth:`get_into`; ``outs[i]`` receives ``keys[i]``.

        Raises
        ------
        ValueError
            If ``keys`` and ``outs`` differ in length.
        TypeError, ShapeMismatchError
            If an ``out`` does not fit its block (earlier buffers may have been written).
        """
        self._check_open()
        key_list = _keys_list(keys)
        if isinstance(outs, bytes | str) or not isinstance(outs, Sequence):
            raise TypeError(f"outs: expected a sequence of buffers, got {type(outs).__name__}")
        if len(outs) != len(key_list):
            raise ValueError(f"outs: expected {len(key_list)} buffers (one per key), "
                             f"got {len(outs)}")
        deadline = self._deadline(timeout)
        hits = [await self._get_into_walk(k, o, deadline) for k, o in zip(key_list, outs,
                                                                          strict=True)]
        c = self._counters
        c.gets += len(hits)
        c.hits += sum(hits)
        c.misses += len(hits) - sum(hits)
        await self._touch(0, [k for k, h in zip(key_list, hits, strict=True) if h])
        return hits

    # ------------------------------------------------------------------ presence
    async def contains(self, key: bytes, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Whether any tier holds ``key`` (refreshes no recency)."""
        self._check_open()
        validate_key(key)
        return (await self._contains_many([key], self._deadline(timeout)))[0]

    async def contains_many(self, keys: Sequence[bytes], *, timeout: float | None = None  # noqa: ASYNC109
                            ) -> list[bool]:
        """Batch :meth:`contains`: one batch call per tier for the keys not yet found."""
        self._check_open()
        return await self._contains_many(_keys_list(keys), self._deadline(timeout))

    async def lookup_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """How many leading ``keys`` (a prefix chain) are present in some tier.

        One ``contains_many`` per tier for the keys still unaccounted for, up to the first
        key no tier has. The found prefix's recency is then refreshed tail-to-head in every
        tier, so eviction takes chain ends first.
        """
        self._check_open()
        key_list = _keys_list(keys)
        present = await self._contains_many(key_list, self._deadline(timeout))
        hit = next((i for i, p in enumerate(present) if not p), len(present))
        if hit:
            for index in range(len(self._tiers)):
                await self._touch(index, key_list[:hit])
        return hit

    async def _contains_many(self, keys: list[bytes], deadline: float | None) -> list[bool]:
        present = [False] * len(keys)
        for index, tier in enumerate(self._tiers):
            todo = [j for j, p in enumerate(present) if not p]
            if not todo:
                break
            try:
                found = await self._bounded(deadline, tier.contains_many, [keys[j] for j in todo])
            except TimeoutError:
                self._tier_counters[index].timeouts += 1
                break
            except Exception as exc:
                self._tier_error(index, "contains_many", exc)
                continue
            for j, yes in zip(todo, found, strict=True):
                present[j] = present[j] or bool(yes)
        return present

    # ------------------------------------------------------------------ delete
    async def delete(self, key: bytes) -> bool:
        """Remove ``key`` from every tier; returns whether any tier held it.

        Tiers are cleared top-down, one after the other, so a block being demoted while the
        delete runs is removed from the tier it lands in too (never resurrected).
        """
        self._check_open()
        validate_key(key)
        return (await self._delete_keys([key]))[0]

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Batch :meth:`delete`; one batch call per tier."""
        self._check_open()
        return await self._delete_keys(_keys_list(keys))

    async def _delete_keys(self, keys: list[bytes]) -> list[bool]:
        self._counters.deletes += len(keys)
        # Sorted, so that two concurrent batch deletes take the per-key locks in one order.
        states = {k: self._keys.watch(k) for k in sorted(set(keys))}
        removed = [False] * len(keys)
        for key, state in states.items():
            self._keys.invalidate(key)
            state.deleting += 1
        try:
            # Wait out write-through writes of these keys already past their generation check.
            for state in states.values():
                await state.lock.acquire()
            try:
                for index, tier in enumerate(self._tiers):
                    try:
                        gone = await tier.delete_many(keys)
                    except Exception as exc:
                        self._tier_error(index, "delete_many", exc)
                        continue
                    removed = [a or bool(b) for a, b in zip(removed, gone, strict=True)]
            finally:
                for state in states.values():
                    state.lock.release()
        finally:
            for key, state in states.items():
                state.deleting -= 1
                self._hit_counts.pop(key, None)
                self._keys.unwatch(key, state)
        return removed

    # ------------------------------------------------------------------ pins
    async def pin(self, keys: Sequence[bytes], *, tier: int | None = None) -> None:
        """Keep ``keys`` from eviction until :meth:`unpin`.

        Parameters
        ----------
        keys
            Keys of a running session (they need not be present yet).
        tier
            Index of the one tier to pin in; ``None`` (default) pins in every tier, so a
            block stays in whichever tier holds it and is kept when promoted.
        """
        await self._pin_op("pin", keys, tier)

    async def unpin(self, keys: Sequence[bytes], *, tier: int | None = None) -> None:
        """Release one pin of each key (in the same tier(s) :meth:`pin` used)."""
        await self._pin_op("unpin", keys, tier)

    async def _pin_op(self, op: str, keys: Sequence[bytes], tier: int | None) -> None:
        self._check_open()
        key_list = _keys_list(keys)
        if tier is None:
            indexes = range(len(self._tiers))
        elif isinstance(tier, bool) or not isinstance(tier, int) or not (
                -len(self._tiers) <= tier < len(self._tiers)):
            raise ValueError(f"tier: expected None or a tier index < {len(self._tiers)}, "
                             f"got {tier!r}")
        else:
            indexes = range(tier % len(self._tiers), tier % len(self._tiers) + 1)
        for index in indexes:
            try:
                await getattr(self._tiers[index], op)(key_list)
            except Exception as exc:
                self._tier_error(index, op, exc)

    # ------------------------------------------------------------------ stats / lifecycle
    def stats(self) -> dict[str, Any]:
        """Per-tier and store-wide figures.

        Returns
        -------
        dict
            ``"tiers"``: one dict per tier (top first) merging the tier's own ``stats()``
            (``scheme``, ``name``, ``capacity``, ``used``, ``evictions``, ...) with what the
            store observed (``hits``, ``misses``, ``errors``, ``timeouts``, ``promotions``,
            ``demotions``, ``bytes_in``, ``bytes_out``, ``get_p50_us``, ``get_p99_us``; a
            tier's own figure with one of these names is kept as ``tier_<name>``);
            plus ``gets``, ``hits``, ``misses``, ``hit_rate``, ``puts``, ``deletes``,
            ``single_flight_joins``, ``dropped`` (evicted blocks no lower tier took),
            ``write_policy`` and ``write_queue_depth``.
        """
        tiers: list[dict[str, Any]] = []
        for tier, counters in zip(self._tiers, self._tier_counters, strict=True):
            try:
                own = tier.stats()
            except Exception as exc:  # a broken tier must not break monitoring
                own = {"scheme": tier.scheme, "name": tier.name, "capacity": None, "used": None,
                       "evictions": tier.evictions, "stats_error": repr(exc)}
            observed = counters.as_dict()
            # A tier's own figure of the same name (e.g. an LMDB tier's hits, which include
            # reads that bypassed the store) stays visible as tier_<name>.
            tiers.append({**own, **{f"tier_{k}": own[k] for k in observed if k in own},
                          **observed})
        return {
            "tiers": tiers,
            **self._counters.as_dict(),
            "write_policy": self._write_policy,
            "write_queue_depth": self._writes.depth,
        }

    async def aclose(self) -> None:
        """Flush write-through writes, then close every tier. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._writes.aclose()
        finally:
            for index, tier in enumerate(self._tiers):
                try:
                    await tier.aclose()
                except Exception as exc:
                    self._tier_error(index, "aclose", exc)

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        chain = " -> ".join(t.name for t in self._tiers)
        return f"<TieredStore {chain} promote={self._promote!r} {self._write_policy}>"


async def open_store(urls: Sequence[str | Tier], *,
                     tier_options: Mapping[int | str, Mapping[str, Any]] | None = None,
                     **options: Any) -> TieredStore:
    """Build a :class:`TieredStore` from tier URLs (and/or tier objects), top first.

    Parameters
    ----------
    urls
        Tier URLs such as ``"dram://?capacity=8GiB"``, or ready :class:`Tier` objects.
    tier_options
        Keyword options for individual tiers, keyed by position in ``urls`` or by the URL
        string itself; they override the URL's query options (e.g. ``{0: {"clock": c}}``).
    **options
        Store options: ``promote``, ``write_policy``, ``timeout``, ``write_queue_size``,
        ``write_workers``, ``promote_counter_size`` (see :class:`TieredStore`).

    Raises
    ------
    ConfigError
        For a malformed URL, capacity or option, or an unknown scheme or store option.
    """
    if isinstance(urls, str | Tier) or not isinstance(urls, Sequence) or not urls:
        raise TypeError("urls: expected a non-empty list of tier URLs or Tier objects")
    unknown = sorted(set(options) - set(_STORE_OPTIONS))
    if unknown:
        raise ConfigError(f"open_store: unknown option(s) {', '.join(unknown)} "
                          f"(store options: {', '.join(_STORE_OPTIONS)}; per-tier options go "
                          "in the URL or tier_options)")
    per_tier = dict(tier_options or {})
    for ref in per_tier:
        if not (isinstance(ref, str) and ref in urls) and not (
                isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(urls)):
            raise ConfigError(f"tier_options: {ref!r} is neither an index nor a URL in urls")
    tiers: list[Tier] = []
    owned: list[Tier] = []
    try:
        for i, url in enumerate(urls):
            if isinstance(url, Tier):
                tiers.append(url)
                continue
            if not isinstance(url, str):
                raise TypeError(f"urls[{i}]: expected a URL string or Tier, "
                                f"got {type(url).__name__}")
            opts = {**per_tier.get(url, {}), **per_tier.get(i, {})}
            tier = tier_from_url(url, **opts)
            owned.append(tier)
            tiers.append(tier)
        return TieredStore(tiers, **options)
    except BaseException:
        for tier in owned:
            await tier.aclose()
        raise
