"""Chain placement for a pool: which key of a prefix chain picks each block's owner on the ring.

``block`` (the default) places every block by its own key: best load balance, but a chain's
blocks are spread over all shards, each evicting on its own. ``chunk:N`` places runs of N
blocks by the first block of the run. ``root:R`` places blocks ``0..R-1`` by their own keys
and the rest of the chain by block ``R``. ``anchor:R`` places a whole chain by its block ``R``
(its last block when shorter): one shard holds the chain, as a sticky node would, while any
node can still serve it; a head shared by many chains (a system prompt before block ``R``) is
then stored once per anchor shard. The dry engine measures them (``--placement``,
``docs/pooling-results.md``).

A pool client only knows a block's position when it holds the whole chain: ``lookup_prefix``
and ``get_many`` of a prefix start at block 0, a ``put_many`` after a partial hit does not.
:meth:`ChainPlacement.learn` remembers the placement key of every key of a chain it has
seen (bounded), and :meth:`ChainPlacement.placement_key` answers for a single key.
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
        ``"block"``, ``"chunk:N"`` (N >= 1), ``"root:R"`` or ``"anchor:R"`` (R >= 0).
    memo_keys
        How many keys :meth:`learn` remembers (least recently learned forgotten first).
    """

    def __init__(self, mode: str = "block", *, memo_keys: int = 1 << 20) -> None:
        kind, _, size = mode.partition(":")
        if mode == "block":
            self._kind, self._n = "chunk", 1
        elif (kind == "chunk" and size.isdigit() and int(size) >= 1) or (
                kind in ("root", "anchor") and size.isdigit()):
            self._kind, self._n = kind, int(size)
        else:
            raise ValueError("placement: expected 'block', 'chunk:N', 'root:R' or 'anchor:R', "
                             f"got {mode!r}")
        if type(memo_keys) is not int or memo_keys < 0:
            raise ValueError(f"memo_keys: expected an int >= 0, got {memo_keys!r}")
        self.mode = mode
        self._memo_keys = memo_keys
        self._memo: OrderedDict[bytes, bytes] = OrderedDict()

    @property
    def per_block(self) -> bool:
        """Whether every block is placed by its own key (nothing to learn)."""
        return self._kind == "chunk" and self._n == 1

    def placement_keys(self, chain: Sequence[bytes]) -> list[bytes]:
        """For each key of ``chain`` (a prefix from block 0), the key its owner is hashed by."""
        n, size = len(chain), self._n
        if n == 0 or self.per_block:
            return list(chain)
        if self._kind == "chunk":
            return [chain[i - i % size] for i in range(n)]
        if self._kind == "root":
            return [chain[min(i, size)] for i in range(n)]
        return [chain[min(size, n - 1)]] * n

    def learn(self, chain: Sequence[bytes]) -> list[bytes]:
        """:meth:`placement_keys` of ``chain``, remembered for :meth:`placement_key`."""
        keys = self.placement_keys(chain)
        if not self.per_block and self._memo_keys:
            memo = self._memo
            for key, where in zip(chain, keys, strict=True):
                memo[key] = where
                memo.move_to_end(key)
            while len(memo) > self._memo_keys:
                memo.popitem(last=False)
        return keys

    def placement_key(self, key: bytes) -> bytes:
        """The key ``key``'s owner is hashed by: learned from a chain, else ``key`` itself."""
        return self._memo.get(key, key)
