"""The ``cupy`` backend: CUDA device memory through CuPy.

Same scheme as the torch backend on CUDA: copies run on a side stream of this backend,
host arrays go through two pinned staging buffers (``cupyx.empty_pinned``) so the CPU and
the DMA engine overlap, and :meth:`CupyBackend.synchronize` waits for that stream only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.backends import require_module
from kvtier.backends.staging import StagingPipeline
from kvtier.errors import ConfigError

__all__ = ["CupyBackend"]

STAGING_CHUNK = 4 << 20


class CupyBackend:
    """Device backend over CuPy arrays.

    Parameters
    ----------
    device
        ``"cuda"``/``None`` (current device) or ``"cuda:N"``.

    Raises
    ------
    BackendUnavailableError
        If CuPy is not installed.
    """

    name = "cupy"

    def __init__(self, device: str | None = None) -> None:
        cupy = require_module("cupy", "cupy")
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        if device in (None, "cuda"):
            index = cupy.cuda.runtime.getDevice()
        elif isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
            index = int(device[5:])
        else:
            raise ConfigError(f"device: the cupy backend takes 'cuda' or 'cuda:N', got {device!r}")
        self.index = index
        self.device = f"cuda:{index}"
        self._lock = threading.Lock()
        with cupy.cuda.Device(index):
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._events = [cupy.cuda.Event(), cupy.cuda.Event()]
        pinned = [require_module("cupyx", "cupy").empty_pinned((STAGING_CHUNK,), dtype=np.uint8)
                  for _ in self._events]
        self._staging = StagingPipeline(
            pinned, wait=lambda k: self._events[k].synchronize(),
            record=lambda k: self._events[k].record(self._stream))
        self._pinned = pinned

    def register_host(self, array: npt.NDArray[np.uint8]) -> Callable[[], None]:
        """Page-lock ``array``'s memory in place (``cudaHostRegister``) so copies from and
        to it are one DMA; returns the callable that unregisters it."""
        ptr = array.ctypes.data
        self._runtime.hostRegister(ptr, array.nbytes, 0)
        return lambda: self._runtime.hostUnregister(ptr)

    def _memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._runtime.memcpyAsync(dst, src, nbytes, kind, self._stream.ptr)

    def _wait_current(self) -> None:
        # Order our copies after whatever the caller queued on its current stream.
        self._stream.wait_event(self._cupy.cuda.get_current_stream().record())

    def allocate(self, nbytes: int) -> Any:
        with self._cupy.cuda.Device(self.index):
            return self._cupy.empty(nbytes, dtype=self._cupy.uint8)

    def from_dlpack(self, obj: Any) -> Any:
        cupy = self._cupy
        array = obj if isinstance(obj, cupy.ndarray) else cupy.from_dlpack(obj)
        if array.device.id != self.index:
            raise ValueError(f"buffer: is on cuda:{array.device.id}, backend is {self.device}")
        if not array.flags.c_contiguous:
            raise ValueError("buffer: must be C-contiguous")
        return array.reshape(-1).view(cupy.uint8)

    def to_dlpack(self, buffer: Any, offset: int, nbytes: int) -> Any:
        return buffer[offset:offset + nbytes]

    def to_device(self, src: npt.NDArray[np.uint8], dst: Any, offset: int) -> None:
        base = int(dst.data.ptr) + offset
        with self._lock:
            self._wait_current()
            self._staging.upload(src, lambda k, start, n: self._memcpy(
                base + start, self._pinned[k].ctypes.data, n,
                self._runtime.memcpyHostToDevice))

    def to_host(self, src: Any, offset: int, dst: npt.NDArray[np.uint8]) -> None:
        base = int(src.data.ptr) + offset
        with self._lock:
            self._wait_current()
            self._staging.download(dst, lambda k, start, n: self._memcpy(
                self._pinned[k].ctypes.data, base + start, n,
                self._runtime.memcpyDeviceToHost))

    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None:
        with self._lock:
            self._wait_current()
            self._memcpy(int(dst.data.ptr) + dst_offset, int(src.data.ptr) + src_offset,
                         nbytes, self._runtime.memcpyDeviceToDevice)

    def empty_host(self, nbytes: int) -> npt.NDArray[np.uint8]:
        return np.empty(nbytes, dtype=np.uint8)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def __repr__(self) -> str:
        return f"<CupyBackend {self.device}>"
