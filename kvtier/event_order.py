"""``BlockStored`` owed by a batch write, so that events leave in the order tiers changed.

A batch write (``put_many``, a batch promotion, the close flush) learns where each block
landed only when the tier call returns, and announces the batch then, in runs of a prefix
chain. Meanwhile the tier may already have dropped some of those blocks: a ``put_many`` of
12 blocks into a DRAM tier that holds 8 evicts 4 of them before it returns, and their
``BlockRemoved`` would reach a router before the ``BlockStored`` that lists them (the
router then believes the tier holds 12).

:class:`OwedStored` records, for one batch, the keys being written into a tier and the keys
written and not yet announced. When a tier reports a key of the batch removed, the chain
first announces that key's ``BlockStored`` (the key was there: it is being removed), then
the ``BlockRemoved``; the batch's last announcement leaves such keys out. For every tier and
key, a consumer so sees stored before removed, in the order the tier changed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["OwedStored"]


class OwedStored:
    """The ``BlockStored`` one batch write owes (see the module docstring).

    Parameters
    ----------
    keys
        The batch's keys, a prefix chain in order.
    parent
        The key before ``keys[0]`` in the chain (``None``: unknown or the chain's start).
    """

    def __init__(self, keys: Sequence[bytes], parent: bytes | None = None) -> None:
        self.keys = list(keys)
        self.parent = parent
        self._position = {key: i for i, key in enumerate(self.keys)}
        self._writing: dict[int, set[bytes]] = {}
        self._owed: dict[bytes, int] = {}  # key -> tier it was written into, unannounced

    def writing(self, index: int, keys: Sequence[bytes]) -> None:
        """``keys`` are being written into tier ``index`` (the call has not returned)."""
        self._writing.setdefault(index, set()).update(keys)

    def written(self, index: int, ok: bool) -> None:
        """The write into tier ``index`` returned: its keys are owed (``ok``) or were not
        written (failed: the caller places them elsewhere and calls :meth:`owe`)."""
        keys = self._writing.pop(index, set())
        if ok:
            self._owed.update(dict.fromkeys(keys, index))

    def owe(self, index: int, keys: Sequence[bytes]) -> None:
        """``keys`` were written into tier ``index`` and are not announced yet."""
        self._owed.update(dict.fromkeys(keys, index))

    def take_removed(self, index: int, keys: Sequence[bytes]
                     ) -> list[tuple[list[bytes], bytes | None]]:
        """Of ``keys``, now leaving tier ``index``, those this batch put there and has not
        announced, as ``(keys, parent)`` runs of consecutive chain keys; they are no longer
        owed."""
        writing = self._writing.get(index, set())
        taken = sorted((k for k in set(keys)
                        if self._owed.get(k) == index or k in writing),
                       key=self._position.__getitem__)
        runs: list[tuple[list[bytes], bytes | None]] = []
        for key in taken:
            self._owed.pop(key, None)
            writing.discard(key)
            if runs and self._position[runs[-1][0][-1]] + 1 == self._position[key]:
                runs[-1][0].append(key)
            else:
                runs.append(([key], self.parent_of(key)))
        return runs

    def parent_of(self, key: bytes) -> bytes | None:
        """The key before ``key`` in the batch's chain."""
        position = self._position[key]
        return self.keys[position - 1] if position else self.parent

    def runs(self) -> Iterator[tuple[int, list[bytes], bytes | None]]:
        """What is still owed, as ``(tier, keys, parent)`` runs of consecutive chain keys in
        one tier; nothing is owed afterwards."""
        owed, self._owed = self._owed, {}
        run: list[bytes] = []
        where: int | None = None
        for key in self.keys:
            index = owed.pop(key, None)  # a repeated key is announced once
            if run and index != where:
                assert where is not None
                yield where, run, self.parent_of(run[0])
                run = []
            where = index
            if index is not None:
                run.append(key)
        if run and where is not None:
            yield where, run, self.parent_of(run[0])
