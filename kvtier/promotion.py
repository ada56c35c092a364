"""Where a lower-tier hit is copied: the store's ``promote=`` policy, pure and synchronous."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from kvtier.errors import ConfigError

__all__ = ["Promote", "Promotion"]

Promote = Literal["all", "top"] | int


class Promotion:
    """The ``promote=`` policy: ``"all"`` tiers above a hit, ``"top"`` only, or all above once
    a key has hit ``N`` times below the top (counts kept for at most ``counter_size`` keys,
    oldest forgotten first).

    Parameters
    ----------
    policy
        ``"all"``, ``"top"`` or an int >= 1.
    counter_size
        Keys whose lower-tier hits are remembered for ``promote=N``.

    Raises
    ------
    ConfigError
        For a malformed ``policy`` or ``counter_size`` (a ``ValueError``).
    """

    def __init__(self, policy: object = "all", counter_size: int = 65536) -> None:
        if isinstance(counter_size, bool) or not isinstance(counter_size, int) or counter_size < 1:
            raise ConfigError(f"promote_counter_size: expected an int >= 1, got {counter_size!r}")
        if policy in ("all", "top"):
            self.policy: Promote = policy
        elif isinstance(policy, int) and not isinstance(policy, bool) and policy >= 1:
            self.policy = policy
        else:
            raise ConfigError(f"promote: expected 'all', 'top' or an int >= 1 (hits before "
                              f"promoting), got {policy!r}")
        self._counter_size = counter_size
        self._hits: OrderedDict[bytes, int] = OrderedDict()

    def targets(self, key: bytes, found: int) -> range:
        """Tiers above ``found`` that this hit should be copied into (may be empty).

        Call once per hit below the top: with ``promote=N`` it counts the hit.
        """
        policy = self.policy
        if found <= 0:
            return range(0)
        if policy == "all":
            return range(found)
        if policy == "top":
            return range(1)
        counts = self._hits
        seen = counts.pop(key, 0) + 1
        if seen >= policy:
            return range(found)
        counts[key] = seen
        if len(counts) > self._counter_size:
            counts.popitem(last=False)
        return range(0)

    def forget(self, key: bytes) -> None:
        """A delete of ``key``: its hit count starts over."""
        self._hits.pop(key, None)

    def __len__(self) -> int:
        """Keys with a remembered hit count."""
        return len(self._hits)
