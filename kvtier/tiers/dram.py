"""``dram://``: blocks in this process's host memory, under a byte budget with LRU eviction."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from kvtier.errors import ConfigError
from kvtier.policy import Clock, RecencyPolicy
from kvtier.tiers.base import Block, Tier
from kvtier.urls import merge_options, parse_size, parse_tier_url

__all__ = ["DRAMTier"]


class DRAMTier(Tier):
    """Host-memory tier.

    ``put`` copies the caller's array once (the engine may reuse its buffer); ``get`` returns
    a read-only zero-copy view of the stored copy.

    Parameters
    ----------
    capacity
        Byte budget (``None``: unbounded).
    clock
        Time source for the recency policy (tests inject a fake clock).
    name
        Label in stats.

    Examples
    --------
    URL form: ``dram://?capacity=8GiB``.
    """

    scheme = "dram"

    def __init__(self, capacity: int | None = None, *, clock: Clock = time.monotonic,
                 name: str | None = None) -> None:
        super().__init__(name=name)
        self._policy = RecencyPolicy(capacity, clock)
        self._blocks: dict[bytes, Block] = {}
        # Serialises eviction+admission: a victim must reach the next tier before it goes.
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``dram://?capacity=SIZE[&name=LABEL]``."""
        parsed = parse_tier_url(url)
        if parsed.netloc or parsed.path not in ("", "/"):
            raise ConfigError(f"url: dram:// takes no host or path, got {url!r}")
        opts = merge_options(parsed, options, {"capacity", "name", "clock"})
        capacity = opts.get("capacity")
        return cls(
            capacity=None if capacity in (None, "") else parse_size(capacity),  # type: ignore[arg-type]
            name=str(opts["name"]) if "name" in opts else None,
            **({"clock": opts["clock"]} if "clock" in opts else {}),  # type: ignore[arg-type]
        )

    @property
    def capacity(self) -> int | None:
        return self._policy.capacity

    @property
    def used(self) -> int:
        return self._policy.used

    def __len__(self) -> int:
        return len(self._blocks)

    async def _get(self, key: bytes) -> Block | None:
        block = self._blocks.get(key)
        if block is not None:
            self._policy.touch(key)
        return block

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return [await self._get(k) for k in keys]

    async def _contains(self, key: bytes) -> bool:
        return key in self._blocks

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._blocks for k in keys]

    async def _put(self, key: bytes, block: Block) -> None:
        self._policy.check_fits(block.nbytes)
        stored = np.array(block, copy=True, order="C")
        stored.flags.writeable = False
        async with self._lock:
            for victim in self._policy.victims(stored.nbytes, replacing=key):
                old = self._blocks.get(victim)
                if old is not None:
                    await self._evict(victim, old)
                self._blocks.pop(victim, None)
                self._policy.remove(victim)
            self._blocks[key] = stored
            self._policy.admit(key, stored.nbytes)

    async def _delete(self, key: bytes) -> bool:
        # Waits for an in-flight eviction so a deleted key is not demoted afterwards.
        async with self._lock:
            self._policy.remove(key)
            return self._blocks.pop(key, None) is not None

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        self._policy.touch_chain(keys)

    async def _pin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._policy.pin(key)

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._policy.unpin(key)

    async def _aclose(self) -> None:
        self._blocks.clear()
        for key in list(self._policy.lru_order()):
            self._policy.remove(key)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "blocks": len(self._blocks),
                "pinned_bytes": self._policy.pinned_bytes}
