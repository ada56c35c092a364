"""The ``torch`` backend: CUDA device memory through PyTorch, or CPU tensors without CUDA.

On CUDA every copy runs on a side stream of this backend (so it overlaps the engine's
compute on its own stream), after that stream has waited for the caller's current stream
(so kvtier never reads a slot before the engine's kernels finished writing it). Host arrays
that are already pinned are copied directly; pageable ones go through two pinned staging
buffers (:class:`~kvtier.backends.staging.StagingPipeline`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.backends import require_module
from kvtier.backends.staging import StagingPipeline
from kvtier.errors import ConfigError

__all__ = ["TorchBackend"]

#: Staging chunk: big enough for full-speed DMA, small enough to overlap memcpy and DMA.
STAGING_CHUNK = 4 << 20


class TorchBackend:
    """Device backend over PyTorch tensors.

    Parameters
    ----------
    device
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``; ``None`` picks ``cuda`` when available.

    Raises
    ------
    BackendUnavailableError
        If PyTorch is not installed.
    ConfigError
        If a CUDA device is requested and none is available, or for other device types.
    """

    name = "torch"

    def __init__(self, device: str | None = None) -> None:
        torch = require_module("torch", "torch")
        self._torch = torch
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device: {device!r} is not a torch device: {exc}") from exc
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"device: {device!r} requested but torch sees no CUDA device")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ConfigError(f"device: the torch backend supports cpu and cuda, got {device!r}")
        self._dev = dev
        self.device = str(dev)
        self.is_cuda = dev.type == "cuda"
        self._lock = threading.Lock()
        self._stream: Any = None
        self._staging: StagingPipeline | None = None
        self._staging_tensors: list[Any] = []
        if self.is_cuda:
            self._stream = torch.cuda.Stream(device=dev)

    # ------------------------------------------------------------------ helpers
    def _pipeline(self) -> StagingPipeline:
        # Created on first use: two pinned buffers are 8 MiB of page-locked memory.
        if self._staging is None:
            torch = self._torch
            tensors = [torch.empty(STAGING_CHUNK, dtype=torch.uint8, pin_memory=True)
                       for _ in range(2)]
            events = [torch.cuda.Event() for _ in tensors]
            self._staging_tensors = tensors
            stream = self._stream
            self._staging = StagingPipeline(
                [t.numpy() for t in tensors],
                wait=lambda k: events[k].synchronize(),
                record=lambda k: events[k].record(stream))
        return self._staging

    def host_tensor(self, array: npt.NDArray[np.uint8]) -> Any:
        """``array`` as a CPU tensor sharing its memory, read-only arrays included.

        A DRAM tier's stored blocks are read-only views of its (registered) arena: they must
        reach the device as one DMA, not through the staging buffers. ``torch.from_numpy``
        only warns that torch has no read-only tensors; the tensor of a read-only array is
        used here only as the source of a copy, never written.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            return self._torch.from_numpy(array)

    def _pinned(self, array: npt.NDArray[np.uint8]) -> Any:
        """The array as a tensor if it lives in pinned memory, else ``None``."""
        tensor = self.host_tensor(array)
        return tensor if tensor.is_pinned() else None

    def _enter(self) -> Any:
        stream = self._stream
        stream.wait_stream(self._torch.cuda.current_stream(self._dev))
        return self._torch.cuda.stream(stream)

    def register_host(self, array: npt.NDArray[np.uint8]) -> Callable[[], None]:
        """Page-lock ``array``'s memory in place (``cudaHostRegister``) so copies from and
        to it are one DMA; returns the callable that unregisters it. Does nothing on CPU.

        Raises
        ------
        ConfigError
            If CUDA refuses the registration.
        """
        if not self.is_cuda:
            return lambda: None
        cudart = self._torch.cuda.cudart()
        ptr, nbytes = array.ctypes.data, array.nbytes
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise ConfigError(f"register_host: cudaHostRegister of {nbytes} bytes failed: {err}")
        return lambda: cudart.cudaHostUnregister(ptr)

    # --------------------------------------------------------------- protocol
    def allocate(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._dev)

    def from_dlpack(self, obj: Any) -> Any:
        torch = self._torch
        tensor = obj if isinstance(obj, torch.Tensor) else torch.from_dlpack(obj)
        if tensor.device != self._dev:
            raise ValueError(f"buffer: is on {tensor.device}, backend is {self.device}")
        if not tensor.is_contiguous():
            raise ValueError("buffer: must be contiguous")
        return tensor.detach().reshape(-1).view(torch.uint8)

    def to_dlpack(self, buffer: Any, offset: int, nbytes: int) -> Any:
        return buffer[offset:offset + nbytes]

    def to_device(self, src: npt.NDArray[np.uint8], dst: Any, offset: int) -> None:
        view = dst[offset:offset + src.size]
        if not self.is_cuda:
            np.copyto(view.numpy(), src, casting="no")
            return
        with self._lock, self._enter():
            pinned = self._pinned(src)
            if pinned is not None:
                view.copy_(pinned, non_blocking=True)
                self._stream.synchronize()  # the caller may reuse src once we return
                return
            staging = self._pipeline()
            tensors = self._staging_tensors
            staging.upload(src, lambda k, start, n: view[start:start + n].copy_(
                tensors[k][:n], non_blocking=True))

    def to_host(self, src: Any, offset: int, dst: npt.NDArray[np.uint8]) -> None:
        view = src[offset:offset + dst.size]
        if not self.is_cuda:
            np.copyto(dst, view.numpy(), casting="no")
            return
        with self._lock, self._enter():
            pinned = self._pinned(dst)
            if pinned is not None:
                pinned.copy_(view, non_blocking=True)
                return
            staging = self._pipeline()
            tensors = self._staging_tensors
            staging.download(dst, lambda k, start, n: tensors[k][:n].copy_(
                view[start:start + n], non_blocking=True))

    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None:
        target = dst[dst_offset:dst_offset + nbytes]
        source = src[src_offset:src_offset + nbytes]
        if not self.is_cuda:
            # numpy's memcpy: torch's CPU copy_ wakes its intra-op thread pool, which costs
            # milliseconds on a busy host.
            np.copyto(target.numpy(), source.numpy(), casting="no")
            return
        with self._lock, self._enter():
            target.copy_(source, non_blocking=True)

    def empty_host(self, nbytes: int) -> npt.NDArray[np.uint8]:
        if not self.is_cuda:
            return np.empty(nbytes, dtype=np.uint8)
        # From torch's caching host allocator: the array keeps the pinned block alive and
        # returns it to the cache when freed, so a device->host copy lands at full speed.
        return self._torch.empty(nbytes, dtype=self._torch.uint8,  # type: ignore[no-any-return]
                                 pin_memory=True).numpy()

    def synchronize(self) -> None:
        if self.is_cuda:
            self._stream.synchronize()

    def __repr__(self) -> str:
        return f"<TorchBackend {self.device}>"
