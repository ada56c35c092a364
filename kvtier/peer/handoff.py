"""Hinted handoff: the keys a put could not copy to an owner that was out of the path or
under suspicion.

Such a put stores its copies on the other owners (and fallback members) and leaves a *hint*
here: "this owner misses this key". When the owner is back (it rejoins the path, or answers
again after failures), the pool asks it which hinted keys it lacks, reads those and stores
them on it. Hints live in the client's memory, a key each; the servers' anti-entropy pass
covers a client that exits first.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Hints"]


class Hints:
    """Per member, the keys it missed while out of the path (bounded, oldest dropped first).

    Parameters
    ----------
    max_keys
        Most keys hinted per member; past it the oldest hint is dropped and counted.
    """

    def __init__(self, max_keys: int = 65536) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys: expected >= 1, got {max_keys!r}")
        self.max_keys = max_keys
        self.dropped = 0
        self._keys: dict[str, OrderedDict[bytes, None]] = {}

    def add(self, member: str, key: bytes) -> None:
        """Note that ``member`` misses ``key``."""
        keys = self._keys.setdefault(member, OrderedDict())
        keys[key] = None
        keys.move_to_end(key)
        if len(keys) > self.max_keys:
            keys.popitem(last=False)
            self.dropped += 1

    def holds(self, member: str, key: bytes) -> bool:
        """Whether a hint says ``member`` misses ``key``."""
        keys = self._keys.get(member)
        return keys is not None and key in keys

    def take(self, member: str) -> list[bytes]:
        """The keys hinted for ``member``, oldest first; forgets them."""
        return list(self._keys.pop(member, {}))

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._keys.values())
