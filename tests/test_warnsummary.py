"""Rate-limited warnings: the first failure in full, the rest of an interval as one line
with a count, emitted by a timer on the loop when the interval ends (or at flush)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvtier.warnsummary import WarningSummary


async def test_summary_comes_when_the_interval_ends(caplog: pytest.LogCaptureFixture) -> None:
    summary = WarningSummary(logging.getLogger("kvtier.test.warnsummary"), interval=0.05)
    with caplog.at_level(logging.WARNING, logger="kvtier.test.warnsummary"):
        for i in range(5):
            summary.warn("tier x (1)", "demote", f"error {i}")
        summary.warn("tier y (2)", "demote", "other tier")
        assert [r.getMessage() for r in caplog.records] == [
            "tier x (1) failed demote: error 0", "tier y (2) failed demote: other tier"]
        for _ in range(100):
            if len(caplog.records) == 3:
                break
            await asyncio.sleep(0.01)
        assert "tier x (1) failed demote 4 more time(s)" in caplog.records[2].getMessage()
        assert "(last: error 4)" in caplog.records[2].getMessage()
        summary.warn("tier x (1)", "demote", "error 5")  # a new interval: logged in full
        summary.flush()
    assert caplog.records[-1].getMessage() == "tier x (1) failed demote: error 5"
    assert len(caplog.records) == 4
