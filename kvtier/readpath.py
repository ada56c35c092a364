"""The store's read path: the top-down walk, single flight below the top tier, promotion of
lower-tier hits, and the buffer (``get_into``) and presence forms that share them.

Every read of a block below the top tier goes through :meth:`ReadPath.fetch_lower` (one key)
or :meth:`ReadPath.fetch_lower_many` (a batch): concurrent readers of one key share one
fetch, and the fetch decides promotion once.

A key every tier missed is counted by reason (:mod:`kvtier.misses`): a tier that gave no
answer during the read (its :class:`~kvtier.misses.Trouble`), else what the tiers noted of the
key (evicted, dropped as corrupt, unreachable), else ``not_stored``. Only misses pay for this.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvtier.deadline import DeadlineExceeded
from kvtier.misses import MissReason, Trouble
from kvtier.promotion import Promotion
from kvtier.singleflight import Flight, KeyRegistry, KeyState, LeaderGone
from kvtier.tierchain import TierChain
from kvtier.tiers.base import Block, copy_into

__all__ = ["ReadPath"]

T = TypeVar("T")


class ReadPath:
    """Reads of a :class:`~kvtier.store.TieredStore`.

    Parameters
    ----------
    chain
        The tiers and their counters.
    keys
        The store's per-key registry (flights, generations).
    promotion
        The ``promote=`` policy.
    is_closed
        Whether the store is closing (promotions stop then).

    Notes
    -----
    Callers validate keys and arguments; every method here runs on the store's loop.
    Deadlines are loop times (``None``: none). A tier that fails or misses its deadline is a
    miss for that tier, counted in its stats.

    Single flight: the first reader of a key below the top leads the fetch, later ones join
    it with their *own* deadline. A leader that runs out of time or is cancelled hands the
    fetch on (its followers fetch again within their deadlines): a fetch never resolves to a
    miss just because its leader gave up.
    """

    def __init__(self, chain: TierChain, keys: KeyRegistry, promotion: Promotion,
                 is_closed: Callable[[], bool]) -> None:
        self._chain = chain
        self._keys = keys
        self._promotion = promotion
        self._is_closed = is_closed

    # ------------------------------------------------------------------ one key
    async def get(self, key: bytes, deadline: float | None) -> Block | None:
        """The block under ``key`` (top-down, promoted per policy) or ``None``."""
        chain = self._chain
        counters = chain.counters
        counters.gets += 1
        trouble: Trouble | None = None
        start = time.perf_counter_ns()  # also when this read began, for its miss reason
        if deadline is None:
            # Hot path (a top-tier hit without a deadline), inlined: each coroutine frame
            # costs ~0.3 us against a ~1 us DRAM hit.
            c = chain.tier_counters[0]
            try:
                block = await chain.tiers[0]._get(key)
            except Exception as exc:
                trouble = self._failed(0, "get", exc)
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
            got = await self._tier_get(0, key, deadline)
            block, trouble = (None, got) if isinstance(got, Trouble) else (got, None)
        if block is None and len(chain) > 1:
            got = await self.fetch_lower(key, deadline)
            block, trouble = (None, got) if isinstance(got, Trouble) else (got, trouble)
        if block is None:
            counters.misses += 1
            chain.misses.count(key, trouble, start)
        else:
            counters.hits += 1
        return block

    async def _tier_get(self, index: int, key: bytes, deadline: float | None
                        ) -> Block | Trouble | None:
        """One tier's get with stats; a timeout or failure is the tier's :class:`Trouble`
        (distinct from a clean miss, ``None``)."""
        start = time.perf_counter_ns()
        block = await self._guarded(index, "get", deadline, self._chain.tiers[index]._get, key)
        if isinstance(block, Trouble):
            return block
        elapsed = time.perf_counter_ns() - start
        c = self._chain.tier_counters[index]
        if block is None:
            c.count_read(elapsed, misses=1)
        else:
            c.count_read(elapsed, hits=1, nbytes=block.nbytes)
        return block

    async def _guarded(self, index: int, op: str, deadline: float | None,
                       fn: Callable[..., Awaitable[T]], *args: Any,
                       passthrough: tuple[type[Exception], ...] = ()) -> T | Trouble:
        """``fn(*args)``, a call of tier ``index``, within ``deadline``: the one place a read
        counts a tier's timeout (its ``deadline`` trouble) or failure (``unavailable``,
        counted and logged as a tier error). Exceptions of the ``passthrough`` types
        propagate (the caller's own errors, such as a bad output buffer)."""
        try:
            if deadline is None:
                return await fn(*args)  # one coroutine frame less (TierChain.bounded's)
            return await TierChain.bounded(deadline, fn, *args, what=op)
        except passthrough:
            raise
        except TimeoutError as exc:
            self._chain.tier_counters[index].timeouts += 1
            return self._out_of_time(index, exc)
        except Exception as exc:
            return self._failed(index, op, exc)

    def _failed(self, index: int, op: str, exc: Exception) -> Trouble:
        self._chain.error(index, op, exc)
        return Trouble(index, MissReason.UNAVAILABLE,
                       f"{self._chain.tiers[index].name} failed: {type(exc).__name__}: {exc}")

    def _out_of_time(self, index: int, exc: BaseException | None = None) -> Trouble:
        detail = f"the call's deadline ran out before {self._chain.tiers[index].name} answered"
        if isinstance(exc, DeadlineExceeded) and exc.which:
            detail += f": it {exc.which}"
        return Trouble(index, MissReason.DEADLINE, detail)

    async def fetch_lower(self, key: bytes, deadline: float | None) -> Block | Trouble | None:
        """Below the top tier, with single flight: one fetch per key at a time. A miss is
        ``None``, or the :class:`Trouble` of a tier that gave no answer to this fetch."""
        while True:
            flight = self._keys.flight(key)
            if flight is None:
                return await self._lead(key, deadline)
            self._chain.counters.single_flight_joins += 1
            result = await KeyRegistry.join(flight, deadline)
            if not isinstance(result, LeaderGone):
                return result
            # The leader gave up (its deadline or cancellation): fetch within ours.

    async def _lead(self, key: bytes, deadline: float | None) -> Block | Trouble | None:
        flight = self._keys.lead(key)
        state = self._keys.watch(key)
        gen = state.gen
        try:
            got, index = await self._walk(key, deadline)
            if _timed_out(got) or (got is None and _expired(deadline)):
                # Out of time: followers with more of it fetch themselves. (A timer may fire
                # a little before the loop's clock reaches the deadline, as on uvloop, so the
                # timeout itself is the signal, not only the clock.)
                return got
            block = None if isinstance(got, Trouble) else got
            flight.set_result(block)
            if block is not None:
                await self._promote_one(key, block, index, state, gen)
            return got
        finally:
            self._keys.finish(key, flight)
            self._keys.unwatch(key, state)

    async def _walk(self, key: bytes, deadline: float | None
                    ) -> tuple[Block | Trouble | None, int]:
        """The first hit below the top tier and its index. On a miss: the first tier that
        failed, or the one the deadline cut (the walk is then incomplete), else ``None``."""
        trouble: Trouble | None = None
        for index in range(1, len(self._chain)):
            if _expired(deadline):
                # Out of budget: the remaining tiers are not asked (not a tier's timeout).
                return self._out_of_time(index), -1
            got = await self._tier_get(index, key, deadline)
            if _timed_out(got):
                return got, -1
            if isinstance(got, Trouble):
                trouble = trouble or got
            elif got is not None:
                return got, index
        return trouble, -1

    async def _promote_one(self, key: bytes, block: Block, found: int, state: KeyState,
                           gen: int) -> None:
        for index in self._promotion.targets(key, found):
            if state.gen != gen or self._is_closed():
                return  # put/deleted meanwhile: this value is stale
            await self._chain.write(index, key, block, "promote")

    # ------------------------------------------------------------------ batches
    async def get_many(self, keys: list[bytes], deadline: float | None) -> list[Block | None]:
        """Batch :meth:`get`: one batch call per tier for the keys still missing; every tier
        that served or received part of the chain is touched tail-to-head."""
        since = time.perf_counter_ns()
        results: list[Block | None] = [None] * len(keys)
        held: list[list[int]] = [[] for _ in self._chain.tiers]
        trouble: dict[int, Trouble] = {}
        missing = await self._read_batch(0, keys, list(range(len(keys))), results, held,
                                         [], deadline, trouble)
        if missing and len(self._chain) > 1:
            await self.fetch_lower_many(keys, missing, results, held, deadline, trouble)
        await self._touch_held(keys, held)
        self._count(keys, results, trouble, since)
        return results

    async def fetch_lower_many(self, keys: list[bytes], missing: list[int],
                               results: list[Block | None], held: list[list[int]],
                               deadline: float | None, trouble: dict[int, Trouble]) -> None:
        """Below the top tier for ``keys[j] for j in missing``, single flight per key: keys
        another call is already fetching are joined, this call leads (batch-fetches) the
        rest. Fills ``results``; ``held[i]`` gets the indices tier ``i`` served or received;
        ``trouble[j]``, the first tier that gave no answer for ``keys[j]``."""
        registry = self._keys
        mine: dict[bytes, Flight] = {}
        lead: list[int] = []
        first: dict[bytes, int] = {}  # a key repeated in this batch: its leading index
        joined: list[tuple[int, Flight]] = []
        repeated: list[int] = []
        for j in missing:
            key = keys[j]
            if key in mine:
                repeated.append(j)
                continue
            other = registry.flight(key)
            if other is not None:
                self._chain.counters.single_flight_joins += 1
                joined.append((j, other))
                continue
            mine[key] = registry.lead(key)
            first[key] = j
            lead.append(j)
        states: dict[bytes, tuple[KeyState, int]] = {}
        found_at: list[tuple[int, int]] = []
        try:
            for j in lead:
                state = registry.watch(keys[j])
                states[keys[j]] = (state, state.gen)
            remaining: list[int] | None = lead
            for index in range(1, len(self._chain)):
                if not remaining:
                    break
                remaining = await self._read_batch(index, keys, remaining, results, held,
                                                   found_at, deadline, trouble)
                if remaining is None:
                    break
            expired = remaining is None or _expired(deadline)
            for j in lead:  # followers get their blocks before this call promotes
                flight = mine[keys[j]]
                if not flight.done() and not (expired and results[j] is None):
                    flight.set_result(results[j])
            await self._promote_batch(keys, results, found_at, states, held)
        finally:
            for key, flight in mine.items():
                registry.finish(key, flight)
            for key, (state, _) in states.items():
                registry.unwatch(key, state)
        for j in repeated:
            results[j] = results[first[keys[j]]]
            if first[keys[j]] in trouble:
                trouble[j] = trouble[first[keys[j]]]
        for j, other in joined:
            result = await KeyRegistry.join(other, deadline)
            got = (await self.fetch_lower(keys[j], deadline)
                   if isinstance(result, LeaderGone) else result)
            if isinstance(got, Trouble):
                trouble[j] = got
            else:
                results[j] = got

    async def _read_batch(self, index: int, keys: list[bytes], idxs: list[int],
                          results: list[Block | None], held: list[list[int]],
                          found_at: list[tuple[int, int]], deadline: float | None,
                          trouble: dict[int, Trouble]) -> list[int] | None:
        """One tier's batch get for ``keys[j] for j in idxs``; returns the indices still
        missing (all of them if the tier failed), or ``None`` when the deadline passed. A
        failure or timeout is each key's ``trouble`` (unless an earlier tier's is there)."""
        start = time.perf_counter_ns()
        blocks = await self._guarded(index, "get_many", deadline,
                                     self._chain.tiers[index]._get_many, [keys[j] for j in idxs])
        if isinstance(blocks, Trouble):
            for j in idxs:
                trouble.setdefault(j, blocks)
            return None if blocks.reason is MissReason.DEADLINE else idxs
        elapsed = time.perf_counter_ns() - start
        still: list[int] = []
        nbytes = 0
        for j, block in zip(idxs, blocks, strict=True):
            if block is None:
                still.append(j)
                continue
            results[j] = block
            held[index].append(j)
            nbytes += block.nbytes
            if index:
                found_at.append((j, index))
        self._chain.tier_counters[index].count_read(elapsed, hits=len(idxs) - len(still),
                                                    misses=len(still), nbytes=nbytes)
        return still

    async def _promote_batch(self, keys: list[bytes], results: list[Block | None],
                             found_at: list[tuple[int, int]],
                             states: dict[bytes, tuple[KeyState, int]],
                             held: list[list[int]]) -> None:
        per_target: dict[int, list[int]] = {}
        for j, found in found_at:
            for target in self._promotion.targets(keys[j], found):
                per_target.setdefault(target, []).append(j)
        for target in sorted(per_target):
            fresh = [j for j in per_target[target]
                     if states[keys[j]][0].gen == states[keys[j]][1]]
            if not fresh or self._is_closed():
                continue
            items = [(keys[j], block) for j in fresh if (block := results[j]) is not None]
            owed = self._chain.owe_batch(keys)  # stored before removed, kvtier.event_order
            try:
                if owed is not None:
                    owed.writing(target, [k for k, _ in items])
                await self._chain.tiers[target]._put_many(items)
            except Exception as exc:
                if owed is not None:
                    owed.written(target, ok=False)
                # One refused block must not stop the others: count it, then one by one.
                self._chain.error(target, "promote_many", exc)
                for key, block in items:
                    await self._chain.write(target, key, block, "promote")
            else:
                if owed is not None:
                    owed.written(target, ok=True)
                c = self._chain.tier_counters[target]
                c.promotions += len(items)
                c.bytes_in += sum(b.nbytes for _, b in items)
            finally:
                self._chain.announce(owed)
            held[target].extend(fresh)

    async def _touch_held(self, keys: list[bytes], held: list[list[int]]) -> None:
        for index, idxs in enumerate(held):
            if idxs:
                await self._chain.touch(index, [keys[j] for j in sorted(set(idxs))])

    def _count(self, keys: list[bytes], hits: list[Any], trouble: dict[int, Trouble],
               since: int) -> None:
        """Count a batch's gets, hits and misses; each miss by its reason."""
        counters = self._chain.counters
        missed = [j for j, h in enumerate(hits) if h is None or h is False]
        counters.gets += len(hits)
        counters.misses += len(missed)
        counters.hits += len(hits) - len(missed)
        for j in missed:
            self._chain.misses.count(keys[j], trouble.get(j), since)

    # ------------------------------------------------------------------ into buffers
    async def get_into(self, key: bytes, out: Any, deadline: float | None) -> bool:
        """Copy the block into ``out``; ``False`` on a miss.

        The top tier copies straight into ``out`` (its own ``get_into``); below it the read is
        the shared one of :meth:`fetch_lower` (single flight, promotion), then copied.
        A bad ``out`` (``TypeError``/``ValueError``) propagates with ``out`` untouched.
        """
        counters = self._chain.counters
        counters.gets += 1
        since = time.perf_counter_ns()
        hit = await self._top_into(key, out, deadline)
        trouble = hit if isinstance(hit, Trouble) else None
        if hit is not True and len(self._chain) > 1:
            block = await self.fetch_lower(key, deadline)
            if isinstance(block, Trouble):
                trouble = block
            elif block is not None:
                copy_into(block, out)
                hit = True
        if hit is True:
            counters.hits += 1
            return True
        counters.misses += 1
        self._chain.misses.count(key, trouble, since)
        return False

    async def _top_into(self, key: bytes, out: Any, deadline: float | None) -> bool | Trouble:
        """The top tier's ``get_into``: ``True`` on a hit, ``False`` on a miss, the tier's
        :class:`Trouble` when it gave no answer."""
        start = time.perf_counter_ns()
        # A bad ``out`` (TypeError, ValueError, ShapeMismatchError) is the caller's error.
        hit = await self._guarded(0, "get_into", deadline, self._chain.tiers[0]._get_into, key,
                                  out, passthrough=(TypeError, ValueError))
        if isinstance(hit, Trouble):
            return hit
        c = self._chain.tier_counters[0]
        elapsed = time.perf_counter_ns() - start
        if hit:
            c.count_read(elapsed, hits=1)
            return True
        c.count_read(elapsed, misses=1)
        return False

    async def get_many_into(self, keys: list[bytes], outs: list[Any], deadline: float | None
                            ) -> list[bool]:
        """Batch :meth:`get_into`: one batch call of the top tier, then one shared batch
        fetch below for the misses; the hits are touched tail-to-head in the top tier."""
        since = time.perf_counter_ns()
        trouble: dict[int, Trouble] = {}
        # One batch call of the top tier (a remote top tier: one request, not one per key).
        top = await self._guarded(0, "get_many_into", deadline,
                                  self._chain.tiers[0]._get_many_into, keys, outs,
                                  passthrough=(TypeError, ValueError))
        if isinstance(top, Trouble):
            trouble = dict.fromkeys(range(len(keys)), top)
            hits = [False] * len(keys)
        else:
            hits = [bool(h) for h in top]
            found = sum(hits)
            self._chain.tier_counters[0].count_read(time.perf_counter_ns() - since,
                                                    hits=found, misses=len(keys) - found)
        missing = [j for j, hit in enumerate(hits) if not hit]
        if missing and len(self._chain) > 1:
            results: list[Block | None] = [None] * len(keys)
            held: list[list[int]] = [[] for _ in self._chain.tiers]
            await self.fetch_lower_many(keys, missing, results, held, deadline, trouble)
            for j in missing:
                block = results[j]
                if block is not None:
                    copy_into(block, outs[j], f"outs[{j}]")
                    hits[j] = True
            await self._touch_held(keys, [[], *held[1:]])
        self._count(keys, hits, trouble, since)
        await self._chain.touch(0, [k for k, h in zip(keys, hits, strict=True) if h])
        return hits

    # ------------------------------------------------------------------ presence
    async def contains_many(self, keys: list[bytes], deadline: float | None,
                            trouble: dict[int, Trouble] | None = None) -> list[bool]:
        """Whether some tier holds each key: one batch call per tier for those not found.
        ``trouble`` (when given) gets, per key not found, the first tier that gave no
        answer."""
        present = [False] * len(keys)
        for index, tier in enumerate(self._chain.tiers):
            todo = [j for j, p in enumerate(present) if not p]
            if not todo:
                break
            found = await self._guarded(index, "contains_many", deadline,
                                        tier._contains_many, [keys[j] for j in todo])
            if isinstance(found, Trouble):
                if trouble is not None:
                    for j in todo:
                        trouble.setdefault(j, found)
                if found.reason is MissReason.DEADLINE:
                    break
                continue
            for j, yes in zip(todo, found, strict=True):
                present[j] = present[j] or bool(yes)
        return present

    async def probe(self, index: int, keys: Sequence[bytes], deadline: float | None
                    ) -> list[bool] | Trouble:
        """Tier ``index``'s presence answer for ``keys`` (no recency refreshed), or the
        :class:`Trouble` of a tier that gave none."""
        found = await self._guarded(index, "contains_many", deadline,
                                    self._chain.tiers[index]._contains_many, keys)
        return found if isinstance(found, Trouble) else [bool(f) for f in found]

    async def lookup_prefix(self, keys: list[bytes], deadline: float | None) -> int:
        """Leading ``keys`` present somewhere; that prefix is touched in every tier. The key
        that ends the prefix is counted by its miss reason (``lookup_miss_reasons``)."""
        since = time.perf_counter_ns()
        trouble: dict[int, Trouble] = {}
        present = await self.contains_many(keys, deadline, trouble)
        hit = next((i for i, p in enumerate(present) if not p), len(present))
        if hit < len(keys):
            self._chain.misses.count(keys[hit], trouble.get(hit), since, lookup=True)
        if hit:
            for index in range(len(self._chain)):
                await self._chain.touch(index, keys[:hit])
        return hit


def _timed_out(value: object) -> bool:
    """Whether ``value`` is a tier's answer cut short by the call's deadline."""
    return isinstance(value, Trouble) and value.reason is MissReason.DEADLINE


def _expired(deadline: float | None) -> bool:
    return deadline is not None and asyncio.get_running_loop().time() >= deadline
