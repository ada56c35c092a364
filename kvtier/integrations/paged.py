"""Gather and scatter one engine block across all layers of a paged KV cache.

An engine keeps one paged tensor per layer. kvtier stores one engine block across *all* layers
as one flat ``uint8`` array: for each layer in registration order, the block's slice of that
layer (for layouts such as ``(2, num_blocks, ...)`` with K and V split ahead of the block
dimension, the K slice then the V slice). Gathering is the one copy a save needs (after it the
engine may reuse its pages); scattering is the one copy a load needs after ``get_many_into``
filled a host staging buffer. When the layers are views of one cross-layer buffer (a block of
every layer is one contiguous region), either is a single contiguous copy. Works on numpy
arrays and on torch tensors (CPU or CUDA).
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
        self._pieces: list[tuple[Any, tuple[int, ...], int]] = []  # (tensor, lead index, bytes)
        self.block_bytes = 0
        tensors = list(layers.values())
        for name, tensor in layers.items():
            shape = tuple(int(s) for s in tensor.shape)
            if shape and shape[0] == num_blocks:
                dim = 0
            elif len(shape) > 1 and shape[1] == num_blocks:
                dim = 1
            else:
                raise ValueError(f"layers[{name!r}]: no block dimension of size {num_blocks} "
                                 f"first or second in shape {shape}")
            per_block = int(np.prod(shape[dim + 1:], dtype=np.int64)) * _itemsize(tensor)
            for lead in product(*(range(s) for s in shape[:dim])):
                self._pieces.append((tensor, lead, per_block))
                self.block_bytes += per_block
        self.num_blocks = num_blocks
        self.layer_names = list(layers)
        # Cross-layer layout: one block of every layer is one contiguous region.
        self._blocks = _cross_layer_view(tensors, num_blocks, self.block_bytes)
        if self._blocks is None:
            for name, tensor in layers.items():
                if not _contiguous(tensor):
                    raise ValueError(f"layers[{name!r}]: expected a C-contiguous tensor (or "
                                     "views of one cross-layer buffer)")

    @property
    def cross_layer(self) -> bool:
        """Whether one block across all layers is one contiguous region of the engine's buffer
        (vLLM's cross-layer layouts): then a gather or scatter is one copy, not one per layer."""
        return self._blocks is not None

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
        if self._blocks is not None:
            _copy_out(self._blocks[block_id], out)
            return out
        offset = 0
        for tensor, lead, nbytes in self._pieces:
            _copy_out(_raw(tensor[(*lead, block_id)]), out[offset:offset + nbytes])
            offset += nbytes
        return out

    def scatter(self, block_id: int, data: npt.NDArray[np.uint8]) -> None:
        """Copy a flat ``uint8`` array (as made by :meth:`gather`) into block ``block_id``."""
        self._check(block_id)
        if data.dtype != np.uint8 or data.size != self.block_bytes:
            raise ValueError(f"data: expected {self.block_bytes} uint8 bytes, got "
                             f"{data.size} {data.dtype}")
        if self._blocks is not None:
            _copy_in(self._blocks[block_id], data)
            return
        offset = 0
        for tensor, lead, nbytes in self._pieces:
            _copy_in(_raw(tensor[(*lead, block_id)]), data[offset:offset + nbytes])
            offset += nbytes


def _itemsize(tensor: Any) -> int:
    return int(tensor.element_size() if _is_torch(tensor) else tensor.itemsize)


def _contiguous(tensor: Any) -> bool:
    return bool(tensor.is_contiguous() if _is_torch(tensor) else tensor.flags.c_contiguous)


def _address(tensor: Any) -> int:
    return int(tensor.data_ptr() if _is_torch(tensor) else tensor.__array_interface__["data"][0])


def _raw(piece: Any) -> Any:
    """A contiguous piece as a flat uint8 view (no copy)."""
    if _is_torch(piece):
        import torch

        return piece.reshape(-1).view(torch.uint8)
    return piece.reshape(-1).view(np.uint8)


def _copy_out(raw: Any, out: npt.NDArray[np.uint8]) -> None:
    out[:] = raw.cpu().numpy() if _is_torch(raw) else raw


def _copy_in(raw: Any, src: npt.NDArray[np.uint8]) -> None:
    if _is_torch(raw):
        import torch

        raw.copy_(torch.from_numpy(src))
    else:
        raw[:] = src


def _cross_layer_view(tensors: list[Any], num_blocks: int, block_bytes: int) -> Any:
    """``(num_blocks, block_bytes)`` uint8 view when the layers are views of one buffer in
    which block ``b`` of every layer, in registration order, is one contiguous region (vLLM's
    cross-layer layouts); ``None`` otherwise. Its bytes equal what the per-layer path makes."""
    first = tensors[0]
    torch_ = _is_torch(first)
    expected = _address(first)
    for tensor in tensors:
        if _is_torch(tensor) != torch_ or int(tensor.shape[0]) != num_blocks:
            return None
        stride0 = (tensor.stride(0) * tensor.element_size() if torch_ else tensor.strides[0])
        if (stride0 != block_bytes or _address(tensor) != expected
                or not _contiguous(tensor[0])
                or (torch_ and tensor.device != first.device)):
            return None
        expected += int(np.prod(tensor.shape[1:], dtype=np.int64)) * _itemsize(tensor)
    if torch_:
        import torch

        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(first.untyped_storage(), first.storage_offset() * first.element_size(),
                  (num_blocks, block_bytes), (block_bytes, 1))
        return view
    item = first.itemsize
    if block_bytes % item:
        return None
    strided = np.lib.stride_tricks.as_strided(first, shape=(num_blocks, block_bytes // item),
                                              strides=(block_bytes, item))
    return strided.view(np.uint8)
