"""The part of a tier that is just its :class:`~kvtier.policy.RecencyPolicy`: budget figures,
chain touches, pins and the shared stats fields. dram, lmdb, fsspec and hbm build on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.policy import RecencyPolicy
from kvtier.tiers.base import Tier

__all__ = ["BudgetedTier"]


class BudgetedTier(Tier):
    """A :class:`Tier` whose recency, pins and byte accounting live in ``self._policy``.

    Subclasses set ``self._policy`` in ``__init__``, call ``policy.victims``/``admit``/
    ``remove`` around their storage, and override a hook here only to do more than the
    policy does (lmdb also records touches to persist them; hbm budgets whole slots).
    """

    _policy: RecencyPolicy

    @property
    def capacity(self) -> int | None:
        return self._policy.capacity

    @property
    def used(self) -> int:
        return self._policy.used

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        self._policy.touch_chain(keys)

    async def _pin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._policy.pin(key)

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._policy.unpin(key)

    def resident_keys(self) -> list[bytes] | None:
        """Keys held, least recently used first (from the recency policy)."""
        return list(self._policy.lru_order())

    def stats(self) -> dict[str, Any]:
        """Tier figures plus ``blocks`` (held now) and ``pinned_bytes``."""
        return {**super().stats(), "blocks": len(self._policy),
                "pinned_bytes": self._policy.pinned_bytes}
