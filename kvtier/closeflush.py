"""The warm hand-off at close: copy what volatile tiers hold into the persistent tier below
them, so that a store reopened on the same persistent tier (``lmdb://``, ``file://``)
starts warm.

Bounded by a timeout (whatever is not copied by then is lost, as without the flush) and
ordered least recently used first, so that if the persistent tier's budget evicts during
the flush it evicts the coldest blocks.
"""

from __future__ import annotations

import asyncio

from kvtier.tierchain import TierChain, log
from kvtier.tiers.base import Block

__all__ = ["CloseFlush"]

#: Blocks per batch written into the persistent tier (one transaction for LMDB).
_BATCH = 64


class CloseFlush:
    """Copies volatile tiers' blocks into the first persistent tier below them.

    Parameters
    ----------
    chain
        The tiers and their counters.
    timeout
        Seconds the whole flush may take.

    Notes
    -----
    A tier takes part if it can list what it holds (:meth:`Tier.resident_keys`) and a tier
    below it is :attr:`Tier.persistent`. Tiers are flushed top first and a key is copied
    once, from the highest tier holding it (the freshest copy: a lower copy may be an older
    value the store kept shadowed). Runs after the store stopped taking calls.
    """

    def __init__(self, chain: TierChain, timeout: float) -> None:
        self._chain = chain
        self._timeout = timeout
        tiers = chain.tiers
        self._plan: list[tuple[int, int]] = []  # (volatile source, persistent target)
        for index, tier in enumerate(tiers):
            if tier.persistent:
                continue
            target = next((j for j in range(index + 1, len(tiers)) if tiers[j].persistent),
                          None)
            if target is not None:
                self._plan.append((index, target))

    @property
    def active(self) -> bool:
        """Whether some volatile tier sits above a persistent one."""
        return bool(self._plan)

    async def run(self) -> int:
        """Copy, within the timeout; returns the number of blocks copied."""
        counters = self._chain.counters
        done: set[bytes] = set()
        try:
            async with asyncio.timeout(self._timeout):
                for source, target in self._plan:
                    await self._flush_tier(source, target, done)
        except TimeoutError:
            log.warning("close flush stopped after %.1f s with %d block(s) copied",
                        self._timeout, counters.close_flushed)
        return counters.close_flushed

    async def _flush_tier(self, source: int, target: int, done: set[bytes]) -> None:
        chain = self._chain
        tier = chain.tiers[source]
        keys = [k for k in tier.resident_keys() or () if k not in done]
        done.update(keys)
        for start in range(0, len(keys), _BATCH):
            batch = keys[start:start + _BATCH]
            try:
                blocks = await tier._get_many(batch)
            except Exception as exc:
                chain.error(source, "close flush read", exc)
                continue
            items: list[tuple[bytes, Block]] = [
                (k, b) for k, b in zip(batch, blocks, strict=True) if b is not None]
            if not items:
                continue
            owed = chain.owe_batch([k for k, _ in items])  # see kvtier.event_order
            try:
                if owed is not None:
                    owed.writing(target, owed.keys)
                await chain.tiers[target]._put_many(items)
            except Exception:  # a refused block must not stop the others: one by one
                if owed is not None:
                    owed.written(target, ok=False)
                for key, block in items:
                    if await chain.write(target, key, block, "close_flush"):
                        chain.counters.close_flushed += 1
            else:
                if owed is not None:
                    owed.written(target, ok=True)
                chain.counters.close_flushed += len(items)
                chain.tier_counters[target].bytes_in += sum(b.nbytes for _, b in items)
            finally:
                chain.announce(owed)
