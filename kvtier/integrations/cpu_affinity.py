"""Which CPUs a vLLM worker's kvtier threads run on.

vLLM's CPU backend pins each worker process to the cores of its OpenMP threads (the forward
pass) and leaves the engine's other cores "reserved" for everything else (the scheduler
process, the frontend). Threads a library starts in the worker inherit that pin, so the
connector's store thread and save gather would share the forward pass's cores: a 16 MiB
save's copies and network writes then run in the forward pass's time slices (measured in
``bench_engine``: 3-4 ms of every miss's ``wait_for_save`` was the gather thread preempting
the step on the one pinned core). Where the worker is pinned to a strict subset of the CPUs
its parent (vLLM's engine process) may use, the connector's threads may also run on the
parent's CPUs that no pinned worker uses (the connector decides which threads get which).
Where nothing is pinned (a GPU worker) nothing changes.
Linux only (``os.sched_getaffinity``); elsewhere, and on any error, threads stay as they are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["pin_current_thread", "spare_cpus", "worker_spare_cpus"]

log = logging.getLogger("kvtier.integrations.vllm")


def spare_cpus(own: set[int], parent: set[int], siblings: Iterable[set[int]] = ()) -> set[int]:
    """The parent's CPUs that neither this process nor a pinned sibling uses; empty unless
    this process is pinned to a strict subset of the parent's CPUs. A sibling that uses all
    of the parent's CPUs is not pinned and takes none."""
    if not own < parent:
        return set()
    taken = set(own)
    for cpus in siblings:
        if cpus < parent:
            taken |= cpus
    return parent - taken


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return []
    return found


def worker_spare_cpus() -> set[int]:
    """:func:`spare_cpus` for this process: its CPUs, its parent's, and those of the
    parent's other children (the other workers); empty where it cannot tell."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        own = os.sched_getaffinity(0)
        parent_pid = os.getppid()
        parent = os.sched_getaffinity(parent_pid)
    except OSError:
        return set()
    siblings = []
    for child in _children(parent_pid):
        if child != os.getpid():
            try:
                siblings.append(os.sched_getaffinity(child))
            except OSError:
                continue  # exited meanwhile
    return spare_cpus(own, parent, siblings)


def pin_current_thread(cpus: set[int]) -> None:
    """Run the calling thread (and threads it starts later) on ``cpus``; a refusal (a
    cgroup's cpuset) leaves it where it is."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError) as exc:
        log.debug("kvtier could not move a thread to CPUs %s: %r", sorted(cpus), exc)
