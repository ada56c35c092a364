"""Chain placement for a pool: which key of a prefix chain picks each block's owner on the ring.

``block`` (the default) places every block by its own key: best load balance, but a chain's
blocks are spread over all shards, each evicting on its own. ``chunk:N`` places runs of N
blocks by the first block of the run. ``root:R`` places blocks ``0..R-1`` by their own keys
and the rest of the chain by block ``R``. ``anchor:R`` places a whole chain by its block ``R``
(its last block when shorter): one shard holds the chain, as a sticky node would, while any
node can still serve it; a head shared by many chains (a system prompt before block ``R``) is
then stored once per anchor shard. ``anchor:R:D`` splits long chains at a fixed depth: blocks
``0..D-1`` are placed by block ``R`` and each later run of ``D`` blocks by its first block, so
one very long prompt cannot make its anchor's shard the largest. The dry engine measures them
(``--placement``, ``docs/pooling-results.md``) and ``peers://...?placement=`` uses them in a
real pool.

A pool client only knows a block's position when it has seen its chain: ``lookup_prefix``
and ``get_many`` of a prompt start at block 0, a ``put_many`` after a partial hit continues
after its ``parent``. :meth:`ChainPlacement.learn` remembers, for every key of a chain it has
seen, its position and placement key (bounded, least recently learned forgotten first), so
that a later call over part of the chain, or over a single key, places it the same way with
no request to the pool. A key never seen places by its own key (``block``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["ChainPlacement"]


class ChainPlacement:
    """Placement keys of prefix chains.

    Parameters
    ----------
    mode
        ``"block"``, ``"chunk:N"`` (N >= 1), ``"root:R"``, ``"anchor:R"`` (R >= 0) or
        ``"anchor:R:D"`` (D > R).
    memo_keys
        How many keys :meth:`learn` remembers (least recently learned forgotten first).
    """

    def __init__(self, mode: str = "block", *, memo_keys: int = 1 << 20) -> None:
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
        if type(memo_keys) is not int or memo_keys < 0:
            raise ValueError(f"memo_keys: expected an int >= 0, got {memo_keys!r}")
        self.mode = mode
        self._memo_keys = memo_keys
        # key -> (placement key, position in its chain)
        self._memo: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()

    @property
    def per_block(self) -> bool:
        """Whether every block is placed by its own key (nothing to learn)."""
        return self._kind == "chunk" and self._n == 1

    def __len__(self) -> int:
        """Keys remembered."""
        return len(self._memo)

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

    def learn(self, chain: Sequence[bytes], parent: bytes | None = None) -> list[bytes]:
        """Placement keys of ``chain``, remembered for :meth:`placement_key`.

        ``chain`` continues after ``parent`` when given, else after ``chain[0]``'s known
        position, else it starts at block 0. A ``parent`` never seen leaves the keys'
        placement as it was (learned earlier, or their own keys): their position is unknown.
        """
        if not chain or self.per_block:
            return list(chain)
        memo = self._memo
        ref = memo.get(parent) if parent is not None else memo.get(chain[0])
        if parent is not None and ref is None:
            return [self.placement_key(k) for k in chain]
        if ref is None:
            base, before = 0, b""
        else:
            before, known = ref
            base = known + 1 if parent is not None else known
        last = base + len(chain) - 1
        keys: list[bytes] = []
        for offset, key in enumerate(chain):
            source = self._source(base + offset, last)
            # A source before this call's keys is the one that placed the chain up to
            # ``base`` (the parent, or chain[0] as learned): every mode keeps it there.
            where = chain[source - base] if source >= base else before
            keys.append(where)
            if self._memo_keys:
                memo[key] = (where, base + offset)
                memo.move_to_end(key)
        while len(memo) > self._memo_keys:
            memo.popitem(last=False)
        return keys

    def placement_key(self, key: bytes) -> bytes:
        """The key ``key``'s owner is hashed by: learned from a chain, else ``key`` itself."""
        found = self._memo.get(key)
        return key if found is None else found[0]
