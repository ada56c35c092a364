"""Processes ``bench_engine`` drives: vLLM engines (``engine_run.py``) and the stores behind
the connectors (``redis-server``, ``kvtier serve``, ``lmcache server``).

Every process runs on 127.0.0.1, writes its log under the benchmark's work folder, and is
stopped by its context manager.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "benchmarks" / "engine_run.py"
MARK = "@@engine "
START_TIMEOUT_S = 600.0  # a vLLM start takes 25-90 s on a loaded 2-core machine
REQUEST_TIMEOUT_S = 600.0


#: What the benchmark sets in every child besides vLLM's own variables (none of them
#: changes vLLM's behaviour: this checkout's kvtier first, an offline hub, fixed hashing).
BENCH_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
# ``VLLM_*`` settings a flag asked for (``--vllm-env``); none by default, so every engine
# runs with vLLM's default environment (plus whatever VLLM_* the caller's shell exports).
_vllm_overrides: dict[str, str] = {}


def set_vllm_env(overrides: dict[str, str]) -> None:
    """Use ``overrides`` (``VLLM_*`` name -> value) in every child started from now on."""
    bad = [k for k in overrides if not k.startswith("VLLM_")]
    if bad:
        raise ValueError(f"--vllm-env: only VLLM_* variables, got {bad}")
    _vllm_overrides.clear()
    _vllm_overrides.update(overrides)


def vllm_environment() -> dict[str, str]:
    """The ``VLLM_*`` variables every engine sees: the caller's, then the overrides."""
    return {**{k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
            **_vllm_overrides}


def engine_env() -> dict[str, str]:
    """Environment of every child: this checkout's kvtier first, :data:`BENCH_ENV`, and
    vLLM's default environment unless ``--vllm-env`` changed it. (On a 2-core host vLLM's
    CPU backend reserves one core more when any KV connector is configured, which can leave
    its scheduler none; ``--vllm-env VLLM_CPU_NUM_OF_RESERVED_CPU=1`` fixes the reservation
    for every configuration: docs/integrations/vllm.md.)"""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **BENCH_ENV, **_vllm_overrides}


@contextmanager
def background_load(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` CPU-bound processes (a busy loop each) for the block's duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            stop(proc, 10)


@contextmanager
def kvtier_daemon(python: str, work: Path, capacity: str) -> Iterator[str]:
    """A host daemon (``kvtier serve --shm NAME``, DRAM of ``capacity``); yields NAME."""
    name = f"bench-engine-{os.getpid()}-{secrets.token_hex(3)}"
    with open(work / f"kvtier-daemon-{name}.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            [python, "-m", "kvtier.cli", "serve", "--listen", "127.0.0.1:0",
             "--insecure-no-auth", "--tier", f"dram://?capacity={capacity}", "--shm", name],
            cwd=ROOT, env=engine_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # ends (the loop too) if the daemon dies
                if line.startswith(f"kvtier serve shm {name}"):
                    break
            else:
                raise RuntimeError(f"kvtier serve --shm did not start (log: {log.name})")
            yield name
        finally:
            stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()


def has_modules(python: str, *modules: str) -> list[str]:
    """The modules of ``modules`` that ``python`` cannot find (without importing them)."""
    code = ("import importlib.util,sys;print(','.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    try:
        proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"{python} does not run ({exc})"]
    if proc.returncode != 0:
        return [f"{python} does not run ({proc.stderr.strip()[-200:]})"]
    return [m for m in proc.stdout.strip().split(",") if m]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float, what: str) -> None:
    """Wait until ``port`` accepts connections; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening")
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def stop(proc: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """Terminate ``proc`` (then kill it if it lingers)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


@contextmanager
def redis_server(log: Path) -> Iterator[str]:
    """A throwaway ``redis-server`` (no persistence) on loopback; yields its ``redis://`` URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    port = free_port()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                 "", "--appendonly", "no", "--maxmemory", "2gb"],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_port(port, proc, 30, "redis-server")
            yield f"redis://127.0.0.1:{port}/0?timeout=10"
        finally:
            stop(proc)


@contextmanager
def kvtier_server(python: str, work: Path) -> Iterator[str]:
    """A ``kvtier serve`` pool member (``dram://``); yields the ``peers://`` URL to reach it."""
    token = work / "peer-token"
    token.write_text("bench-engine-token-0123456789")
    with open(work / "kvtier-serve.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            [python, "-m", "kvtier.cli", "serve", "--listen", "127.0.0.1:0", "--tier",
             "dram://?capacity=2GiB", "--token-file", str(token)],
            cwd=ROOT, env=engine_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            match = re.search(r"listening on (\S+)", line)
            if match is None:
                raise RuntimeError(f"kvtier serve did not start: {line!r} (log: {log.name})")
            yield f"peers://{match.group(1)}?token=file:{token}&timeout=10"
        finally:
            stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()


@contextmanager
def lmcache_server(python: str, log: Path) -> Iterator[int]:
    """LMCache in server mode (the recipe that runs on CPU); yields its port."""
    binary = Path(python).parent / "lmcache"
    if not binary.exists():
        raise RuntimeError(f"no lmcache console script next to {python}")
    port = free_port()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [str(binary), "server", "--host", "127.0.0.1", "--port", str(port), "--chunk-size",
             "256", "--l1-size-gb", "2", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "auto"],
            env=engine_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_port(port, proc, 300, "lmcache server")
            yield port
        finally:
            stop(proc)


class Engine:
    """One ``engine_run.py`` process: a ``vllm.LLM`` answering one request at a time."""

    def __init__(self, python: str, spec: dict[str, Any], log: Path) -> None:
        self.log = log
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115  (closed in close())
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen([python, str(ENGINE), json.dumps(spec)], cwd=ROOT,
                                     env=engine_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()
        self.startup_s = float(self._next(START_TIMEOUT_S)["startup_s"])

    def _pump(self, stdout: IO[str]) -> None:
        """Protocol lines to the queue, vLLM's own output to the log."""
        for line in stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK):])
            else:
                self._log.write(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise RuntimeError(
                f"vLLM engine silent for {timeout:.0f} s (log: {self.log})") from None
        if line is None:
            self.close()
            raise RuntimeError(f"vLLM engine exited (status {self.proc.returncode}); the end "
                               f"of its log {self.log}:\n{_tail(self.log)}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def request(self, label: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        """Run one ``generate()``; the engine's reply (TTFT, cached tokens, output)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"label": label, "tokens": tokens,
                                          "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._next(REQUEST_TIMEOUT_S)

    def close(self) -> None:
        """End input (the engine shuts down, connectors flush), then wait for the process."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            stop(self.proc)
        self._log.flush()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._log.close()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"

