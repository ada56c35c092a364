"""How much host memory this process may still fault in: the smaller of the host's
``MemAvailable`` and its memory cgroup's headroom (limit minus usage).

Why the cgroup: in a container ``/proc/meminfo`` describes the whole host, so a budget taken
from it alone (the DRAM arena's background prefault takes half of it) can exceed the
container's limit, and the kernel OOM-kills the process within seconds of ``open``.

Both cgroup versions are read. v2: ``memory.max`` and ``memory.current`` of the process's
group (the ``0::PATH`` line of ``/proc/self/cgroup``) and of every ancestor up to the mount,
since a parent's limit binds its children too. v1: ``memory.limit_in_bytes`` and
``memory.usage_in_bytes`` the same way (the ``N:memory:PATH`` line; a limit near 2**63 is
v1's "unlimited"). Where the group's path is not visible below the mount (a container that
mounts its own group as the root), the mount's own files are the group's.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_memory", "cgroup_headroom", "meminfo_available"]

#: v1 reports "no limit" as the largest page-aligned signed 64-bit value; anything this
#: large is no limit on any real host.
_UNLIMITED = 1 << 62


def meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` from ``meminfo`` in bytes (``None`` where unknown)."""
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    """An integer file of a cgroup (``None``: missing, unreadable, or ``max``)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _groups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """The process's (v2 path, v1 memory path) from a ``/proc/<pid>/cgroup`` file."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _headroom(mount: Path, group: str, limit_file: str, usage_file: str) -> int | None:
    """The least ``limit - usage`` over ``group`` and its ancestors below ``mount``
    (``None``: no limit set anywhere, or the files are not there)."""
    leaf = mount / group.strip("/")
    if not leaf.is_dir():
        leaf = mount  # the group is this mount's root (a container's own namespace)
    best: int | None = None
    node = leaf
    while True:
        limit = _read_int(node / limit_file)
        if limit is not None and limit < _UNLIMITED:
            usage = _read_int(node / usage_file) or 0
            room = max(0, limit - usage)
            best = room if best is None else min(best, room)
        if node == mount or mount not in node.parents:
            return best
        node = node.parent


def cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup (v2, else v1) still allows, ``None`` when no
    limit is set or no cgroup is found.

    Parameters
    ----------
    proc_cgroup
        The process's cgroup membership file (``/proc/self/cgroup``).
    root
        Where the cgroup filesystems are mounted: v2 at ``root`` itself (or
        ``root/unified`` on a hybrid host), v1's memory controller at ``root/memory``.
    """
    v2, v1 = _groups(proc_cgroup)
    if v2 is not None:
        for mount in (root, root / "unified"):
            if (mount / "cgroup.controllers").exists():
                room = _headroom(mount, v2, "memory.max", "memory.current")
                if room is not None:
                    return room
    if v1 is not None and (root / "memory").is_dir():
        return _headroom(root / "memory", v1, "memory.limit_in_bytes",
                         "memory.usage_in_bytes")
    return None


def available_memory(proc_cgroup: Path = Path("/proc/self/cgroup"),
                     root: Path = Path("/sys/fs/cgroup"),
                     meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes this process can still fault in: the smaller of ``MemAvailable`` and the
    cgroup's headroom, whichever are known (``None`` where neither is)."""
    known = [m for m in (meminfo_available(meminfo), cgroup_headroom(proc_cgroup, root))
             if m is not None]
    return min(known) if known else None
