"""A save's copy out of vLLM's pages runs off the engine's step: ``wait_for_save`` returns
before it ends (the step samples its token meanwhile), and the next step's ``start_load_kv``,
which precedes any page write of its forward pass, waits for it. The gather is held at a gate
here so both orders are certain, not a race the test may win by chance."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.paged import PagedLayers
from tests.helpers import vllm_fakes as fakes
from tests.helpers.vllm_fakes import BLOCK, FakeEngine, Request, expected_block, shared_tiers

PROMPT = [(7 * i + 3) % 991 + 1 for i in range(22)]  # 5 full blocks of 4, plus 2 tokens


class GatedLayers(PagedLayers):
    """The engine's pages, whose gathers wait at a gate the test opens."""

    gate: threading.Event
    gathering: threading.Event

    def gather_many(self, block_ids: Any, out: Any = None) -> Any:
        self.gathering.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().gather_many(block_ids, out=out)


def _run(target: Any) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_wait_for_save_returns_before_its_gather_and_the_next_step_waits_for_it(
        tmp_path: Path) -> None:
    shared = shared_tiers(tmp_path)
    a = FakeEngine(shared)
    worker = a.worker._worker_side()
    layers = worker._layers()
    layers.__class__ = GatedLayers
    assert isinstance(layers, GatedLayers)
    layers.gate, layers.gathering = threading.Event(), threading.Event()
    try:
        req = Request("a-1", PROMPT)
        ids = [0, 1, 2, 3, 4, 5]
        assert a.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        a.scheduler.update_state_after_alloc(req, fakes.Blocks(ids), 0)
        a.run_step(fakes.new_step(req, ids, 0, len(PROMPT)))
        for b in range(5):  # the forward pass computes 5 full blocks
            a.compute(req.all_token_ids, b, ids[b])

        saved = _run(a.worker.wait_for_save)
        saved.join(5)
        assert not saved.is_alive(), "wait_for_save waited for the gather"
        assert layers.gathering.wait(5)

        # A step giving out one of those blocks again (the request preempted, its block
        # given to another) must not start its forward pass, which writes that page, while
        # the gather still copies it.
        a.worker.clear_connector_metadata()
        other = Request("b-0", PROMPT[:9])
        next_step = _run(lambda: a.run_step(fakes.new_step(other, [20, 2, 21], 0, 9)))
        next_step.join(0.3)
        assert next_step.is_alive(), "start_load_kv did not wait for the gather"
        layers.gate.set()
        next_step.join(5)
        assert not next_step.is_alive()
        for name in a.kv:  # that step's forward pass overwrites the pages
            a.kv[name][...] = 0
        assert a.finish(req) == {"a-1"}
    finally:
        layers.gate.set()
        a.close()

    b = FakeEngine(shared)
    try:
        ext, _, errors = b.prefill(Request("b-1", PROMPT), [10, 11, 12, 13, 14, 15])
        assert ext == 5 * BLOCK and errors == set()
        assert [b.block_bytes(i) for i in (10, 11, 12, 13, 14)] == \
            [expected_block(PROMPT, n) for n in range(5)]
    finally:
        b.close()


def test_a_failed_gather_fails_its_save_only(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(shared_tiers(tmp_path))
    worker = engine.worker._worker_side()

    def broken(block_ids: Any, out: Any = None) -> Any:
        raise IndexError("block_id 99 outside 0..63")

    try:
        worker._layers().gather_many = broken  # type: ignore[method-assign]
        req = Request("r-1", PROMPT)
        ext, _, _ = engine.prefill(req, [0, 1, 2, 3, 4, 5])
        assert ext == 0
        assert engine.finish(req) == {"r-1"}  # reported ended, so vLLM frees the blocks
        assert "save of 5 blocks failed" in caplog.text and "block_id 99" in caplog.text
    finally:
        engine.close()


def test_gathering_blocks_of_several_layers_into_a_bounce_buffer_allocates_nothing() -> None:
    """A save copies a chunk of blocks out of every layer into rows of a bounce buffer made
    at register; each layer's columns of it are not contiguous, and np.take buffered such an
    ``out`` (a save under memory pressure failed with MemoryError((4, 524288), uint8)). The
    gather writes in place, and its bytes are the layers' blocks."""
    import tracemalloc

    import numpy as np

    layers = {f"layers.{i}.attn": np.random.default_rng(i).integers(
        0, 255, (2, 8, 16 << 10), dtype=np.uint8) for i in range(4)}  # K/V, 8 blocks each
    paged = PagedLayers(layers, 8)
    bounce = paged.empty(4)
    tracemalloc.start()
    try:
        paged.gather_many([7, 2, 5, 0], out=bounce)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < bounce.nbytes // 8, f"the gather allocated {peak} bytes"
    for row, block in zip(bounce, [7, 2, 5, 0], strict=True):
        assert row.tobytes() == paged.gather(block).tobytes()
