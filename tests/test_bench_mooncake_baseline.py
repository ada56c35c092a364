"""bench_peer's Mooncake baseline: finding the shared script, reading its JSON rows, ratios."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import bench_peer, mooncake_baseline
from benchmarks.common import Result

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

MiB = 1 << 20


def _row(variant: str, conc: int, gbps: float) -> str:
    per_call = 16 if variant == "batch_get_into" else 1
    return json.dumps({"bench": "mooncake", "variant": variant, "size": "1M", "conc": conc,
                       "gbps_med": gbps, "gbps_min": gbps, "gbps_max": gbps,
                       "ops_med": gbps * 1e9 / MiB, "p50_ms": 2.0, "p99_ms": 9.0,
                       "ops_total": 96 * per_call, "errors": 0, "reps": 3, "secs": 0.6})


def test_missing_script_or_off_is_skipped_with_a_reason(tmp_path: Path) -> None:
    missing = tmp_path / "shared" / "bench" / "bench_mooncake.py"
    script, why = mooncake_baseline.resolve(str(missing))
    assert script is None and str(missing) in why and "not found" in why
    assert mooncake_baseline.resolve("off") == (None, "--mooncake off")


def test_rows_become_results_per_call() -> None:
    batch, single = mooncake_baseline.parse_rows(
        [_row("batch_get_into", 8, 1.6), "", _row("get_into", 8, 0.8)], "1MiB", MiB)
    assert (batch.case, batch.size, batch.concurrency) == ("mooncake batch_get_into", "1MiB", 8)
    assert batch.nbytes == 16 * MiB and batch.ops == 96  # calls, not blocks
    assert batch.gbps == pytest.approx(1.6)
    assert batch.ops_per_s == pytest.approx(1.6e9 / MiB / 16)
    assert batch.pct(0.5) == pytest.approx(0.002)
    assert batch.pct(0.99) == pytest.approx(0.009)
    with pytest.raises(ValueError, match="p50 and p99"):
        batch.pct(0.9)
    assert single.nbytes == MiB and single.ops_per_s == pytest.approx(0.8e9 / MiB)
    assert batch.row()["p50_us"] == pytest.approx(2000.0)


def test_peer_rows_get_mooncake_ratios_and_targets() -> None:
    def peer(case: str, nbytes: int, seconds: float) -> Result:
        # 10 ops of nbytes in `seconds`
        return Result("peer", case, "1MiB", [0.001] * 10, nbytes, seconds, concurrency=8)

    results = [peer("peer get", MiB, 10 * MiB / 1.2e9), peer("aiohttp get", MiB, 10 * MiB / 1e9),
               peer("peer batch16 get", 16 * MiB, 160 * MiB / 3.2e9),
               *mooncake_baseline.parse_rows([_row("batch_get_into", 8, 1.6),
                                              _row("get_into", 8, 0.8)], "1MiB", MiB)]
    bench_peer._attach_ratios(results)
    by = {r.case: r for r in results}
    assert by["peer batch16 get"].extra["also"] == "2.00x mooncake batch_get_into"
    assert by["peer get"].extra["also"] == "1.50x mooncake get_into"
    assert by["mooncake batch_get_into"].ratio == pytest.approx(2.0)
    lines = bench_peer._targets(results)
    assert ("peer batch16 get / mooncake batch_get_into @1MiB c=8: 3.20 / 1.60 GB/s = 2.00x "
            "(target >= 1.3x: met)") in lines
    assert "peer get / mooncake get_into @1MiB c=8: 1.20 / 0.80 GB/s = 1.50x" in lines


def test_the_shared_script_runs_and_its_rows_parse() -> None:
    """The real script, one short cell per op: its JSON still has the fields we read."""
    script, why = mooncake_baseline.resolve("auto")
    if script is None:
        pytest.skip(f"Mooncake baseline unavailable: {why}")
    rows, why = asyncio.run(mooncake_baseline.measure(script, "64KiB", 64 << 10, [1],
                                                      duration=0.1, reps=1, warmup=0.0))
    assert why == ""
    assert sorted(r.case for r in rows) == ["mooncake batch_get_into", "mooncake get_into"]
    assert all(r.gbps > 0 and r.ops > 0 and r.pct(0.5) > 0 for r in rows)
