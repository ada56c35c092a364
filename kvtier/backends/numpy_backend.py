"""The ``numpy`` backend: host memory standing in for a device.

It runs everywhere, so CI exercises the HBM tier's slot allocator, eviction and
``get_into`` paths through it; every copy is a synchronous ``numpy.copyto``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["NumpyBackend", "flat_bytes"]


def flat_bytes(array: npt.NDArray[Any], name: str = "buffer") -> npt.NDArray[np.uint8]:
    """A flat ``uint8`` view of a C-contiguous array, sharing its memory."""
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return array.reshape(-1).view(np.uint8)


class NumpyBackend:
    """Device backend over plain host memory.

    Parameters
    ----------
    device
        Must be ``None`` or ``"cpu"``.
    """

    name = "numpy"

    def __init__(self, device: str | None = None) -> None:
        if device not in (None, "cpu"):
            raise ValueError(f"device: the numpy backend only has 'cpu', got {device!r}")
        self.device = "cpu"
        #: Host arrays registered through :meth:`register_host` and not unregistered.
        self.registered: list[npt.NDArray[np.uint8]] = []

    def allocate(self, nbytes: int) -> npt.NDArray[np.uint8]:
        return np.empty(nbytes, dtype=np.uint8)

    def from_dlpack(self, obj: Any) -> npt.NDArray[np.uint8]:
        array = obj if isinstance(obj, np.ndarray) else np.from_dlpack(obj)
        if not array.flags.writeable:
            raise ValueError("buffer: must be writeable")
        return flat_bytes(array)

    def to_dlpack(self, buffer: npt.NDArray[np.uint8], offset: int, nbytes: int) -> Any:
        return buffer[offset:offset + nbytes]

    def to_device(self, src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8],
                  offset: int) -> None:
        np.copyto(dst[offset:offset + src.size], src, casting="no")

    def to_host(self, src: npt.NDArray[np.uint8], offset: int,
                dst: npt.NDArray[np.uint8]) -> None:
        np.copyto(dst, src[offset:offset + dst.size], casting="no")

    def copy(self, src: npt.NDArray[np.uint8], src_offset: int, dst: npt.NDArray[np.uint8],
             dst_offset: int, nbytes: int) -> None:
        np.copyto(dst[dst_offset:dst_offset + nbytes], src[src_offset:src_offset + nbytes],
                  casting="no")

    def empty_host(self, nbytes: int) -> npt.NDArray[np.uint8]:
        return np.empty(nbytes, dtype=np.uint8)

    def register_host(self, array: npt.NDArray[np.uint8]) -> Callable[[], None]:
        """Host memory is this backend's device memory, so registering it as pinned only
        checks it (writable, C-contiguous ``uint8``) and records it in ``registered``
        until the returned callable unregisters it."""
        buffer = flat_bytes(array, "array")
        if not buffer.flags.writeable:
            raise ValueError("array: host memory to register must be writeable")
        self.registered.append(buffer)
        return lambda: self.registered.remove(buffer)

    def synchronize(self) -> None:
        """Copies are synchronous: nothing to wait for."""

    def __repr__(self) -> str:
        return "<NumpyBackend cpu>"
