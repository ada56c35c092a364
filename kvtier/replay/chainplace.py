"""The dry replay's model of chain placement: which key of a whole prefix chain (seen from
block 0) would pick each block's owner. Simulation only: the ``peers://`` pool places every
block by its own key (chain placement was removed from it, see ``docs/peer-pool.md``), since
a real client rarely sees a chain from block 0.

``block`` places every block by its own key. ``chunk:N`` places runs of N blocks by the first
block of the run. ``root:R`` places blocks ``0..R-1`` by their own keys and the rest of the
chain by block ``R``. ``anchor:R`` places a whole chain by its block ``R`` (its last block
when shorter). ``anchor:R:D`` splits long chains at a fixed depth: blocks ``0..D-1`` are
placed by block ``R`` and each later run of ``D`` blocks by its first block.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ChainPlacement"]


class ChainPlacement:
    """Placement keys of whole prefix chains (the dry replay's ``--placement``).

    Parameters
    ----------
    mode
        ``"block"``, ``"chunk:N"`` (N >= 1), ``"root:R"``, ``"anchor:R"`` (R >= 0) or
        ``"anchor:R:D"`` (D > R).
    """

    def __init__(self, mode: str = "block") -> None:
        kind, _, size = mode.partition(":")
        size, _, depth = size.partition(":")
        self._depth = 0  # anchor:R:D splits chains every D blocks (0: never)
        if mode == "block":
            self._kind, self._n = "chunk", 1
        elif (kind == "chunk" and size.isdigit() and int(size) >= 1 and not depth) or (
                kind == "root" and size.isdigit() and not depth) or (
                kind == "anchor" and size.isdigit() and (not depth or (
                    depth.isdigit() and int(depth) > int(size)))):
            self._kind, self._n = kind, int(size)
            self._depth = int(depth or 0)
        else:
            raise ValueError("placement: expected 'block', 'chunk:N', 'root:R', 'anchor:R' or "
                             f"'anchor:R:D' (D > R), got {mode!r}")
        self.mode = mode

    @property
    def per_block(self) -> bool:
        """Whether every block is placed by its own key."""
        return self._kind == "chunk" and self._n == 1

    def _source(self, position: int, last: int) -> int:
        """The position of the key that places block ``position`` of a chain whose last block
        is at ``last``. Never after ``position`` except under ``anchor``."""
        size = self._n
        if self._kind == "chunk":
            return position - position % size
        if self._kind == "root":
            return position if position < size else size
        depth = self._depth
        if depth and position >= depth:
            return position - position % depth
        return min(size, last)

    def placement_keys(self, chain: Sequence[bytes]) -> list[bytes]:
        """For each key of ``chain`` (a prefix from block 0), the key its owner is hashed by."""
        n = len(chain)
        if n == 0 or self.per_block:
            return list(chain)
        return [chain[self._source(i, n - 1)] for i in range(n)]
