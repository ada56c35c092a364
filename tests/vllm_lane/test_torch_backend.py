"""The torch backend's host side (runs where torch is installed: the vLLM lane's venv)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvtier.backends import get_backend

torch = pytest.importorskip("torch")


def test_a_read_only_stored_block_becomes_a_tensor_over_the_same_memory() -> None:
    """A DRAM tier returns read-only views of its arena; the device copy must read them in
    place (one DMA from the registered arena on CUDA), not refuse them and stage a copy."""
    backend = get_backend("torch", "cpu")
    block = np.arange(4096, dtype=np.uint8)
    block.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not writable" warning escapes either
        tensor = backend.host_tensor(block)  # type: ignore[attr-defined]
    assert tensor.data_ptr() == block.ctypes.data and tensor.numel() == block.size
    assert torch.equal(tensor, torch.arange(4096, dtype=torch.int64).to(torch.uint8))
