"""Hinted handoff: the writes a client could not copy to an owner that was out of the path
or under suspicion.

Such a put stores its copies on the other owners (and fallback members) and leaves a *hint*
here: "this owner misses this key"; a delete leaves one with its stamp: "this owner misses
this delete". When the owner is back (it rejoins the path, or answers again after
failures), the pool asks it which hinted keys it lacks, reads those and stores them on it
(``?fill=1``: never over a newer value or a tombstone), and sends it the hinted deletes
with their stamps (applied only where newer, see :mod:`kvtier.peer.versions`). When the
owner leaves the ring instead (DNS or membership change), its hints go to the keys' new
owners at once. Hints live in the client's memory, bounded in keys per member and in bytes
overall; the servers' anti-entropy pass covers a client that exits first, or a hint dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

__all__ = ["Hints"]

# Bytes one hint holds besides its key: the ordered dict's entry, the key object's header.
_ENTRY_BYTES = 120


class Hints:
    """Per member, the puts and deletes it missed while out of the path (bounded, oldest
    dropped first).

    Parameters
    ----------
    max_keys
        Most keys hinted per member; past it the member's oldest hint is dropped.
    max_bytes
        Most bytes all hints hold together (each key plus about 120 bytes); past it the
        oldest hint of the member with the most is dropped. Drops are counted in
        :attr:`dropped`.
    """

    def __init__(self, max_keys: int = 65536, max_bytes: int = 16 << 20) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys: expected >= 1, got {max_keys!r}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes: expected >= 1, got {max_bytes!r}")
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.dropped = 0
        self.nbytes = 0
        # member -> key -> None (a put it missed) or the stamp of a delete it missed
        self._keys: dict[str, OrderedDict[bytes, int | None]] = {}

    def add(self, member: str, key: bytes) -> None:
        """Note that ``member`` misses the put of ``key``."""
        self._add(member, key, None)

    def add_delete(self, member: str, key: bytes, stamp: int) -> None:
        """Note that ``member`` misses the delete of ``key`` stamped ``stamp``."""
        self._add(member, key, stamp)

    def _add(self, member: str, key: bytes, stamp: int | None) -> None:
        keys = self._keys.setdefault(member, OrderedDict())
        if key not in keys:
            self.nbytes += len(key) + _ENTRY_BYTES
        keys[key] = stamp  # the latest write of the key is the one it misses
        keys.move_to_end(key)
        if len(keys) > self.max_keys:
            self._drop(member)
        while self.nbytes > self.max_bytes:
            self._drop(max(self._keys, key=lambda m: len(self._keys[m])))

    def _drop(self, member: str) -> None:
        keys = self._keys[member]
        key, _ = keys.popitem(last=False)
        self.nbytes -= len(key) + _ENTRY_BYTES
        self.dropped += 1
        if not keys:
            del self._keys[member]

    def holds(self, member: str, key: bytes) -> bool:
        """Whether a hint says ``member`` misses a write of ``key``."""
        keys = self._keys.get(member)
        return keys is not None and key in keys

    def take(self, member: str) -> list[bytes]:
        """The puts hinted for ``member``, oldest first; forgets them."""
        return [k for k, _ in self._take(member, deletes=False)]

    def take_deletes(self, member: str) -> list[tuple[bytes, int]]:
        """The deletes hinted for ``member`` as ``(key, stamp)``, oldest first; forgets them."""
        return [(k, s) for k, s in self._take(member, deletes=True) if s is not None]

    def _take(self, member: str, *, deletes: bool) -> list[tuple[bytes, int | None]]:
        keys = self._keys.get(member)
        if keys is None:
            return []
        taken = [(k, s) for k, s in keys.items() if (s is not None) == deletes]
        for key, _ in taken:
            del keys[key]
            self.nbytes -= len(key) + _ENTRY_BYTES
        if not keys:
            del self._keys[member]
        return taken

    def retarget(self, gone: Iterable[str], owners: Callable[[bytes], list[str]]) -> set[str]:
        """Move the hints of members that left the ring to each key's current ``owners``
        (those that are not themselves gone); returns the members that got hints."""
        gone = set(gone)
        moved: set[str] = set()
        for member in gone:
            for key, stamp in self._take(member, deletes=False) + \
                    self._take(member, deletes=True):
                for owner in owners(key):
                    if owner not in gone:
                        self._add(owner, key, stamp)
                        moved.add(owner)
        return moved

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._keys.values())
