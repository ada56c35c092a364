"""How much slower than its CPU time this process runs now: the factor by which tests that
must use real timeouts scale them, so that they pass on a loaded box (the README's test run
beside a benchmark, CI runners shared with other jobs) as they do on an idle one.

The factor is measured, not configured: a fixed piece of pure-Python work is timed on the
wall clock and on this thread's CPU clock. On an idle machine the two agree (factor 1); when
other processes compete for the cores, the wall time grows by the time this process waited
for a core (at load 8 on 2 cores, about 4). Servers on loopback wait alike, so their answers
slow by about the same factor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LoopLag", "Scale", "slowdown"]

_SAMPLES = 3
_WORK = 400_000  # loop iterations per sample: about 20 ms of CPU, several scheduler slices
_CAP = 8.0  # past this the box is too loaded for any timeout test to mean much


def _work() -> int:
    total = 0
    for i in range(_WORK):
        total += i * i % 7
    return total


def slowdown() -> float:
    """Wall time over CPU time of a fixed piece of work, the median of a few samples: ``1.0``
    on an idle machine, larger under load (capped at 8)."""
    ratios = []
    for _ in range(_SAMPLES):
        wall, cpu = time.perf_counter(), time.thread_time()
        _work()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        ratios.append(wall / max(cpu, 1e-6))
        time.sleep(0.002)  # let a competing process take the core between samples
    ratios.sort()
    return min(_CAP, max(1.0, ratios[len(ratios) // 2]))


class Scale:
    """Durations of a test scaled by the :func:`slowdown` measured when it was made: a
    timeout a healthy answer must beat, a delay that must exceed that timeout, a sleep that
    must outlast that delay all grow together, so their order (the test's point) holds."""

    def __init__(self, factor: float | None = None) -> None:
        self.factor = slowdown() if factor is None else factor

    def __call__(self, seconds: float) -> float:
        """``seconds`` on an idle machine, as seconds now."""
        return round(seconds * self.factor, 3)

    def __repr__(self) -> str:
        return f"Scale(factor={self.factor:.2f})"


class LoopLag:
    """The worst lateness of this loop's timers while the ``with`` block runs (a sampler
    task sleeps 5 ms at a time and notes how late it wakes): what a duration measured on
    this loop may grow by that is not the code's doing."""

    def __init__(self) -> None:
        self.worst = 0.0

    @contextmanager
    def measure(self) -> Iterator[LoopLag]:
        task = asyncio.get_running_loop().create_task(self._sample())
        try:
            yield self
        finally:
            task.cancel()

    async def _sample(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.perf_counter() - start - 0.005)
