"""``PagedLayers`` on torch tensors (the layouts vLLM hands ``register_kv_caches``); runs where
torch is installed (the vLLM lane's venv), skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.integrations.paged import PagedLayers

torch = pytest.importorskip("torch")


def test_per_layer_and_kv_split_tensors_round_trip() -> None:
    kv = {"a": torch.randn(8, 32, 1, 64), "b": torch.randn(2, 8, 32, 1, 32).to(torch.bfloat16)}
    layers = PagedLayers(kv, 8)
    data = layers.gather(3)
    expected = (kv["a"][3].numpy().tobytes() + kv["b"][0, 3].view(torch.uint16).numpy().tobytes()
                + kv["b"][1, 3].view(torch.uint16).numpy().tobytes())
    assert data.tobytes() == expected
    layers.scatter(6, data)
    assert torch.equal(kv["a"][6], kv["a"][3]) and torch.equal(kv["b"][:, 6], kv["b"][:, 3])


def test_cross_layer_views_match_per_layer_bytes() -> None:
    base = torch.randn(8, 2, 32, 64)
    cross = PagedLayers({"l0": base[:, 0], "l1": base[:, 1]}, 8)
    separate = PagedLayers({"l0": base[:, 0].contiguous(), "l1": base[:, 1].contiguous()}, 8)
    assert cross.cross_layer and not separate.cross_layer
    assert np.array_equal(cross.gather(5), separate.gather(5))
    cross.scatter(0, separate.gather(7))
    assert torch.equal(base[0], base[7])


def test_torch_indexed_copies_match_numpy() -> None:
    """The torch path (used for CUDA planes) gives the bytes of the numpy path; run here on
    CPU tensors, which PagedLayers itself copies through numpy views."""
    from kvtier.integrations.paged import _put, _take

    plane = torch.arange(6 * 8, dtype=torch.uint8).reshape(6, 8)
    ids = np.array([4, 0, 2], dtype=np.intp)
    out = np.zeros((3, 10), dtype=np.uint8)
    _take(plane, ids, out[:, 1:9])
    assert np.array_equal(out[:, 1:9], plane.numpy()[ids])
    source = torch.full((3, 10), 7, dtype=torch.uint8)
    _put(plane, np.array([1, 3, 5], dtype=np.intp), source[:, 1:9])
    assert bool((plane[1::2] == 7).all()) and bool((plane[0::2] != 7).any())
