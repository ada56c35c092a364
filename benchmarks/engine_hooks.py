"""Time a vLLM KV connector's hooks inside the engine: how long each request spent in them.

A TTFT difference between two engine processes is noisy (tens of ms here, from one process
to the next), so ``bench_engine`` also measures the connector's overhead directly: the time
the engine's own threads (scheduler and worker) spend inside the connector's hooks while a
request runs. Background work the connector starts (a save's network writes) is not in it;
it shows in the TTFT columns.

:func:`instrument` wraps ``KVConnectorFactory.create_connector`` in every process of the
engine (``engine_run`` installs it before ``vllm.LLM`` starts, and again at import in the
processes vLLM spawns), so every connector it creates, of any kind, writes one line per hook
call (end time, hook, milliseconds) to ``PATH.PID``. :class:`HookLog` reads those lines back
for a time window.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["HOOKS", "HOOK_LOG_ENV", "HookLog", "instrument"]

#: Set by ``engine_run`` for vLLM's spawned processes (they install the timing at import).
HOOK_LOG_ENV = "KVTIER_BENCH_HOOK_LOG"

#: The connector methods vLLM calls on its scheduler and worker threads.
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "request_finished_all_groups",
         "take_events", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
         "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
         "build_connector_worker_meta")


class _Writer:
    """Appends hook lines to ``PATH.PID`` (opened in the process that first writes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.pid = -1
        self.file: Any = None

    def write(self, name: str, ms: float) -> None:
        with self.lock:
            if self.pid != os.getpid():
                self.pid = os.getpid()
                self.file = open(f"{self.path}.{self.pid}", "a", buffering=1,  # noqa: SIM115
                                 encoding="utf-8")
            self.file.write(f"{time.time():.6f} {name} {ms:.4f}\n")


def _timed(method: Callable[..., Any], name: str, writer: _Writer,
           depth: threading.local) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        # A hook that calls another (request_finished_all_groups -> request_finished) is
        # timed once, as the outer one.
        outer = getattr(depth, "value", 0) == 0
        depth.value = getattr(depth, "value", 0) + 1
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            depth.value -= 1
            if outer:
                writer.write(name, (time.perf_counter() - started) * 1e3)
    return timed


def instrument(path: str) -> None:
    """Make every KV connector vLLM creates from now on log its hook times to ``path.PID``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if getattr(KVConnectorFactory, "_kvtier_bench_timed", False):
        return
    KVConnectorFactory._kvtier_bench_timed = True  # type: ignore[attr-defined]
    writer = _Writer(path)
    create = KVConnectorFactory.create_connector.__func__  # type: ignore[attr-defined]

    def create_timed(cls: Any, *args: Any, **kwargs: Any) -> Any:
        connector = create(cls, *args, **kwargs)
        depth = threading.local()
        for name in HOOKS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, _timed(method, name, writer, depth))
        return connector

    KVConnectorFactory.create_connector = classmethod(create_timed)  # type: ignore[method-assign]


class HookLog:
    """Reads the hook lines of every process that wrote ``path.*``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._offsets: dict[Path, int] = {}
        self._lines: list[tuple[float, str, float]] = []

    def _read(self) -> None:
        for file in self.path.parent.glob(self.path.name + ".*"):
            with open(file, "rb") as fh:
                fh.seek(self._offsets.get(file, 0))
                data = fh.read()
            complete = data[:data.rfind(b"\n") + 1]  # a line being written waits its turn
            self._offsets[file] = self._offsets.get(file, 0) + len(complete)
            for line in complete.decode().splitlines():
                end, name, ms = line.split()
                self._lines.append((float(end), name, float(ms)))

    def window(self, start: float, end: float) -> dict[str, float]:
        """Milliseconds per hook for calls that ended within ``[start, end]`` (``time.time``)."""
        self._read()
        totals: dict[str, float] = {}
        for ended, name, ms in self._lines:
            if start <= ended <= end:
                totals[name] = totals.get(name, 0.0) + ms
        self._lines = [line for line in self._lines if line[0] > end]
        return totals
