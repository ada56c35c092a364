"""The store's writes: ``put``/``put_many``, demotion of evicted blocks, write-through
hand-off, ``delete``/``delete_many`` and pins."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvtier.codec import as_block
from kvtier.errors import BlockTooLargeError, TierError
from kvtier.keys import validate_key
from kvtier.store_core import _NOT_HERE, StoreCore, _keys_list, log
from kvtier.tiers.base import Block, EvictionCallback

__all__ = ["StoreWrites"]


class StoreWrites(StoreCore):
    """Writes, deletes, demotion and pins of :class:`~kvtier.store.TieredStore`."""

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

    # ------------------------------------------------------------------ write-through
    async def _write_through(self, index: int, key: bytes, block: Block) -> bool:
        return await self._write_into(index, key, block, "write_through")

    async def flush(self) -> None:
        """Wait until every queued write-through write has been attempted."""
        await self._writes.flush()

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
