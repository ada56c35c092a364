"""The store's block reads: ``get``, ``get_many``, single flight below the top tier, and
promotion of lower-tier hits into the tiers above."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvtier.errors import ClosedError
from kvtier.keys import validate_key
from kvtier.singleflight import Flight, KeyRegistry, KeyState, LeaderGone
from kvtier.store_core import StoreCore, _keys_list
from kvtier.tiers.base import Block

__all__ = ["StoreReads"]


class StoreReads(StoreCore):
    """``get``/``get_many`` of :class:`~kvtier.store.TieredStore` and promotion."""

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
