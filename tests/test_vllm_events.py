"""``KVTierConnector.take_events()`` driven by fakes (no vLLM import): the scheduler side
announces blocks once the workers report their saves, with vLLM's block hashes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.vllm_events import (
    ConnectorEvents,
    KVTierWorkerMetadata,
    LocalBlockRemoved,
    LocalBlockStored,
    event_media,
)
from tests.helpers.vllm_fakes import (
    BLOCK,
    Blocks,
    FakeEngine,
    Request,
    cached_step,
    empty_step,
    new_step,
)

PROMPT = [(13 * i + 7) % 997 + 1 for i in range(22)]  # 5 full blocks of 4, plus 2 tokens
MEDIA = [("CPU", "LOCAL"), ("STORAGE", "LOCAL")]  # dram:// then file://


def vllm_hash(block_hash: bytes) -> int:
    """vLLM's default event form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


@pytest.fixture
def shared(tmp_path: Path) -> dict[str, object]:
    return {"tiers": ["dram://?capacity=4MiB", f"file://{tmp_path / 'pool'}"],
            "model": "tiny-test"}


@pytest.fixture(autouse=True)
def _int_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)


def stored(events: list[Any]) -> list[Any]:
    assert all(isinstance(e, LocalBlockStored | LocalBlockRemoved) for e in events)
    return [e for e in events if isinstance(e, LocalBlockStored)]


def events_after_saves(engine: FakeEngine, req: Request) -> list[Any]:
    """Step the engine (as vLLM does while it has work) until the saves' events come."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        events = list(engine.scheduler.take_events())
        if events:
            return events
        engine.run_step(empty_step())
        engine.finish_step(req, [], 0, 0)
        time.sleep(0.002)
    raise AssertionError("no events")


def test_completed_save_is_announced_once_per_medium_with_vllm_hashes(
        shared: dict[str, object]) -> None:
    engine = FakeEngine(shared)
    try:
        req = Request("r-1", PROMPT)
        block_ids = [3, 9, 4, 10, 5, 11]
        engine.scheduler.get_num_new_matched_tokens(req, 0)
        engine.scheduler.update_state_after_alloc(req, Blocks(block_ids), 0)
        engine.run_step(new_step(req, block_ids, 0, len(PROMPT)))
        assert list(engine.scheduler.take_events()) == []  # planned, not saved yet
        engine.finish_step(req, block_ids, 0, len(PROMPT))
        events = events_after_saves(engine, req)
        hashes = [vllm_hash(h) for h in req.block_hashes[:5]]
        assert [(e.medium, e.locality) for e in stored(events)] == MEDIA
        for event in events:
            assert event.block_hashes == hashes
            assert event.parent_block_hash is None
            assert event.token_ids == PROMPT[:20]
            assert event.block_size == BLOCK
            assert event.lora_id is None and event.lora_name is None
        assert list(engine.scheduler.take_events()) == []  # taken once

        # Decoding fills block 5: announced alone, chained to block 4.
        req.output_token_ids = [5, 6]
        engine.run_step(cached_step(req, None, 23, 1))  # computes token 23
        engine.finish_step(req, block_ids, 5, 24)
        events = events_after_saves(engine, req)
        assert [(e.medium, e.locality) for e in stored(events)] == MEDIA
        for event in events:
            assert event.block_hashes == [vllm_hash(req.block_hashes[5])]
            assert event.parent_block_hash == vllm_hash(req.block_hashes[4])
            assert event.token_ids == req.all_token_ids[20:24]
        assert engine.finish(req) == {"r-1"}
        assert list(engine.scheduler.take_events()) == []
    finally:
        engine.close()


def test_failed_load_is_announced_removed(shared: dict[str, object], tmp_path: Path) -> None:
    a = FakeEngine(shared)
    a.prefill(Request("a-1", PROMPT), list(range(6)))
    a.close()
    b = FakeEngine(shared)
    try:
        # Another request runs (too short to save a block), so the load is asynchronous:
        # with none it would be synchronous.
        b.prefill(Request("b-other", [5, 6, 7]), [20])
        req = Request("b-1", PROMPT)
        ext, load_async = b.scheduler.get_num_new_matched_tokens(req, 0)
        assert ext == 5 * BLOCK and load_async
        shutil.rmtree(tmp_path / "pool")  # every block vanishes after the lookup
        (tmp_path / "pool").mkdir()
        b.scheduler.update_state_after_alloc(req, Blocks([8, 9, 10, 11, 12, 13]), ext)
        # Asynchronous: the errors come steps after the step that carried the load.
        assert b.wait_for_async_load(req) == {8, 9, 10, 11, 12}
        events = list(b.scheduler.take_events())
        removed = [e for e in events if isinstance(e, LocalBlockRemoved)]
        assert [(e.medium, e.locality) for e in removed] == MEDIA
        for event in removed:
            assert sorted(event.block_hashes) == sorted(vllm_hash(h)
                                                        for h in req.block_hashes[:5])
        assert list(b.scheduler.take_events()) == []
    finally:
        b.close()


def test_every_shard_must_report_and_a_failed_save_is_never_announced() -> None:
    events = ConnectorEvents(event_media(["dram://", "peers://a:1,b:2"]), BLOCK, shards=2)
    assert events.media == [("CPU", "LOCAL"), ("STORAGE", "REMOTE")]
    req = Request("r", PROMPT)
    ok = events.record_save(req, 0, 2)
    bad = events.record_save(req, 2, 4)
    rank0 = KVTierWorkerMetadata(saved={ok: 1, bad: 1})
    events.worker_report(rank0)
    assert events.take() == []  # TP rank 1 has not reported yet
    events.worker_report(KVTierWorkerMetadata(saved={ok: 1}).aggregate(
        KVTierWorkerMetadata(failed={bad: 1})))
    out = events.take()
    assert [e.block_hashes for e in out] == [[vllm_hash(h) for h in req.block_hashes[:2]]] * 2
    events.worker_report(KVTierWorkerMetadata(saved={bad: 1}))  # late: already dropped
    assert events.take() == []
    # No block hashes (vLLM's prefix caching off): nothing to announce, nothing tracked.
    assert events.record_save(Request("short", PROMPT[:3]), 0, 1) == -1


def test_buffer_is_bounded_and_counts_what_it_dropped() -> None:
    events = ConnectorEvents([("CPU", "LOCAL")], BLOCK, shards=1, capacity=2)
    req = Request("r", PROMPT)
    ids = [events.record_save(req, i, i + 1) for i in range(3)]
    events.worker_report(KVTierWorkerMetadata(saved=dict.fromkeys(ids, 1)))
    assert events.dropped == 1
    assert [e.block_hashes for e in events.take()] == [[vllm_hash(req.block_hashes[i])]
                                                        for i in (1, 2)]


@pytest.mark.parametrize("extra, kv_events", [({"event_buffer": 0}, True), ({}, False)])
def test_events_off_with_event_buffer_zero_or_vllm_events_disabled(
        shared: dict[str, object], extra: dict[str, object], kv_events: bool) -> None:
    engine = FakeEngine({**shared, **extra}, kv_events=kv_events)
    try:
        req = Request("r-1", PROMPT)
        engine.prefill(req, [3, 9, 4, 10, 5, 11])
        engine.finish(req)
        assert list(engine.scheduler.take_events()) == []
        assert engine.worker.build_connector_worker_meta() is None
    finally:
        engine.close()
