"""The files a host daemon keeps under ``/dev/shm``: its arena, its lock and its socket.

``kvtier serve --shm NAME`` holds an exclusive ``flock`` on ``kvtier-NAME.lock`` for its
whole life, so a second daemon with the same NAME is refused while the first lives, and the
kernel drops the lock the moment it dies (no stale-pid guessing); a clean stop unlinks it.
Its arena is ``kvtier-NAME.INSTANCE.arena`` (mode 0600), sized once and **never
truncated**: a restarted daemon unlinks a dead one's arena and creates a new file under a
new instance id, so an engine that still maps the old one keeps valid (if orphaned) pages
instead of taking a SIGBUS on memory that a truncate took away; its leases on the old
instance fail and turn into misses.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
from pathlib import Path

from kvtier.errors import ConfigError

__all__ = ["SHM_DIR", "SharedArenaFile", "check_room", "map_arena", "socket_path",
           "validate_name"]

#: Where the daemon's files live (POSIX shared memory is a tmpfs mounted here on Linux).
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def validate_name(name: object, what: str = "--shm") -> str:
    """Return ``name`` if it is a daemon name (1-64 of ``[A-Za-z0-9_.-]``, not starting
    with a dot or dash: it becomes part of file names).

    Raises
    ------
    ConfigError
        Naming ``what`` and the rule.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{what}: expected a name of 1-64 letters, digits, '_', '.', '-' "
                          f"(not starting with '.' or '-'), got {name!r}")
    return name


def socket_path(name: str) -> Path:
    """The daemon's control socket for ``name``."""
    return SHM_DIR / f"kvtier-{validate_name(name)}.sock"


def _lock_path(name: str) -> Path:
    return SHM_DIR / f"kvtier-{name}.lock"


def _lock(name: str, flag: str) -> int:
    """An fd of ``name``'s lock file holding its exclusive ``flock``.

    Raises
    ------
    ConfigError
        If a live daemon holds it.
    """
    path = _lock_path(name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise ConfigError(f"{flag} {name}: another kvtier serve already serves this "
                              f"name (pid {holder or 'unknown'}); stop it or pick another "
                              "name") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder unlinked it at close: lock the file now at the path


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def check_room(nbytes: int, flag: str, directory: Path = SHM_DIR) -> None:
    """Refuse an arena of ``nbytes`` that ``directory``'s filesystem has no room for.

    tmpfs allocates a shared file's pages on first touch; without room the daemon (or an
    engine writing a save into it) would die of SIGBUS in the middle of a copy, not fail at
    open. Docker gives a container 64 MiB of ``/dev/shm`` unless told otherwise.

    Raises
    ------
    ConfigError
        Naming the size asked, the room there is and ``flag``.
    """
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot use {directory} for the shared arena: {exc}"
                          ) from None
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ConfigError(
            f"{flag}: the shared arena needs {_size(nbytes)} ({nbytes} bytes) of {directory}, "
            f"which has {_size(free)} free: give it more room (Docker: docker run "
            f"--shm-size={(nbytes >> 20) + 64}m; Kubernetes: an emptyDir with medium: Memory "
            f"mounted at {directory}) or lower the dram:// capacity")


class SharedArenaFile:
    """The daemon's side: lock ``name``, then create and map a fresh arena of ``nbytes``.

    Parameters
    ----------
    name
        The daemon's name (:func:`validate_name`).
    nbytes
        Arena size in bytes (a multiple of the page size).
    flag
        How the user asked for it, for error messages (``--shm NAME``).

    Raises
    ------
    ConfigError
        If another live daemon holds ``name``, or ``/dev/shm`` has no room.

    Concurrency: created and closed on one thread; :attr:`map` may be read and written from
    any thread and any process that maps the file.
    """

    def __init__(self, name: str, nbytes: int, *, flag: str = "--shm") -> None:
        self.name = validate_name(name, flag)
        self.nbytes = nbytes
        self._lock_fd = _lock(name, flag)
        try:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)
            check_room(nbytes, f"{flag} {name}")
            for stale in [*SHM_DIR.glob(f"kvtier-{name}.*.arena"),
                          *SHM_DIR.glob(f"kvtier-{name}.*.index")]:
                # A dead daemon's arena and index (we hold the lock): unlinked, never
                # truncated, so an engine still mapping one reads orphaned pages, never a
                # SIGBUS.
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            self.instance = secrets.token_hex(8)
            self.path = SHM_DIR / f"kvtier-{name}.{self.instance}.arena"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                #: The arena, mapped shared (what :class:`~kvtier.tiers.dram_arena.HostArena`
                #: carves slots from).
                self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    def close(self) -> None:
        """Unlink the arena and the lock file and release the name. Mappings (the daemon's
        own views, engines') stay valid until they are dropped. Calling it again does
        nothing."""
        if self._lock_fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(FileNotFoundError):
            # Unlinked while held: a daemon that opened this file meanwhile sees, once it
            # has the lock, that the path no longer names it, and starts over (_lock).
            _lock_path(self.name).unlink()
        self._unlock()


def map_arena(path: str, nbytes: int) -> mmap.mmap:
    """The engine's side: map the daemon's arena at ``path`` (read-write, shared).

    Raises
    ------
    OSError
        If the file is gone, not ours to open, or shorter than ``nbytes`` (a daemon never
        shrinks its arena, so a short file is not one of ours: mapping past its end would
        fault).
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise OSError(f"{path}: {size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
