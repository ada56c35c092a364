"""Device backends: the protocol, the numpy and torch (CPU) backends, the staging pipeline,
backend selection and the import of foreign output buffers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.backends import DeviceBackend, DeviceOutput, get_backend, import_output
from kvtier.backends.numpy_backend import NumpyBackend
from kvtier.backends.staging import StagingPipeline
from kvtier.errors import BackendUnavailableError, ConfigError, ShapeMismatchError
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.hbm import HBMTier


class ByteArrayBackend:
    """An engine's own backend, written without importing kvtier: device memory is a
    bytearray, and every copy is counted."""

    name = "bytearray"
    device = "cpu"

    def __init__(self) -> None:
        self.copies = 0

    def allocate(self, nbytes: int) -> memoryview:
        return memoryview(bytearray(nbytes))

    def from_dlpack(self, obj: Any) -> memoryview:
        return memoryview(obj).cast("B")

    def to_dlpack(self, buffer: memoryview, offset: int, nbytes: int) -> Any:
        return np.frombuffer(buffer[offset:offset + nbytes], dtype=np.uint8)

    def to_device(self, src: np.ndarray, dst: memoryview, offset: int) -> None:
        self.copies += 1
        dst[offset:offset + src.size] = src.tobytes()

    def to_host(self, src: memoryview, offset: int, dst: np.ndarray) -> None:
        self.copies += 1
        dst[:] = np.frombuffer(src[offset:offset + dst.size], dtype=np.uint8)

    def copy(self, src: memoryview, src_offset: int, dst: memoryview, dst_offset: int,
             nbytes: int) -> None:
        dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]

    def empty_host(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def synchronize(self) -> None:
        pass


def backends() -> list[str]:
    names = ["numpy"]
    try:
        import torch  # noqa: F401

        names.append("torch")
    except ImportError:
        pass
    return names


def test_builtin_and_engine_backends_satisfy_protocol() -> None:
    assert isinstance(NumpyBackend(), DeviceBackend)
    assert isinstance(ByteArrayBackend(), DeviceBackend)
    assert not isinstance(object(), DeviceBackend)


async def test_engine_backend_drives_hbm_tier() -> None:
    engine = ByteArrayBackend()
    tier = HBMTier(4 * 512, block_bytes=512, backend=engine)
    block = sample_block(1, nbytes=512, dtype="<u2").reshape(16, 16)
    await tier.put(key_of(1), block)
    got = await tier.get(key_of(1))
    assert got is not None and got.shape == (16, 16) and got.tobytes() == block.tobytes()
    assert engine.copies == 2
    attached = HBMTier.attach(bytearray(2048), block_bytes=512, backend=engine)
    await attached.put(key_of(2), block)
    assert attached.num_slots == 4 and bytes(attached.buffer[:512]) == block.tobytes()


@pytest.mark.parametrize("name", backends())
def test_backend_copies_at_offsets(name: str) -> None:
    backend = get_backend(name)
    buf = backend.allocate(4096)
    src = np.arange(1000, dtype=np.uint32).view(np.uint8)[:3000]
    backend.to_device(src, buf, 1000)
    backend.synchronize()
    host = backend.empty_host(3000)
    backend.to_host(buf, 1000, host)
    backend.synchronize()
    assert host.tobytes() == src.tobytes()
    backend.copy(buf, 1000, buf, 0, 500)
    part = np.zeros(500, np.uint8)
    backend.to_host(buf, 0, part)
    backend.synchronize()
    assert part.tobytes() == src[:500].tobytes()
    read_only = src.copy()
    read_only.flags.writeable = False
    backend.to_device(read_only, buf, 0)
    backend.synchronize()
    backend.to_host(buf, 0, host)
    backend.synchronize()
    assert host.tobytes() == src.tobytes()


@pytest.mark.parametrize("name", backends())
def test_dlpack_export_import_share_memory(name: str) -> None:
    backend = get_backend(name)
    buf = backend.allocate(256)
    backend.to_device(np.full(256, 9, np.uint8), buf, 0)
    exported = backend.to_dlpack(buf, 64, 32)
    view = np.from_dlpack(exported)  # CPU here: numpy can import it
    assert view.shape == (32,) and (view == 9).all()
    again = backend.from_dlpack(exported)
    backend.to_device(np.full(32, 1, np.uint8), again, 0)
    backend.synchronize()
    host = np.zeros(256, np.uint8)
    backend.to_host(buf, 0, host)
    backend.synchronize()
    assert (host[64:96] == 1).all() and (host[:64] == 9).all() and (host[96:] == 9).all()


def test_get_backend_caches_and_refuses_unknown() -> None:
    assert get_backend("numpy") is get_backend("numpy")
    engine = ByteArrayBackend()
    assert get_backend(engine) is engine
    with pytest.raises(ConfigError, match="backend"):
        get_backend("tensorflow")
    with pytest.raises(TypeError, match="backend"):
        get_backend(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device"):
        get_backend("numpy", "cuda:0")


def test_torch_backend_refuses_missing_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="CUDA"):
        get_backend("torch", "cuda:0")
    with pytest.raises(ConfigError, match="device"):
        get_backend("torch", "mps-nonsense")


class DeferredDma:
    """Simulates an asynchronous DMA engine: each issued copy runs only when the pipeline
    waits on the buffer it used, so a pipeline that reuses a staging buffer too early, or
    reads one before waiting, produces wrong bytes."""

    def __init__(self, count: int) -> None:
        self.pending: list[list[Callable[[], None]]] = [[] for _ in range(count)]
        self.recorded: list[list[Callable[[], None]]] = [[] for _ in range(count)]
        self.issued: list[Callable[[], None]] = []

    def issue(self, op: Callable[[], None]) -> None:
        self.issued.append(op)

    def record(self, k: int) -> None:
        self.recorded[k].extend(self.issued)
        self.issued = []

    def wait(self, k: int) -> None:
        for op in self.recorded[k]:
            op()
        self.recorded[k] = []


@pytest.mark.parametrize("nbytes", [0, 1, 999, 1000, 1001, 4567])
def test_staging_pipeline_round_trip(nbytes: int) -> None:
    staging = [np.zeros(1000, np.uint8) for _ in range(2)]
    dma = DeferredDma(2)
    pipe = StagingPipeline(staging, wait=dma.wait, record=dma.record)
    device = np.zeros(5000, np.uint8)
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)

    def up(k: int, start: int, n: int) -> None:
        snapshot_len = n
        dma.issue(lambda: device.__setitem__(slice(start, start + snapshot_len),
                                             staging[k][:snapshot_len]))

    pipe.upload(src, up)
    for k in range(2):
        dma.wait(k)  # the caller's synchronize()
    assert device[:nbytes].tobytes() == src.tobytes()

    out = np.zeros(nbytes, np.uint8)

    def down(k: int, start: int, n: int) -> None:
        dma.issue(lambda: staging[k].__setitem__(slice(0, n), device[start:start + n]))

    pipe.download(out, down)
    assert out.tobytes() == src.tobytes()


def test_staging_pipeline_needs_buffers() -> None:
    with pytest.raises(ValueError, match="buffers"):
        StagingPipeline([], wait=lambda k: None, record=lambda k: None)


def test_import_output_rules() -> None:
    torch = pytest.importorskip("torch")
    f2 = np.dtype("<f2")
    out = import_output(torch.zeros((4, 8), dtype=torch.float16), f2, (4, 8))
    assert isinstance(out, DeviceOutput) and out.nbytes == 64 and out.backend.name == "torch"
    raw = import_output(torch.zeros((2, 32), dtype=torch.uint8), f2, (4, 8))
    assert isinstance(raw, DeviceOutput)
    grad = torch.zeros((4, 8), dtype=torch.float32, requires_grad=True)
    assert isinstance(import_output(grad, np.dtype("<f4"), (4, 8)), DeviceOutput)
    with pytest.raises(ShapeMismatchError, match="big-endian"):
        import_output(torch.zeros((4, 8), dtype=torch.float16), np.dtype(">f2"), (4, 8))
    with pytest.raises(ShapeMismatchError, match="float32"):
        import_output(torch.zeros((4, 8), dtype=torch.float32), f2, (4, 8))


def test_cuda_array_interface_without_cuda_is_a_clear_error() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA present")
    except ImportError:
        pass
    try:
        import cupy  # noqa: F401

        pytest.skip("cupy installed")
    except ImportError:
        pass

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "|u1", "data": (0, False),
                                    "version": 3}

    with pytest.raises(BackendUnavailableError, match="out: a CUDA buffer"):
        import_output(FakeCuda(), np.dtype("u1"), (4,))


def test_gpu_check_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/gpu_check.py exits 0 without CUDA, and its CPU smoke run checks bytes."""
    torch = pytest.importorskip("torch")
    from benchmarks import gpu_check

    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    out = tmp_path / "rows.json"
    assert gpu_check.main(["--allow-cpu", "--min-time", "0.01", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "byte-identical: copies yes, chain yes" in printed
    assert "0 mismatches" in printed and out.stat().st_size > 0


async def test_dram_get_into_torch_tensor_through_base_copy_into() -> None:
    """Tier.get_into's default path (base.copy_into) writes host blocks into tensors."""
    torch = pytest.importorskip("torch")
    from kvtier.tiers.dram import DRAMTier

    tier = DRAMTier(capacity=1 << 20)
    block = sample_block(8, dtype="<f4").reshape(16, 16)
    await tier.put(key_of(1), block)
    out = torch.zeros((16, 16), dtype=torch.float32)
    assert await tier.get_into(key_of(1), out) is True
    assert out.numpy().tobytes() == block.tobytes()
    wrong = torch.full((16, 8), 5.0, dtype=torch.float32)
    with pytest.raises(ShapeMismatchError):
        await tier.get_into(key_of(1), wrong)
    assert bool((wrong == 5.0).all())
