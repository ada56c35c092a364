"""Mooncake Store cells for ``bench_peer``, measured by the team's shared baseline script.

``../shared/bench/bench_mooncake.py`` (next to the repository root) starts ``mooncake_master``
and a holder process that mounts the pool's only memory segment, then reads blocks over
Mooncake's TCP transport from its own process (OS threads for concurrency). This module runs
that script as a child process with ``--json`` for the cells that match the peer tier's
(``get_into`` of one block, ``batch_get_into`` of 16 blocks), on free loopback ports and a
private log folder, with its output captured, and turns the JSON rows into
:class:`benchmarks.common.Result` rows. The script is run, never copied: the baseline stays
the team's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Result

REPO = Path(__file__).resolve().parent.parent
SHARED_SCRIPT = Path("shared", "bench", "bench_mooncake.py")
BATCH = 16  # keys per batch_get_into call, fixed by the script (as peer batch16 get)
OPS = ("batch_get_into", "get_into")
# The script's default 6 GiB segment only adds memory on a shared box: the read working set
# it preloads is min(512 MiB, segment / 3), the same 512 MiB with 2 GiB.
SEGMENT = "2G"
IMPORT_TIMEOUT_S = 60.0
STARTUP_S = 90.0  # master + holder + client setup, generous for a loaded box
STOP_S = 20.0


@dataclass
class SummaryResult(Result):
    """A cell summarised by another program: its median rate and the median of its per-call
    latency percentiles over the repetitions, not each latency (``latencies_s`` is empty).

    ``nbytes`` is per call (16 blocks for a batch call, as for ``peer batch16 get``),
    ``calls`` counts the calls of all repetitions.
    """

    calls: int = 0
    calls_per_s: float = 0.0
    gbps_median: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0

    @property
    def ops(self) -> int:
        return self.calls

    @property
    def ops_per_s(self) -> float:
        return self.calls_per_s

    @property
    def gbps(self) -> float:
        return self.gbps_median

    def pct(self, q: float) -> float:
        if q == 0.5:
            return self.p50_s
        if q == 0.99:
            return self.p99_s
        raise ValueError(f"only the p50 and p99 of a summarised cell are known, not q={q}")


def default_script() -> Path:
    """``../shared/bench/bench_mooncake.py`` from the repository root, or from the nearest
    folder above it that has one (a git worktree under ``wt/`` shares its main checkout's
    ``shared/``); the first path when none exists."""
    found = (d / SHARED_SCRIPT for d in REPO.parents if (d / SHARED_SCRIPT).is_file())
    return next(found, REPO.parent / SHARED_SCRIPT)


def resolve(choice: str) -> tuple[Path | None, str]:
    """The script to run for ``--mooncake choice`` (``auto``, ``off`` or a path to
    ``bench_mooncake.py``), or ``None`` and the reason to skip the Mooncake cells."""
    if choice == "off":
        return None, "--mooncake off"
    script = default_script() if choice == "auto" else Path(choice).expanduser().resolve()
    if not script.is_file():
        return None, f"{script} not found (the shared benchmarks are not checked out there)"
    try:
        probe = subprocess.run([sys.executable, "-c", "import mooncake.store"],
                               capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S,
                               check=False)
    except subprocess.TimeoutExpired:
        return None, f"`import mooncake.store` took over {IMPORT_TIMEOUT_S:.0f} s"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return None, (f"`import mooncake.store` failed ({last}); "
                      "pip install 'kvtier[mooncake]'")
    return script, ""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (all held open until each is known)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _size_arg(nbytes: int) -> str:
    return f"{nbytes // 1024}K" if nbytes % (1 << 20) else f"{nbytes >> 20}M"


def parse_rows(lines: Sequence[str], label: str, nbytes: int) -> list[Result]:
    """Results from the script's JSON lines for one block size (``label``, ``nbytes``)."""
    results: list[Result] = []
    for line in lines:
        if not line.strip():
            continue
        row: dict[str, Any] = json.loads(line)
        per_call = BATCH if row["variant"] == "batch_get_into" else 1
        if row["errors"]:
            print(f"mooncake {row['variant']} {label} c={row['conc']}: {row['errors']} "
                  "failed calls (not counted in GB/s)")
        results.append(SummaryResult(
            "peer", f"mooncake {row['variant']}", label, [], per_call * nbytes,
            row["secs"], concurrency=int(row["conc"]), calls=row["ops_total"] // per_call,
            calls_per_s=row["ops_med"] / per_call, gbps_median=row["gbps_med"],
            p50_s=row["p50_ms"] / 1e3, p99_s=row["p99_ms"] / 1e3))
    return results


async def measure(script: Path, label: str, nbytes: int, concs: Sequence[int], *,
                  duration: float, reps: int, warmup: float) -> tuple[list[Result], str]:
    """Run the script for ``get_into`` and ``batch_get_into`` of ``nbytes`` blocks at each of
    ``concs`` (``reps`` repetitions of ``duration`` s, the median kept); return the rows, or
    no rows and why. The child's output goes to files; it is stopped with SIGINT (so it
    stops its own master and holder) if it runs past its time limit."""
    cells = len(OPS) * len(concs)
    limit = STARTUP_S + 4 * cells * (warmup + reps * duration)
    rpc, http, metrics = _free_ports(3)
    listing = ",".join(str(c) for c in concs)
    with tempfile.TemporaryDirectory(prefix="kvtier-mooncake-") as tmp:
        out_json, log = Path(tmp) / "rows.json", Path(tmp) / "output.log"
        args = [sys.executable, str(script), "--sizes", _size_arg(nbytes), "--ops", ",".join(OPS),
                "--conc", listing, "--batch-conc", listing, "--duration", str(duration),
                "--reps", str(reps), "--warmup", str(warmup), "--segment", SEGMENT,
                "--rpc-port", str(rpc), "--http-port", str(http), "--metrics-port", str(metrics),
                "--log-dir", tmp, "--json", str(out_json)]
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                *args, cwd=tmp, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
        try:
            status = await asyncio.wait_for(proc.wait(), limit)
        except TimeoutError:
            return [], f"timed out after {limit:.0f} s"
        finally:
            await _stop(proc)
        if status != 0:
            tail = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            return [], f"exit status {status}: {tail[-200:]}"
        lines = out_json.read_text().splitlines() if out_json.exists() else []
        results = parse_rows(lines, label, nbytes)
    return (results, "") if results else ([], "the script wrote no result rows")


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGINT)  # its finally blocks stop master and holder by PID
    try:
        await asyncio.wait_for(proc.wait(), STOP_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
