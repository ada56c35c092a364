"""Which filesystem a directory lives on, from ``/proc/self/mountinfo`` (Linux).

The ``file://`` tier reads page-cached files on the event loop (``nowait``) only where
``open``/``fstat``/``close`` never leave the host: :func:`check_local` says whether a
directory, and every mount beneath it, is on a filesystem in :data:`LOCAL_FSTYPES`.

A ``mountinfo`` line (``man 5 proc``)::

    36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
    (1)(2) (3)   (4)   (5)         (6)      (7)     (8) (9)   (10)      (11)

(4) root of the mount within its filesystem (a bind mount's source directory), (5) mount
point, (7) zero or more optional fields ended by ``-``, (9) filesystem type, (10) source,
(11) super-block options. Spaces, tabs, newlines and backslashes in paths are written as
octal escapes (``\\040``, ``\\011``, ``\\012``, ``\\134``).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LOCAL_FSTYPES", "MOUNTINFO", "FsCheck", "Mount", "check_local", "mount_of",
           "parse_mountinfo", "read_mountinfo"]

MOUNTINFO = "/proc/self/mountinfo"
# Filesystems whose metadata calls are served by this host's kernel alone: block-device
# filesystems and memory filesystems (``devtmpfs`` is the kernel's tmpfs for ``/dev``, the
# way to ``/dev/shm``). ``overlay`` is a container's root: its upper layer
# (where the tier writes) must give xattrs and d_type, which NFS does not, and Docker,
# containerd and Podman keep the layers on the host's local disk. Everything else (NFS,
# SMB, Ceph, Lustre, GPFS, BeeGFS, WEKA, 9p, virtiofs, every FUSE filesystem...) may wait
# for a server or a user-space daemon, and so does an unknown type.
LOCAL_FSTYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "zfs",
                           "tmpfs", "ramfs", "devtmpfs", "overlay"})
_ESCAPE = re.compile(r"\\([0-7]{3})")
# Symbolic links followed while resolving one path (the kernel's limit).
_MAX_LINKS = 40


@dataclass(frozen=True)
class Mount:
    """One line of ``mountinfo``: the fields :func:`check_local` uses."""

    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    fstype: str
    source: str


@dataclass(frozen=True)
class FsCheck:
    """The answer of :func:`check_local`.

    Attributes
    ----------
    fstype
        Filesystem type of the mount holding the directory (``None``: unknown).
    local
        Whether that mount and every mount beneath the directory are in
        :data:`LOCAL_FSTYPES`.
    reason
        Why, in words (for logs).
    """

    fstype: str | None
    local: bool
    reason: str


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse the text of a ``mountinfo`` file.

    Raises
    ------
    ValueError
        On a malformed line: a mount that cannot be read could be the one that matters.
    """
    mounts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mount_id, parent_id = int(fields[0]), int(fields[1])
            fstype, source = fields[sep + 1], fields[sep + 2]
        except (ValueError, IndexError):
            raise ValueError(f"mountinfo line {number}: cannot parse {line!r}") from None
        mounts.append(Mount(mount_id, parent_id, _unescape(fields[3]), _unescape(fields[4]),
                            _unescape(fstype), _unescape(source)))
    return mounts


def read_mountinfo(path: str = MOUNTINFO) -> list[Mount] | None:
    """This process's mounts; ``None`` where ``path`` cannot be read or parsed (not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            return parse_mountinfo(file.read())
    except (OSError, ValueError):
        return None


def _under(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or inside it (whole components)."""
    return directory == "/" or path == directory or path.startswith(directory + "/")


def mount_of(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount that holds absolute, symlink-free ``path``: the longest mount point that
    is a prefix of it; of several mounts on one point, the one on top (no other mount on
    that point is its child; the last listed if that leaves several)."""
    best: list[Mount] = []
    for mount in mounts:
        if not _under(path, mount.mount_point):
            continue
        if not best or len(mount.mount_point) > len(best[0].mount_point):
            best = [mount]
        elif mount.mount_point == best[0].mount_point:
            best.append(mount)
    if not best:
        return None
    parents = {mount.parent_id for mount in best}
    on_top = [mount for mount in best if mount.mount_id not in parents]
    return (on_top or best)[-1]


def _is_local(mount: Mount | None) -> bool:
    return mount is not None and mount.fstype in LOCAL_FSTYPES


def _resolve(path: str, mounts: Sequence[Mount]) -> tuple[str, Mount | None]:
    """``realpath(path)`` and its mount, looking up only components on local mounts.

    A path that enters a non-local mount stops there with that mount: a symbolic link on
    it could lead back to a local disk, but finding out would wait for its server. The
    part of ``path`` that does not exist yet resolves to the mount of its nearest existing
    ancestor (a directory that does not exist is no mount point)."""
    # Not abspath: it drops ".." before the links in front of it are followed.
    pending = os.path.join(os.getcwd(), path).split("/")
    resolved = "/"
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, part)
        mount = mount_of(candidate, mounts)
        if not _is_local(mount):
            return candidate, mount
        try:
            mode = os.lstat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            rest = os.path.normpath(os.path.join(candidate, *pending))
            return rest, mount_of(rest, mounts)
        if not stat.S_ISLNK(mode):
            resolved = candidate
            continue
        links += 1
        if links > _MAX_LINKS:
            raise OSError(f"too many levels of symbolic links in {path}")
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = "/"
        pending[:0] = target.split("/")
    return resolved, mount_of(resolved, mounts)


def check_local(path: str, mounts: Sequence[Mount] | None) -> FsCheck:
    """Whether metadata calls on ``path`` (a directory that may not exist yet) and on
    everything beneath it stay on this host.

    Parameters
    ----------
    path
        The directory; symbolic links are followed.
    mounts
        This process's mounts (:func:`read_mountinfo`); ``None`` means unknown, so not local.
    """
    if mounts is None:
        return FsCheck(None, False, "no /proc/self/mountinfo: filesystem unknown")
    try:
        real, mount = _resolve(path, mounts)
    except OSError as exc:
        return FsCheck(None, False, f"cannot resolve {path}: {exc}")
    if mount is None:
        return FsCheck(None, False, f"{real} is on no listed mount")
    if mount.fstype not in LOCAL_FSTYPES:
        return FsCheck(mount.fstype, False,
                       f"{real} is on {mount.fstype} ({mount.mount_point}), not a local fs")
    for below in mounts:
        if below.mount_point != real and _under(below.mount_point, real) \
                and not _is_local(below):
            return FsCheck(mount.fstype, False,
                           f"{below.mount_point} beneath {real} is {below.fstype}")
    return FsCheck(mount.fstype, True, f"{real} is on {mount.fstype} ({mount.mount_point})")
