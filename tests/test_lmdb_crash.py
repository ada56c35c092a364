"""Crash safety: SIGKILL an LMDB writer mid put-loop, reopen, verify every acknowledged put."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.testing.conformance import key_of
from kvtier.tiers.lmdb import LMDBTier

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

# The writer prints each key index only after its put returned, and flushes, so every
# printed index is a put the caller was told had succeeded.
WRITER = r"""
import asyncio, sys
import numpy as np
from kvtier.tiers.lmdb import LMDBTier
from kvtier.testing.conformance import key_of

def block(i):
    rng = np.random.default_rng(i)
    n = int(rng.integers(1, 64)) * 4096 + int(rng.integers(0, 4096))
    return rng.integers(0, 255, n, dtype=np.uint8)

async def main(path, capacity, compress):
    tier = LMDBTier(path, capacity=capacity, compress_level=compress)
    i = int(sys.argv[4])
    while True:
        await tier.put(key_of(i), block(i))
        sys.stdout.write(f"{i}\n")
        sys.stdout.flush()
        i += 1

asyncio.run(main(sys.argv[1], int(sys.argv[2]), None if sys.argv[3] == "0" else int(sys.argv[3])))
"""


def _block(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    n = int(rng.integers(1, 64)) * 4096 + int(rng.integers(0, 4096))
    return rng.integers(0, 255, n, dtype=np.uint8)


def _run_and_kill(path: Path, capacity: int, compress: int, start: int, acks: int) -> list[int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(capacity), str(compress), str(start)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    acked: list[int] = []
    assert proc.stdout is not None
    try:
        while len(acked) < acks:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"writer died: {proc.stderr.read().decode()}")  # type: ignore[union-attr]
            acked.append(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # Lines already written to the pipe before the kill are acknowledged puts too.
    acked.extend(int(line) for line in proc.stdout.read().split())
    proc.stdout.close()
    proc.stderr.close()  # type: ignore[union-attr]
    return acked


@pytest.mark.slow
@pytest.mark.parametrize("compress", [0, 1], ids=["raw", "zstd"])
async def test_sigkill_mid_put_loop_loses_no_acknowledged_put(tmp_path: Path,
                                                              compress: int) -> None:
    path = tmp_path / "db"
    capacity = 256 << 20  # holds everything: every acknowledged put must be there
    rng = np.random.default_rng(compress)
    acked_all: list[int] = []
    start = 0
    for _trial in range(4):
        acked = _run_and_kill(path, capacity, compress, start,
                              acks=int(rng.integers(5, 60)))
        acked_all.extend(acked)
        start = max(acked_all) + 1
        tier = LMDBTier(path, capacity=capacity)  # the dead writer's lock is gone
        got = await tier.get_many([key_of(i) for i in acked_all])
        for i, block in zip(acked_all, got, strict=True):
            assert block is not None, f"acknowledged put {i} lost"
            assert block.tobytes() == _block(i).tobytes()
        # A put that was in flight at the kill is either whole or absent, never corrupt.
        inflight = await tier.get(key_of(start))
        assert inflight is None or inflight.tobytes() == _block(start).tobytes()
        assert tier.stats()["corrupt"] == 0
        await tier.aclose()


async def test_sigkill_while_evicting(tmp_path: Path) -> None:
    path = tmp_path / "db"
    capacity = 4 << 20  # ~32 blocks: the writer evicts continuously
    acked = _run_and_kill(path, capacity, 0, 0, acks=150)
    tier = LMDBTier(path, capacity=capacity)
    present = await tier.get_many([key_of(i) for i in acked])
    assert tier.used <= capacity
    for i, block in zip(acked, present, strict=True):
        if block is not None:
            assert block.tobytes() == _block(i).tobytes()
    newest = acked[-1]
    assert present[acked.index(newest)] is not None, "the newest acknowledged put was lost"
    assert tier.stats()["corrupt"] == 0
    await tier.aclose()
