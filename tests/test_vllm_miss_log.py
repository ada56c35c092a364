"""The vLLM connector's miss summary: one log line per interval (never per block or
lookup), with the lookups' misses by reason."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.integrations.miss_log import MissLog
from kvtier.misses import MissReason
from kvtier.testing.fakes import FakeClock
from tests.helpers.vllm_fakes import FakeEngine, Request

PROMPT = [(13 * i + 7) % 997 + 1 for i in range(22)]  # 5 full blocks of 4, plus 2 tokens
LOGGER = "kvtier.integrations.vllm"


def test_connector_logs_misses_by_reason_once_per_interval(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = {"tiers": ["dram://?capacity=4MiB", f"file://{tmp_path / 'pool'}"],
              "model": "tiny-test"}
    a = FakeEngine(shared)
    a.prefill(Request("a-1", PROMPT), list(range(6)))
    a.close()
    b = FakeEngine(shared)
    try:
        planner = b.scheduler._planner_side()
        clock = FakeClock()
        planner.misses.clock = clock
        planner.misses._since = clock()
        caplog.set_level(logging.INFO, logger=LOGGER)
        sched = b.scheduler
        for i in range(3):
            assert sched.get_num_new_matched_tokens(Request(f"hit-{i}", PROMPT), 0)[0] == 20
            other = PROMPT[:8] + [999] * 14  # 2 blocks stored, then a prompt never seen
            assert sched.get_num_new_matched_tokens(Request(f"part-{i}", other), 0)[0] == 8
            assert sched.get_num_new_matched_tokens(Request(f"short-{i}", [1, 2, 3]), 0)[0] == 0
        assert not [r for r in caplog.records if "kvtier lookups" in r.message]
        clock.advance(61)
        sched.get_num_new_matched_tokens(Request("last", PROMPT), 0)
        lines = [r for r in caplog.records if "kvtier lookups" in r.message]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        text = lines[0].getMessage()
        assert "10 lookups, 26 of 35 blocks found (74%)" in text
        assert "below_threshold 3" in text and "not_stored 3" in text
    finally:
        b.close()


def test_nothing_found_is_a_warning_and_failed_lookups_are_unavailable(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = logging.getLogger("test.miss_log")
    misses = MissLog(None, log, interval_s=10, clock=clock)
    caplog.set_level(logging.INFO, logger="test.miss_log")
    for _ in range(100):
        misses.lookup(4, 0)
    misses.note(MissReason.UNAVAILABLE)
    assert not caplog.records
    clock.advance(10)
    misses.lookup(2, 0)
    [line] = caplog.records
    assert line.levelno == logging.WARNING
    assert "101 lookups, 0 of 402 blocks found (0%)" in line.getMessage()
    assert "not_stored 101, unavailable 1" in line.getMessage()
    misses.flush()  # nothing since: no second line
    assert len(caplog.records) == 1
