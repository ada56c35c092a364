"""Device backends: how kvtier moves bytes between host memory and a device buffer.

A :class:`DeviceBackend` is a small structural protocol, so an inference engine can satisfy
it with its own object without importing kvtier. Device buffers are opaque to kvtier: the
backend allocates them, imports an engine's buffer as a flat byte view, and copies between a
byte offset of a device buffer and a host ``numpy`` array.

Built-in backends (:func:`get_backend`):

``numpy``
    Host memory standing in for a device; what CI exercises.
``torch``
    CUDA when present (pinned staging buffers, non-blocking copies on a side stream), else
    CPU tensors. Needs ``pip install 'kvtier[torch]'``.
``cupy``
    CUDA through CuPy. Needs ``pip install 'kvtier[cupy]'``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvtier.errors import BackendUnavailableError, ConfigError, ShapeMismatchError

__all__ = [
    "BACKENDS",
    "DeviceBackend",
    "DeviceOutput",
    "backend_for",
    "get_backend",
    "import_output",
    "require_module",
]

#: Backend name -> ``"module:Class"``; modules are imported on first use.
BACKENDS: dict[str, str] = {
    "numpy": "kvtier.backends.numpy_backend:NumpyBackend",
    "torch": "kvtier.backends.torch_backend:TorchBackend",
    "cupy": "kvtier.backends.cupy_backend:CupyBackend",
}
_EXTRA = {"torch": "torch", "cupy": "cupy"}
_cache: dict[tuple[str, str | None], DeviceBackend] = {}
_cache_lock = threading.Lock()


@runtime_checkable
class DeviceBackend(Protocol):
    """What kvtier needs from a device.

    Buffers are flat ``uint8`` device arrays (whatever type the backend uses); offsets and
    sizes are in bytes. Copies may be asynchronous; :meth:`synchronize` waits for every copy
    this backend issued. Host arrays are C-contiguous ``numpy`` arrays of ``uint8``.
    """

    name: str
    device: str

    def allocate(self, nbytes: int) -> Any:
        """Return a new flat ``uint8`` device buffer of ``nbytes`` bytes (contents undefined)."""
        ...

    def from_dlpack(self, obj: Any) -> Any:
        """Import a C-contiguous device array (DLPack, native type) as a flat byte view that
        shares its memory."""
        ...

    def to_dlpack(self, buffer: Any, offset: int, nbytes: int) -> Any:
        """Export ``nbytes`` bytes of ``buffer`` at ``offset`` as an object with
        ``__dlpack__`` (a view, not a copy)."""
        ...

    def to_device(self, src: npt.NDArray[np.uint8], dst: Any, offset: int) -> None:
        """Copy host bytes ``src`` into ``dst`` at byte ``offset``; ``src`` may be reused once
        this returns."""
        ...

    def to_host(self, src: Any, offset: int, dst: npt.NDArray[np.uint8]) -> None:
        """Copy ``dst.size`` bytes of ``src`` at ``offset`` into host array ``dst``; ``dst``
        holds them after :meth:`synchronize`."""
        ...

    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None:
        """Device-to-device copy between two buffers of this backend."""
        ...

    def empty_host(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A host array to receive a device-to-host copy (pinned where that is faster)."""
        ...

    def synchronize(self) -> None:
        """Wait until every copy issued through this backend has completed."""
        ...


def require_module(module: str, backend: str) -> Any:
    """Import an optional dependency, or raise :class:`BackendUnavailableError` naming the
    extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA.get(backend, backend)
        raise BackendUnavailableError(
            f"backend {backend!r} needs the {module!r} package: pip install 'kvtier[{extra}]'"
        ) from exc


def get_backend(name: str | DeviceBackend, device: str | None = None) -> DeviceBackend:
    """Return the backend called ``name`` for ``device`` (instances are cached and shared).

    Parameters
    ----------
    name
        ``"numpy"``, ``"torch"`` or ``"cupy"``; an object satisfying :class:`DeviceBackend`
        is returned unchanged.
    device
        Backend-specific device string (``"cuda:0"``, ``"cpu"``); ``None`` picks the default.

    Raises
    ------
    ConfigError
        For an unknown backend name.
    BackendUnavailableError
        If the backend's optional dependency is missing.
    """
    if not isinstance(name, str):
        if isinstance(name, DeviceBackend):
            return name
        raise TypeError(f"backend: expected a backend name or DeviceBackend, got "
                        f"{type(name).__name__}")
    if name not in BACKENDS:
        raise ConfigError(f"backend: unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    with _cache_lock:
        backend = _cache.get((name, device))
        if backend is None:
            module_name, _, attr = BACKENDS[name].partition(":")
            cls = getattr(importlib.import_module(module_name), attr)
            backend = cls(device)
            _cache[(name, device)] = backend
            # Also cache under the resolved device so "cuda" and "cuda:0" share one stream.
            _cache.setdefault((name, backend.device), backend)
        return backend


def backend_for(array: Any) -> DeviceBackend:
    """The built-in backend that owns ``array`` (numpy, torch tensor, cupy array)."""
    if isinstance(array, np.ndarray):
        return get_backend("numpy")
    module = type(array).__module__.split(".")[0]
    if module == "torch":
        return get_backend("torch", str(array.device))
    if module == "cupy":
        return get_backend("cupy", f"cuda:{array.device.id}")
    raise TypeError(f"buffer: no built-in backend handles {type(array).__name__} "
                    f"(pass backend=)")


@dataclass(frozen=True)
class DeviceOutput:
    """A caller-owned device buffer accepted as a ``get_into`` target.

    Attributes
    ----------
    backend
        The backend that writes into it.
    flat
        Flat ``uint8`` view sharing the caller's memory.
    nbytes
        Its size in bytes.
    """

    backend: DeviceBackend
    flat: Any
    nbytes: int

    def write(self, block: npt.NDArray[np.generic]) -> None:
        """Copy host ``block`` (same byte size) into the buffer and wait for it."""
        self.backend.to_device(block.reshape(-1).view(np.uint8), self.flat, 0)
        self.backend.synchronize()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _check(dtype: np.dtype[Any], shape: tuple[int, ...], out_dtype: str, out_shape: tuple[int, ...],
           out_nbytes: int, contiguous: bool, name: str) -> None:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not contiguous:
        raise ShapeMismatchError(f"{name}: must be C-contiguous")
    if dtype.byteorder == ">":
        raise ShapeMismatchError(f"{name}: big-endian block {dtype.str} cannot be copied into a "
                                 f"device buffer")
    if out_dtype == dtype.name and out_shape == shape:
        return
    if out_dtype == "uint8" and out_nbytes == nbytes:
        return
    raise ShapeMismatchError(
        f"{name}: block is {dtype.name}{list(shape)} ({nbytes} bytes), "
        f"buffer is {out_dtype}{list(out_shape)} ({out_nbytes} bytes)")


def _import_cuda(out: object, name: str, convert: Callable[[Any], Any]) -> Any:
    """Wrap a foreign CUDA buffer as a CuPy array or torch tensor, whichever is usable."""
    for module, backend in (("cupy", "cupy"), ("torch", "torch")):
        try:
            lib = require_module(module, backend)
        except BackendUnavailableError:
            continue
        if module == "torch" and not lib.cuda.is_available():
            continue
        return convert(lib)
    raise BackendUnavailableError(
        f"{name}: a CUDA buffer needs CuPy or PyTorch with CUDA: "
        f"pip install 'kvtier[cupy]' or 'kvtier[torch]'")


def import_output(out: object, dtype: np.dtype[Any], shape: tuple[int, ...],
                  name: str = "out") -> npt.NDArray[np.generic] | DeviceOutput:
    """Resolve a non-numpy ``get_into`` target and check it against a block's dtype/shape.

    CPU DLPack objects become numpy arrays (checked by the caller like any numpy ``out``);
    torch tensors, CuPy arrays, ``__cuda_array_interface__`` and device DLPack objects become
    a :class:`DeviceOutput`. A raw ``uint8`` buffer of exactly the block's size is accepted
    whatever its shape; otherwise dtype (by name: ``float16``, ``bfloat16``...) and shape must
    match the block.

    Raises
    ------
    TypeError
        If ``out`` is no array kvtier can write into.
    ShapeMismatchError
        On a dtype, shape or size mismatch or a non-contiguous buffer (nothing is written).
    BackendUnavailableError
        If the backend the buffer needs is not installed.
    """
    module = type(out).__module__.split(".")[0]
    if module not in ("torch", "cupy"):
        if hasattr(out, "__cuda_array_interface__"):
            out = _import_cuda(out, name, lambda m: m.asarray(out) if m.__name__ == "cupy"
                               else m.as_tensor(out, device="cuda"))
        elif hasattr(out, "__dlpack__") and hasattr(out, "__dlpack_device__"):
            device_type = int(out.__dlpack_device__()[0])
            if device_type in (1, 3):  # kDLCPU, kDLCUDAHost: host memory numpy can view
                return np.from_dlpack(out)
            out = _import_cuda(out, name, lambda m: m.from_dlpack(out))
        else:
            raise TypeError(f"{name}: expected numpy.ndarray, a torch/cupy array or a DLPack "
                            f"object, got {type(out).__name__}")
        module = type(out).__module__.split(".")[0]
    array: Any = out
    if module == "torch" and array.requires_grad:
        array = array.detach()
    out_shape = tuple(int(d) for d in array.shape)
    contiguous = bool(array.is_contiguous()) if module == "torch" else \
        bool(array.flags.c_contiguous)
    out_nbytes = int(array.nbytes)
    _check(dtype, shape, _dtype_name(array.dtype), out_shape, out_nbytes, contiguous, name)
    backend = backend_for(array)
    return DeviceOutput(backend, backend.from_dlpack(array), out_nbytes)
