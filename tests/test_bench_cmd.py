"""``kvtier bench``: discovery, --only, the summary table, JSON, failures, missing folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.commands import bench

GOOD = '''
from benchmarks.common import Result, time_sync, with_ratio

def run(quick: bool = False):
    n = 2000 if quick else 20000
    lat, wall = time_sync(lambda: bytes(n), min_ops=5, min_time=0.001)
    base = Result("{name}", "baseline copy", "2KB", lat, n, wall)
    lat2, wall2 = time_sync(lambda: bytearray(n), min_ops=5, min_time=0.001)
    return [base, with_ratio(Result("{name}", "candidate", "2KB", lat2, n, wall2,
                                    concurrency=8), base)]
'''
BROKEN = "def run(quick: bool = False):\n    raise RuntimeError('disk on fire')\n"


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture()
def bench_dir(tmp_path: Path) -> Path:
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "bench_alpha.py").write_text(GOOD.format(name="alpha"))
    (d / "bench_beta.py").write_text(GOOD.format(name="beta"))
    (d / "bench_broken.py").write_text(BROKEN)
    (d / "helper.py").write_text("x = 1\n")  # not a benchmark
    return d


def test_discovery_and_summary(bench_dir: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert list(bench.discover(bench_dir)) == ["alpha", "beta", "broken"]
    out_json = tmp_path / "b.json"
    rc = bench.run(_args(dir=str(bench_dir), only="alpha,beta", json=str(out_json)))
    out = capsys.readouterr().out
    assert rc == 0
    lines = [ln for ln in out.splitlines() if ln.startswith(("alpha", "beta"))]
    assert len(lines) == 4
    assert all("x  baseline copy" in ln for ln in lines if "candidate" in ln)
    # Rows of one case at different concurrency must be told apart.
    assert all(ln.split()[3] == "8" for ln in lines if "candidate" in ln)
    doc = json.loads(out_json.read_text())
    assert doc["quick"] is True and set(doc["benchmarks"]) == {"alpha", "beta"}
    rows = doc["benchmarks"]["alpha"]["results"]
    assert rows[1]["ratio"] > 0 and rows[1]["baseline"] == "baseline copy"


def test_failure_is_reported_and_others_still_run(bench_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.run(_args(dir=str(bench_dir)))
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAILED: broken" in captured.out and "disk on fire" in captured.err
    assert sum(ln.startswith("alpha") for ln in captured.out.splitlines()) == 2


def test_bad_selection_and_missing_folder(bench_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args(dir=str(bench_dir), only="gamma")) == 2
    assert "unknown gamma" in capsys.readouterr().err
    assert bench.run(_args(dir=str(tmp_path / "nope"))) == 2
    assert "--dir" in capsys.readouterr().err


def test_finds_the_checkout_folder() -> None:
    found = bench.find_dir(None)
    assert found is not None and (found / "common.py").is_file()
