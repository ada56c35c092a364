"""Gather and scatter one engine block across all layers of a paged KV cache.

An engine keeps one paged tensor per layer. kvtier stores one engine block across *all* layers
as one flat ``uint8`` array: for each layer in registration order, the block's slice of that
layer (for layouts such as ``(2, num_blocks, ...)`` with K and V split ahead of the block
dimension, the K slice then the V slice). Gathering is the one copy a save needs (after it the
engine may reuse its pages); scattering is the one copy a load needs after ``get_many_into``
filled a host staging buffer. Works on numpy arrays and on torch tensors (CPU or CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import product
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PagedLayers"]


def _is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.split(".")[0] == "torch"


class PagedLayers:
    """The per-layer paged KV tensors of one engine worker, addressed by block id.

    Parameters
    ----------
    layers
        Layer name to paged tensor (numpy array or torch tensor), in the engine's layer order.
        Every tensor must be C-contiguous and have ``num_blocks`` as its first or second
        dimension (the second when a leading K/V dimension precedes it).
    num_blocks
        Blocks in the engine's pool.

    Raises
    ------
    ValueError
        If ``layers`` is empty, a tensor is not contiguous, or no dimension matches
        ``num_blocks``.

    Notes
    -----
    Not thread-safe; the engine's worker thread owns it. The tensors stay owned by the engine.
    """

    def __init__(self, layers: Mapping[str, Any], num_blocks: int) -> None:
        if not layers:
            raise ValueError("layers: expected at least one paged KV tensor")
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks: expected an int >= 1, got {num_blocks!r}")
        self._pieces: list[tuple[Any, tuple[int, ...], int]] = []  # (tensor, lead index, dim)
        self.block_bytes = 0
        for name, tensor in layers.items():
            shape = tuple(int(s) for s in tensor.shape)
            contiguous = (tensor.is_contiguous() if _is_torch(tensor)
                          else bool(tensor.flags.c_contiguous))
            if not contiguous:
                raise ValueError(f"layers[{name!r}]: expected a C-contiguous tensor")
            if shape and shape[0] == num_blocks:
                dim = 0
            elif len(shape) > 1 and shape[1] == num_blocks:
                dim = 1
            else:
                raise ValueError(f"layers[{name!r}]: no block dimension of size {num_blocks} "
                                 f"first or second in shape {shape}")
            item = tensor.element_size() if _is_torch(tensor) else tensor.itemsize
            per_block = int(np.prod(shape[dim + 1:], dtype=np.int64)) * item
            for lead in product(*(range(s) for s in shape[:dim])):
                self._pieces.append((tensor, lead, per_block))
                self.block_bytes += per_block
        self.num_blocks = num_blocks
        self.layer_names = list(layers)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id {block_id} outside 0..{self.num_blocks - 1}")

    def empty(self) -> npt.NDArray[np.uint8]:
        """A host staging buffer for one block."""
        return np.empty(self.block_bytes, dtype=np.uint8)

    def gather(self, block_id: int) -> npt.NDArray[np.uint8]:
        """Copy block ``block_id`` of every layer into a new flat ``uint8`` host array."""
        self._check(block_id)
        out = self.empty()
        offset = 0
        for tensor, lead, nbytes in self._pieces:
            piece = tensor[(*lead, block_id)]
            if _is_torch(piece):
                import torch

                raw = piece.reshape(-1).view(torch.uint8)
                out[offset:offset + nbytes] = raw.cpu().numpy()
            else:
                out[offset:offset + nbytes] = piece.reshape(-1).view(np.uint8)
            offset += nbytes
        return out

    def scatter(self, block_id: int, data: npt.NDArray[np.uint8]) -> None:
        """Copy a flat ``uint8`` array (as made by :meth:`gather`) into block ``block_id``."""
        self._check(block_id)
        if data.dtype != np.uint8 or data.size != self.block_bytes:
            raise ValueError(f"data: expected {self.block_bytes} uint8 bytes, got "
                             f"{data.size} {data.dtype}")
        offset = 0
        for tensor, lead, nbytes in self._pieces:
            piece = tensor[(*lead, block_id)]
            src = data[offset:offset + nbytes]
            if _is_torch(piece):
                import torch

                piece.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(src),
                                                          non_blocking=False)
            else:
                piece.reshape(-1).view(np.uint8)[:] = src
            offset += nbytes
