"""The directory around an LMDB tier's environment: ownership, crash marker, disk reserve.

- One process owns a directory: :func:`lock_directory` takes ``flock`` on ``kvtier.lock``
  (a second opener gets :class:`~kvtier.errors.DirectoryLockedError`).
- :func:`check_unclean_shutdown` reads and rewrites the open marker ``kvtier.open`` (the
  kernel boot id while the tier is open, removed by :func:`mark_clean_close`), and discards
  a ``sync=0`` cache left open across an OS crash.
- :func:`preallocate` reserves ``data.mdb`` on disk for ``writemap``.

All of it is blocking file work: call it from a worker thread (or at construction).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from kvtier.errors import ConfigError, DirectoryLockedError

__all__ = ["check_unclean_shutdown", "lock_directory", "mark_clean_close", "preallocate"]

log = logging.getLogger("kvtier.tiers.lmdb")

_LOCK_NAME = "kvtier.lock"
_DIRTY_NAME = "kvtier.open"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text(encoding="ascii").strip() or None
    except OSError:
        return None


def _read_marker(marker: Path) -> str | None:
    """The boot id recorded in the open marker; ``None`` if absent or unreadable."""
    try:
        text = marker.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):  # FileNotFoundError: a clean close
        return None
    if not text or text == "unknown" or not all(c in "0123456789abcdef-" for c in text):
        return None
    return text


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write", str(tmp))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def lock_directory(path: Path) -> int:
    """Take the exclusive lock of directory ``path``; returns the lock file's descriptor
    (closing it releases the lock).

    Raises
    ------
    DirectoryLockedError
        If another process (or another tier of this one) holds it.
    """
    fd = os.open(path / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DirectoryLockedError(
                f"path: LMDB directory {str(path)!r} is already open (holder pid {holder}); "
                "one process owns a directory - give each process its own path") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_unclean_shutdown(path: Path, *, sync: str, name: str) -> bool:
    """Discard the environment in ``path`` if it was open, with ``sync=0``, when the machine
    went down; then write the open marker. Returns whether the cache was discarded.

    With ``sync=0`` an OS crash or power loss may leave ``data.mdb`` inconsistent (LMDB's
    own warning for ``MDB_NOSYNC``), and a damaged B-tree can crash a reader. A marker
    holding the kernel boot id exists while the tier is open; finding one from an earlier
    boot means the machine went down with the tier open, so the cache is discarded. A marker
    from this boot is only a process crash: committed pages were in the page cache and
    survive, so the data is kept. A marker that cannot be read (empty, garbled, unreadable)
    proves nothing and keeps the data too. The marker is replaced atomically; when it cannot
    be written (a full disk) the tier opens anyway.
    """
    marker = path / _DIRTY_NAME
    boot = _boot_id()
    recorded = _read_marker(marker)
    discarded = False
    if sync == "0" and recorded is not None and boot is not None and recorded != boot:
        log.warning("lmdb tier %s: %s was open (sync=0) when the machine went down; "
                    "discarding the cache", name, path)
        for file in ("data.mdb", "lock.mdb"):
            (path / file).unlink(missing_ok=True)
        discarded = True
    try:
        _write_atomically(marker, (boot or "unknown").encode("ascii"))
    except OSError as exc:
        log.warning("lmdb tier %s: cannot write the open marker %s (%s); an OS crash "
                    "before the next clean close will not be detected", name, marker, exc)
    return discarded


def mark_clean_close(path: Path) -> None:
    """Remove the open marker: the environment in ``path`` was closed cleanly."""
    (path / _DIRTY_NAME).unlink(missing_ok=True)


def preallocate(path: Path, map_size: int) -> None:
    """Reserve ``map_size`` bytes of ``path/data.mdb`` on disk.

    With ``writemap`` LMDB writes into a shared mapping of a sparse file, and a write that
    finds the disk full is a SIGBUS. Reserve the whole map on disk before the first write
    (the file exists: LMDB created its meta pages).

    Raises
    ------
    ConfigError
        If the file system cannot reserve it.
    """
    data = path / "data.mdb"
    fd = os.open(data, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, map_size)
    except OSError as exc:
        raise ConfigError(
            f"writemap: cannot preallocate {map_size} bytes for {str(data)!r} "
            f"({exc.strerror}); writemap=1 needs the whole map reserved on disk (a full "
            "disk would otherwise kill the process with SIGBUS) - free space, lower "
            "capacity, or use writemap=0") from None
    finally:
        os.close(fd)
