"""Gather and scatter one engine block across all layers of a paged KV cache.

An engine keeps one paged tensor per layer. kvtier stores one engine block across *all* layers
as one flat ``uint8`` array: for each layer in registration order, the block's slice of that
layer (for layouts such as ``(2, num_blocks, ...)`` with K and V split ahead of the block
dimension, the K slice then the V slice). Gathering is the one copy a save needs (after it the
engine may reuse its pages); scattering is the one copy a load needs after ``get_many_into``
filled a host staging buffer. Both work on many blocks at once: one indexed copy per layer
(per K/V plane) for all the blocks, never one per block, so a 64-block prompt of a 4-layer
model is 4 copies. When the layers are views of one cross-layer buffer (a block of every layer
is one contiguous region), it is one indexed copy in all. Works on numpy arrays and on torch
tensors (CPU tensors through numpy views, CUDA ones with torch's indexed copies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
        pieces: list[Any] = []  # (num_blocks, ...) contiguous slices, in block-byte order
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
                pieces.append(tensor[lead] if lead else tensor)
                self.block_bytes += per_block
        self.num_blocks = num_blocks
        self.layer_names = list(layers)
        # Cross-layer layout: one block of every layer is one contiguous region.
        blocks = _cross_layer_view(tensors, num_blocks, self.block_bytes)
        if blocks is None:
            for name, tensor in layers.items():
                if not _contiguous(tensor):
                    raise ValueError(f"layers[{name!r}]: expected a C-contiguous tensor (or "
                                     "views of one cross-layer buffer)")
            planes = [_as_plane(piece, num_blocks) for piece in pieces]
        else:
            planes = [blocks]
        self._cross_layer = blocks is not None
        # (plane, byte offset in a block, bytes): a plane is a (num_blocks, bytes) uint8 view.
        self._planes: list[tuple[Any, int, int]] = []
        offset = 0
        for plane in planes:
            nbytes = int(plane.shape[1])
            self._planes.append((_host_view(plane), offset, nbytes))
            offset += nbytes

    @property
    def cross_layer(self) -> bool:
        """Whether one block across all layers is one contiguous region of the engine's buffer
        (vLLM's cross-layer layouts): then a gather or scatter is one copy, not one per layer."""
        return self._cross_layer

    def _indices(self, block_ids: Sequence[int]) -> npt.NDArray[np.intp]:
        ids = np.asarray(block_ids, dtype=np.intp).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = next(b for b in block_ids if not 0 <= b < self.num_blocks)
            raise IndexError(f"block_id {bad} outside 0..{self.num_blocks - 1}")
        return ids

    def empty(self, count: int | None = None) -> npt.NDArray[np.uint8]:
        """A host staging buffer for one block (``count=None``), or a ``(count, block_bytes)``
        buffer whose rows are blocks."""
        shape = self.block_bytes if count is None else (count, self.block_bytes)
        return np.empty(shape, dtype=np.uint8)

    def gather_many(self, block_ids: Sequence[int],
                    out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """Copy blocks ``block_ids`` of every layer into rows of a ``(len(block_ids),
        block_bytes)`` ``uint8`` host array (``out``, or a new one): one indexed copy per
        plane for all the blocks."""
        ids = self._indices(block_ids)
        if out is None:
            out = self.empty(len(ids))
        elif out.dtype != np.uint8 or out.shape != (len(ids), self.block_bytes):
            raise ValueError(f"out: expected a ({len(ids)}, {self.block_bytes}) uint8 array, "
                             f"got {out.shape} {out.dtype}")
        for plane, offset, nbytes in self._planes:
            _take(plane, ids, out[:, offset:offset + nbytes])
        return out

    def scatter_many(self, block_ids: Sequence[int], data: npt.NDArray[np.uint8]) -> None:
        """Copy the rows of a ``(len(block_ids), block_bytes)`` ``uint8`` array (as made by
        :meth:`gather_many`) into blocks ``block_ids``: one indexed copy per plane."""
        ids = self._indices(block_ids)
        if data.dtype != np.uint8 or data.shape != (len(ids), self.block_bytes):
            raise ValueError(f"data: expected a ({len(ids)}, {self.block_bytes}) uint8 array, "
                             f"got {data.shape} {data.dtype}")
        source = data if _is_host(self._planes[0][0]) else _to_device(data, self._planes[0][0])
        for plane, offset, nbytes in self._planes:
            _put(plane, ids, source[:, offset:offset + nbytes])

    def gather(self, block_id: int) -> npt.NDArray[np.uint8]:
        """Copy block ``block_id`` of every layer into a new flat ``uint8`` host array."""
        row: npt.NDArray[np.uint8] = self.gather_many([block_id])[0]
        return row

    def scatter(self, block_id: int, data: npt.NDArray[np.uint8]) -> None:
        """Copy a flat ``uint8`` array (as made by :meth:`gather`) into block ``block_id``."""
        if data.dtype != np.uint8 or data.size != self.block_bytes:
            raise ValueError(f"data: expected {self.block_bytes} uint8 bytes, got "
                             f"{data.size} {data.dtype}")
        self.scatter_many([block_id], data.reshape(1, -1))


def _itemsize(tensor: Any) -> int:
    return int(tensor.element_size() if _is_torch(tensor) else tensor.itemsize)


def _contiguous(tensor: Any) -> bool:
    return bool(tensor.is_contiguous() if _is_torch(tensor) else tensor.flags.c_contiguous)


def _address(tensor: Any) -> int:
    return int(tensor.data_ptr() if _is_torch(tensor) else tensor.__array_interface__["data"][0])


def _as_plane(piece: Any, num_blocks: int) -> Any:
    """A contiguous ``(num_blocks, ...)`` piece as a ``(num_blocks, bytes)`` uint8 view."""
    if _is_torch(piece):
        import torch

        return piece.reshape(num_blocks, -1).view(torch.uint8)
    return piece.reshape(num_blocks, -1).view(np.uint8)


def _host_view(plane: Any) -> Any:
    """A CPU torch plane as a numpy view of the same memory: numpy's indexed copies are one
    plain loop, where torch's CPU ``index_copy_`` wakes its intra-op thread pool (which
    costs milliseconds next to the engine's own threads on a busy host). Others unchanged."""
    if _is_torch(plane) and plane.device.type == "cpu":
        return plane.numpy()
    return plane


def _is_host(plane: Any) -> bool:
    return isinstance(plane, np.ndarray)


def _to_device(data: npt.NDArray[np.uint8], plane: Any) -> Any:
    import torch

    return torch.from_numpy(data).to(plane.device)


def _take(plane: Any, ids: npt.NDArray[np.intp], out: npt.NDArray[np.uint8]) -> None:
    if _is_host(plane):
        if out.flags.c_contiguous:
            # ids are checked: "clip" never clips, and unlike "raise" it writes ``out`` in
            # place.
            np.take(plane, ids, axis=0, out=out, mode="clip")
            return
        # A plane's columns of a block-major buffer (every plane but a lone one): np.take
        # buffers an ``out`` that is not contiguous, allocating its size per call (a save
        # under memory pressure failed with MemoryError((4, 524288), uint8)); a copy per
        # block allocates nothing, and measured 185-200 ms against np.take's 265-290 for a
        # 256 MiB save over 32 planes.
        for row, block in zip(out, ids, strict=True):
            np.copyto(row, plane[block])
        return
    import torch

    index = torch.from_numpy(ids).to(plane.device)
    out[:] = plane.index_select(0, index).cpu().numpy()


def _put(plane: Any, ids: npt.NDArray[np.intp], source: Any) -> None:
    if _is_host(plane):
        plane[ids] = source
        return
    import torch

    plane.index_copy_(0, torch.from_numpy(ids).to(plane.device), source)
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
