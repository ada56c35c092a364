"""Where blocks go and how older copies become unreachable: ``put``/``put_many`` placement
(first fitting tier, the pool copy, the write-through hand-off), demotion of evicted blocks,
and deletes.

Invariant kept here: after a put of ``k`` returns, no tier serves an older value of ``k``;
after a delete returns, none serves any. An older copy *below* the tier that took the new
value may stay (deleting it on every put would cost a write per lower tier per put), but it
is shadowed, and a demotion of the newer value that skips tiers deletes their copies. An
evicted block that no lower tier takes is not dropped: the evicting tier keeps it and the
put that needed the room fails (:meth:`Placement.demoter`).
"""

from __future__ import annotations

from kvtier.deadline import current as current_deadline
from kvtier.errors import BlockTooLargeError, TierError, TierFullError
from kvtier.misses import MissReason
from kvtier.promotion import Promotion
from kvtier.singleflight import KeyRegistry, KeyState
from kvtier.tierchain import NOT_HERE, TierChain, finish_even_if_cancelled
from kvtier.tiers.base import Block, EvictionCallback
from kvtier.writethrough import WritesDone, WriteThrough

__all__ = ["Placement"]


class Placement:
    """Puts, demotions and deletes of a :class:`~kvtier.store.TieredStore`.

    Parameters
    ----------
    chain
        The tiers and their counters.
    keys
        The store's per-key registry.
    promotion
        The promotion policy (a delete resets a key's hit count).
    writes
        The write-through queue, or ``None`` for ``write_back``.
    pool_write_through
        Copy every put that lands above a shared tier (:attr:`Tier.shared`, e.g.
        ``peers://``) into it before ``put`` returns, so the block is readable pool-wide.

    Notes
    -----
    Callers validate keys and blocks. Multi-step changes (a delete over every tier, a put and
    its pool copy) run to completion even if the caller is cancelled
    (:func:`~kvtier.tierchain.finish_even_if_cancelled`): a cancelled call leaves its full
    effect or none, never an older value exposed.
    """

    def __init__(self, chain: TierChain, keys: KeyRegistry, promotion: Promotion,
                 writes: WriteThrough | None, *, pool_write_through: bool = True) -> None:
        self._chain = chain
        self._keys = keys
        self._promotion = promotion
        self._writes = writes
        tiers = chain.tiers
        # For each tier index, the shared tier below it that a put there is copied into.
        self._pool_below: list[int | None] = [None] * len(tiers)
        if pool_write_through:
            for index in range(len(tiers)):
                self._pool_below[index] = next(
                    (j for j in range(index + 1, len(tiers)) if tiers[j].shared), None)

    def pool_index(self, placed: int) -> int | None:
        """The shared tier a block placed in tier ``placed`` is copied into, if any."""
        return self._pool_below[placed]

    # ------------------------------------------------------------------ put
    def first_fitting(self, nbytes: int, name: str) -> int:
        """Index of the first tier whose capacity can hold ``nbytes``."""
        tiers = self._chain.tiers
        top = tiers[0].capacity
        if top is None or nbytes <= top:
            return 0
        for i, tier in enumerate(tiers):
            cap = tier.capacity
            if cap is None or nbytes <= cap:
                return i
        raise BlockTooLargeError(
            f"{name}: {nbytes} bytes exceed the capacity of every tier "
            f"(largest {max(t.capacity or 0 for t in tiers)} bytes)")

    async def put(self, key: bytes, block: Block, first: int) -> None:
        """Place one block from tier ``first`` down, then its pool copy and write-through."""
        self._chain.counters.puts += 1
        self._keys.invalidate(key)
        placed = await self._place(key, block, first)
        self._chain.stored(placed, (key,))
        pool = self._pool_below[placed]
        if pool is not None:
            await finish_even_if_cancelled(self._pool_put([(key, block)], pool))
            self._chain.stored(pool, (key,))
        if self._writes is not None:
            await self._writes.enqueue(key, block, (placed if pool is None else pool) + 1)

    async def put_many(self, items: dict[bytes, tuple[Block, int]], count: int,
                       parent: bytes | None = None) -> WritesDone:
        """Place validated blocks (``key -> (block, first fitting tier)``); ``count`` is the
        number of puts the caller made (repeated keys included). The keys are taken as a
        prefix chain after ``parent`` for the ``BlockStored`` events. Returns the completion
        of the write-through writes this call queued."""
        chain = self._chain
        chain.counters.puts += count
        for key in items:
            self._keys.invalidate(key)
        top = [(k, b) for k, (b, first) in items.items() if first == 0]
        placed: dict[bytes, int] = {}
        keys = list(items)
        owed = chain.owe_batch(keys, parent)  # BlockStored before any BlockRemoved of these
        try:
            if top:
                if owed is not None:
                    owed.writing(0, [k for k, _ in top])
                try:
                    # Tail first: a batch larger than the tier then evicts the chain's end,
                    # not its start (admitted head-first, the head was the oldest entry).
                    await chain.tiers[0]._put_many(top[::-1])
                except Exception as exc:
                    if owed is not None:
                        owed.written(0, ok=False)
                    if not isinstance(exc, NOT_HERE):
                        chain.error(0, "put_many", exc)
                else:
                    if owed is not None:
                        owed.written(0, ok=True)
                    chain.tier_counters[0].bytes_in += sum(b.nbytes for _, b in top)
                    placed.update((k, 0) for k, _ in top)
                    await chain.touch(0, [k for k, _ in top])
            for key, (block, first) in reversed(items.items()):
                if key not in placed:
                    placed[key] = await self._place(key, block, first)
                    if owed is not None:
                        owed.owe(placed[key], [key])
        finally:
            chain.announce(owed)
        events = chain.events.subscribers > 0
        per_pool: dict[int, list[tuple[bytes, Block]]] = {}
        for key, index in placed.items():
            pool = self._pool_below[index]
            if pool is not None:
                per_pool.setdefault(pool, []).append((key, items[key][0]))
        for pool, pool_items in per_pool.items():
            await finish_even_if_cancelled(self._pool_put(pool_items, pool))
        if per_pool and events:
            chain.stored_runs([self._pool_below[placed[k]] for k in keys], keys, parent)
        done = WritesDone()
        if self._writes is not None:
            for key, (block, _) in items.items():
                pool = self._pool_below[placed[key]]
                await self._writes.enqueue(key, block,
                                           (placed[key] if pool is None else pool) + 1, done)
        return done

    async def _place(self, key: bytes, block: Block, first: int) -> int:
        """Put into the first tier from ``first`` that accepts; return its index.

        Raises :class:`TierFullError` when none accepted and one of them refused for lack of
        room (a peer server answers ``507``), :class:`TierError` when they all failed."""
        chain = self._chain
        failures: list[str] = []
        full = False
        for index in range(first, len(chain)):
            tier = chain.tiers[index]
            try:
                await tier._put(key, block)  # validated once by the store
            except NOT_HERE as exc:
                failures.append(f"{tier.name}: {exc}")
                full = full or isinstance(exc, TierFullError)
                continue
            except Exception as exc:
                chain.error(index, "put", exc)
                failures.append(f"{tier.name}: {type(exc).__name__}: {exc}")
                continue
            chain.tier_counters[index].bytes_in += block.nbytes
            if index:  # a copy above would shadow the new value
                await finish_even_if_cancelled(self._delete_from(range(index), [key]))
            return index
        error = TierFullError if full else TierError
        raise error(f"put {key.hex()}: no tier accepted the block ({'; '.join(failures)})")

    async def _pool_put(self, items: list[tuple[bytes, Block]], pool: int) -> None:
        """Copy blocks into the shared tier ``pool``; raises if it did not take them."""
        chain = self._chain
        try:
            await chain.tiers[pool]._put_many(items)
        except Exception as exc:
            chain.error(pool, "pool put", exc)
            raise TierError(f"put: {len(items)} block(s) not copied into the pool tier "
                            f"{chain.tiers[pool].name}: {type(exc).__name__}: {exc}") from exc
        c = chain.tier_counters[pool]
        c.bytes_in += sum(b.nbytes for _, b in items)
        chain.counters.pool_writes += len(items)

    async def _delete_from(self, indexes: range, keys: list[bytes]) -> None:
        for index in indexes:
            await self._chain.quiet_delete(index, keys)

    # ------------------------------------------------------------------ demotion
    def demoter(self, index: int) -> EvictionCallback:
        """The ``on_evict`` callback of tier ``index``: write the block into the first tier
        below that takes it, while the evicting tier still serves it.

        When none takes it (full, failing), it raises :class:`TierFullError`: the evicting
        tier then keeps the victim and the put that needed the room fails, so a block that
        was put is never dropped because a lower tier refused it (only the last tier's own
        budget evicts for good)."""
        chain = self._chain

        async def demote(key: bytes, block: Block) -> None:
            state = self._keys.state(key)
            if state is not None and state.deleting:
                return  # being deleted: moving it down would resurrect it
            for below in range(index + 1, len(chain)):
                if await chain.write(below, key, block, "demote"):
                    # A tier skipped in between may hold an older copy that would now
                    # shadow this one.
                    await self._delete_from(range(index + 1, below), [key])
                    return
            chain.counters.evictions_refused += 1
            raise TierFullError(f"block {key.hex()} stays in {chain.tiers[index].name}: no "
                                "tier below accepted it")

        return demote

    # ------------------------------------------------------------------ delete
    async def delete(self, keys: list[bytes]) -> list[bool]:
        """Remove ``keys`` from every tier; per key, whether any tier held it.

        All or nothing under cancellation: once started, the delete finishes (the caller's
        cancellation is raised after it), so no tier is left serving an older value.
        """
        self._chain.counters.deletes += len(keys)
        # Sorted, so that two concurrent batch deletes take the per-key locks in one order.
        states = {k: self._keys.watch(k) for k in sorted(set(keys))}
        for key, state in states.items():
            self._keys.invalidate(key)
            state.deleting += 1
        try:
            return await finish_even_if_cancelled(self._delete_locked(keys, states))
        finally:
            for key, state in states.items():
                state.deleting -= 1
                self._promotion.forget(key)
                self._keys.unwatch(key, state)

    async def _delete_locked(self, keys: list[bytes], states: dict[bytes, KeyState]
                             ) -> list[bool]:
        removed = [False] * len(keys)
        locked: list[KeyState] = []
        try:
            # Wait out write-through writes of these keys already past their generation check.
            for state in states.values():
                await state.lock.acquire()
                locked.append(state)
            for index, tier in enumerate(self._chain.tiers):
                try:
                    gone = await tier._delete_many(keys)
                except Exception as exc:
                    self._chain.error(index, "delete_many", exc)
                    continue
                if (deadline := current_deadline()) is not None:
                    deadline.commit()  # gone from one tier: the others must follow
                self._chain.removed_where(index, keys, gone)
                self._chain.misses.note_many(index, [k for k, g in zip(keys, gone, strict=True)
                                                     if g], MissReason.DELETED)
                removed = [a or bool(b) for a, b in zip(removed, gone, strict=True)]
        finally:
            for state in locked:
                state.lock.release()
        return removed

