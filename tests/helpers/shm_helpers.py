"""Helpers of the host-daemon tests: `kvtier serve --shm NAME` subprocesses."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtier.shm.files import SHM_DIR
from tests.helpers.peer_helpers import ServeProcess, token_file


def daemon_name() -> str:
    """A name no other test (or engineer's test run) uses."""
    return f"t-{secrets.token_hex(6)}"


@dataclass
class Daemon(ServeProcess):
    """A `kvtier serve --shm shm_name` child process."""

    shm_name: str = ""


def daemon(tmp: Path, name: str, capacity: str = "64MiB", *extra: str) -> Daemon:
    """A `kvtier serve --shm name` process, not started."""
    return Daemon(["--tier", f"dram://?capacity={capacity}&prefault=0", "--shm", name,
                   *extra], token_file(tmp), shm_name=name)


@contextmanager
def running_daemon(tmp: Path, name: str | None = None, capacity: str = "64MiB",
                   *extra: str) -> Iterator[Daemon]:
    """A started daemon, stopped and its files gone on exit."""
    proc = daemon(tmp, name or daemon_name(), capacity, *extra)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        remove_files(proc.shm_name)


def remove_files(name: str) -> None:
    """Whatever a killed daemon left under /dev/shm."""
    for path in SHM_DIR.glob(f"kvtier-{name}.*"):
        path.unlink(missing_ok=True)


def wait_for(predicate: object, timeout: float = 20.0) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` (no duration is asserted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False
