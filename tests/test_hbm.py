"""HBM tier: the conformance suite over a numpy-backed slot pool (and torch CPU tensors when
torch is installed), plus what is specific to slots, URLs and device outputs."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kvtier.backends.numpy_backend import NumpyBackend
from kvtier.errors import (
    BackendUnavailableError,
    BlockTooLargeError,
    ConfigError,
    ShapeMismatchError,
)
from kvtier.testing.conformance import BLOCK_BYTES, TierConformance, key_of, sample_block
from kvtier.testing.fakes import DLPackOnly
from kvtier.testing.slow import slow_worker_threads
from kvtier.tiers.base import Tier
from kvtier.tiers.hbm import HBMTier
from kvtier.tiers.registry import tier_from_url

#: Slots a conformance tier gets when the suite asks for an unbounded one.
UNBOUNDED_SLOTS = 64


class TestHBMNumpyConformance(TierConformance):
    backend = "numpy"

    async def make_tier(self, capacity: int | None) -> Tier:
        # A slot pool always has a size; "unbounded" means more slots than any test fills.
        return HBMTier(capacity if capacity is not None else UNBOUNDED_SLOTS * BLOCK_BYTES,
                       block_bytes=BLOCK_BYTES, backend=self.backend)

    def capacity_for(self, n_blocks: int, block_nbytes: int = BLOCK_BYTES) -> int:
        # Every block occupies one whole slot of BLOCK_BYTES.
        return n_blocks * BLOCK_BYTES


class TestHBMTorchCPUConformance(TestHBMNumpyConformance):
    backend = "torch"

    @pytest.fixture(autouse=True)
    def _need_torch(self) -> None:
        pytest.importorskip("torch")


class TestHBMThreadedCopiesConformance(TestHBMNumpyConformance):
    """Copies in a worker thread, as on a CUDA device (a copy there is waited for off the
    loop); the numpy pool makes the path run on any machine."""

    async def make_tier(self, capacity: int | None) -> Tier:
        tier = await super().make_tier(capacity)
        assert isinstance(tier, HBMTier)
        tier._inline_copies = False  # what _copies_are_synchronous says of a CUDA backend
        return tier


async def test_block_metadata_and_slot_accounting() -> None:
    tier = HBMTier(4 * 4096, block_bytes=4096, backend="numpy")
    block = sample_block(1, nbytes=1000, dtype="<f4").reshape(10, 25)
    await tier.put(key_of(1), block)
    assert tier.used == 4096 and tier.capacity == 4 * 4096 and tier.free_slots == 3
    slot = tier.slot_of(key_of(1))
    assert slot == 0
    raw = tier.buffer[slot * 4096: slot * 4096 + block.nbytes]
    assert raw.tobytes() == block.tobytes()
    got = await tier.get(key_of(1))
    assert got is not None and got.dtype == np.float32 and got.shape == (10, 25)
    assert not np.shares_memory(got, tier.buffer)  # a copy: the slot may be reused later
    assert await tier.delete(key_of(1)) and tier.used == 0 and tier.free_slots == 4


async def test_block_larger_than_slot_rejected() -> None:
    tier = HBMTier(8 * 1024, block_bytes=1024, backend="numpy")
    with pytest.raises(BlockTooLargeError, match="slot"):
        await tier.put(key_of(1), np.zeros(1025, np.uint8))
    assert tier.used == 0 and tier.free_slots == 8


def test_from_url() -> None:
    tier = tier_from_url("hbm://?capacity=1MiB&block_bytes=64KiB&backend=numpy")
    assert isinstance(tier, HBMTier)
    assert tier.capacity == 1 << 20 and tier.num_slots == 16 and tier.block_bytes == 64 << 10
    assert tier.stats()["backend"] == "numpy" and tier.stats()["slots"] == 16
    rounded = tier_from_url("hbm://?capacity=100KiB&block_bytes=64KiB&backend=numpy")
    assert rounded.capacity == 64 << 10


@pytest.mark.parametrize(("url", "match"), [
    ("hbm://?block_bytes=1MiB&backend=numpy", "capacity"),
    ("hbm://?capacity=8MiB&backend=numpy", "block_bytes"),
    ("hbm://?capacity=1KiB&block_bytes=1MiB&backend=numpy", "capacity"),
    ("hbm://?capacity=8MiB&block_bytes=1MiB&backend=jax", "backend"),
    ("hbm://?capacity=8MiB&block_bytes=1MiB&backend=numpy&device=cuda:0", "device"),
    ("hbm://?capacity=8MiB&block_bytes=0&backend=numpy", "block_bytes"),
    ("hbm://?capacity=8MiB&block_bytes=1MiB&bakend=numpy", "bakend"),
    ("hbm://host?capacity=8MiB&block_bytes=1MiB", "host"),
])
def test_from_url_rejects(url: str, match: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=match):
        tier_from_url(url)


def test_missing_optional_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvtier import backends

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    monkeypatch.setattr(backends, "_cache", {})
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvtier\[cupy\]'"):
        HBMTier(1 << 20, block_bytes=1 << 16, backend="cupy")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvtier\[torch\]'"):
        tier_from_url("hbm://?capacity=1MiB&block_bytes=64KiB")


async def test_get_into_torch_tensor_from_numpy_pool() -> None:
    torch = pytest.importorskip("torch")
    tier = HBMTier(4 * 1024, block_bytes=1024, backend="numpy")
    block = sample_block(4, dtype="<f2").reshape(8, 64)
    await tier.put(key_of(1), block)
    out = torch.zeros((8, 64), dtype=torch.float16)
    assert await tier.get_into(key_of(1), out) is True
    assert out.numpy().tobytes() == block.tobytes()
    raw = torch.zeros(block.nbytes, dtype=torch.uint8)
    assert await tier.get_into(key_of(1), raw) is True
    assert raw.numpy().tobytes() == block.tobytes()


async def test_abandoned_device_get_into_ends_before_it_returns() -> None:
    """A copy into a device buffer cannot be taken back once queued: with copies in a worker
    thread (a CUDA pool), a get_into that is given up on returns only after its copy ended,
    so the buffer the caller then reuses is never written afterwards."""
    torch = pytest.importorskip("torch")
    threads = slow_worker_threads()
    tier = HBMTier(4 * 1024, block_bytes=1024, backend="torch")
    tier._inline_copies = False  # what _copies_are_synchronous says of a CUDA backend
    block = sample_block(4, dtype="<f2").reshape(8, 64)
    await tier.put(key_of(1), block)
    out = torch.zeros((8, 64), dtype=torch.float16)
    threads.delay = 0.3
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await tier.get_into(key_of(1), out)
    threads.delay = 0.0
    out.fill_(7)  # the caller reuses its buffer
    await threads.idle()
    assert bool((out == 7).all())
    await tier.aclose()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("case", ["dtype", "shape", "too-small", "non-contiguous", "bf16"])
async def test_get_into_bad_torch_buffer_untouched(backend: str, case: str) -> None:
    torch = pytest.importorskip("torch")
    tier = HBMTier(4 * 1024, block_bytes=1024, backend=backend)
    await tier.put(key_of(1), sample_block(3, dtype="<f2").reshape(8, 64))
    out = {
        "dtype": torch.full((8, 64), 7, dtype=torch.float32),
        "shape": torch.full((64, 8), 7, dtype=torch.float16),
        "too-small": torch.full((100,), 7, dtype=torch.uint8),
        "non-contiguous": torch.full((8, 128), 7, dtype=torch.float16)[:, ::2],
        "bf16": torch.full((8, 64), 7, dtype=torch.bfloat16),
    }[case]
    before = out.clone()
    with pytest.raises(ShapeMismatchError):
        await tier.get_into(key_of(1), out)
    assert torch.equal(out, before)


async def test_get_into_cpu_dlpack_object() -> None:
    tier = HBMTier(4 * 1024, block_bytes=1024, backend="numpy")
    block = sample_block(5, dtype="<u2").reshape(4, 128)
    await tier.put(key_of(1), block)
    target = np.zeros((4, 128), np.uint16)
    assert await tier.get_into(key_of(1), DLPackOnly(target)) is True
    assert target.tobytes() == block.tobytes()
    wrong = np.full((4, 64), 3, np.uint16)
    with pytest.raises(ShapeMismatchError):
        await tier.get_into(key_of(1), DLPackOnly(wrong))
    assert (wrong == 3).all()
    with pytest.raises(TypeError, match="out"):
        await tier.get_into(key_of(1), [0] * 512)  # type: ignore[arg-type]


class _DeviceLikeBackend(NumpyBackend):
    """numpy memory behind a backend that, like a GPU's, needs ``synchronize()`` to finish
    its copies; it records the thread each synchronize ran on and takes a while."""

    name = "devicelike"

    def __init__(self) -> None:
        super().__init__()
        self.sync_threads: list[int] = []

    def synchronize(self) -> None:
        self.sync_threads.append(threading.get_ident())
        time.sleep(0.01)  # a device still copying


async def test_device_synchronize_runs_off_the_event_loop() -> None:
    # Issue 9, bug 7: HBMTier called synchronize() inline, blocking the loop for as long as
    # the device took.
    backend = _DeviceLikeBackend()
    tier = HBMTier(4 * BLOCK_BYTES, block_bytes=BLOCK_BYTES, backend=backend)
    loop_thread = threading.get_ident()
    await tier.put(key_of(1), sample_block(1))
    got = await tier.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(1).tobytes()
    out = np.empty(BLOCK_BYTES, np.uint8)
    assert await tier.get_into(key_of(1), out)
    assert out.tobytes() == sample_block(1).tobytes()
    for i in range(2, 8):  # evictions read victims back from the device
        await tier.put(key_of(i), sample_block(i))
    assert len(backend.sync_threads) >= 3
    assert loop_thread not in backend.sync_threads
    await tier.aclose()


async def test_host_backends_copy_inline_without_synchronize() -> None:
    tier = HBMTier(4 * BLOCK_BYTES, block_bytes=BLOCK_BYTES, backend="numpy")
    await tier.put(key_of(1), sample_block(1))
    got = await tier.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(1).tobytes()
    await tier.aclose()


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
def test_policy_option(policy: str) -> None:
    tier = tier_from_url(f"hbm://?capacity=4KiB&block_bytes=1KiB&backend=numpy&policy={policy}")
    assert tier.stats()["policy"] == policy
