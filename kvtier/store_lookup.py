"""The store's reads into caller-owned buffers (``get_into``, ``get_many_into``) and
presence checks (``contains``, ``contains_many``, ``lookup_prefix``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier.keys import validate_key
from kvtier.singleflight import KeyState
from kvtier.store_core import _keys_list
from kvtier.store_read import StoreReads
from kvtier.tiers.base import copy_into

__all__ = ["StoreLookups"]


class StoreLookups(StoreReads):
    """``get_into``/``get_many_into`` and presence checks of
    :class:`~kvtier.store.TieredStore` (a buffer read due for promotion reuses the read
    path's promotion)."""

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
