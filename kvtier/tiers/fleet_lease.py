"""The gc lease of a shared directory: ``ROOT/.kvtier-gc.lease``, one holder at a time.

Held by whoever runs a gc of the directory (``kvtier gc``, or a tier's background gc with
``fleet_capacity=``), refreshed while the gc works, released at its end, and taken over by
another node once it has not been refreshed for ``ttl`` seconds (its holder crashed or
lost the mount).

How it is made atomic on NFS-like mounts (the assumptions)
----------------------------------------------------------
- **Take:** the contender writes its token to a unique temp file beside the lease and
  ``link()``-s it to the lease name. ``link`` fails if the name exists, atomically at the
  server, on every NFS version (``O_EXCL`` create was not atomic before NFSv3). An error
  from a retransmitted ``link`` whose first try worked is recognised by the temp file's
  link count of 2.
- **Expiry** compares the lease's modification time with the temp file's, which the same
  server just stamped: client clocks do not enter into it. The holder refreshes with
  ``utime(lease, None)``, which NFS sets to the server's time. ``ttl`` must be well above
  the mount's attribute cache time (``actimeo``, 3-60 s); files are opened before they are
  stat-ed, so close-to-open consistency revalidates them.
- **Take-over:** the contender ``rename()``-s the expired lease to a unique name (only one
  contender's rename finds it), then checks that the file it moved is the one it judged
  expired (same token, same mtime). If the lease was refreshed or replaced meanwhile, it
  puts it back with ``link`` and backs off.
- **Refresh and release** first check that the lease still holds this holder's token; a
  holder that finds it gone or replaced has lost it and stops its gc.

Nodes must not share one token (each lease object makes its own).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass

__all__ = ["LEASE_NAME", "GcLease", "LeaseHolder"]

LEASE_NAME = ".kvtier-gc.lease"


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a lease now and how long ago it was refreshed (server clock)."""

    holder: str
    age: float


def _read(path: str) -> tuple[str, float]:
    """The lease file's text and mtime (opened first, so NFS revalidates its attributes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mtime = os.fstat(fd).st_mtime
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    return text, mtime


class GcLease:
    """``ROOT/.kvtier-gc.lease``: at most one holder at a time, taken over once expired.

    Blocking (file system calls): use it from a worker thread. One object per holder; it is
    not safe to share one between threads.

    Parameters
    ----------
    root
        The shared directory.
    holder
        Who this is (host, process), written into the lease for operators.
    ttl
        Seconds after its last refresh that a lease counts as abandoned.
    """

    def __init__(self, root: str, holder: str, ttl: float = 300.0) -> None:
        self.path = os.path.join(root, LEASE_NAME)
        self.holder = holder
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self.held = False
        self.takeovers = 0
        self.last_seen: LeaseHolder | None = None  # the other holder when acquire failed

    @property
    def _text(self) -> str:
        return f"{self.token} {self.holder}\n"

    def acquire(self) -> bool:
        """Take the lease if it is free or expired; whether this holder has it now."""
        tmp = f"{self.path}.{self.token}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, self._text.encode())
            now = os.fstat(fd).st_mtime  # the server's clock, as the lease's mtime is
        finally:
            os.close(fd)
        try:
            for _ in range(3):
                if self._link(tmp):
                    self.held = True
                    self.last_seen = None
                    return True
                try:
                    text, mtime = _read(self.path)
                except FileNotFoundError:
                    continue  # released meanwhile
                self.last_seen = LeaseHolder(text.partition(" ")[2].strip(), now - mtime)
                if now - mtime <= self.ttl or not self._take_over(text, mtime):
                    return False
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _link(self, tmp: str) -> bool:
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError:
            # NFS: a retransmitted LINK may fail although the first one worked.
            if os.stat(tmp).st_nlink != 2:
                raise
        return True

    def _take_over(self, text: str, mtime: float) -> bool:
        """Move the expired lease (``text``, ``mtime``) aside; whether it was that one."""
        aside = f"{self.path}.{self.token}.expired"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # another contender moved it first: try to link again
        try:
            moved, moved_mtime = _read(aside)
            if moved == text and moved_mtime == mtime:
                self.takeovers += 1
                return True
            # Refreshed or replaced since it was read: give it back.
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(aside)

    def _mine(self) -> bool:
        try:
            text, _ = _read(self.path)
        except FileNotFoundError:
            return False
        return text == self._text

    def refresh(self) -> bool:
        """Renew the lease; ``False`` (and no longer held) if it was lost: the gc stops."""
        if not self.held:
            return False
        try:
            if self._mine():
                os.utime(self.path)
                return True
        except FileNotFoundError:
            pass
        self.held = False
        return False

    def release(self) -> None:
        """Give the lease back, if it is still this holder's."""
        if not self.held:
            return
        self.held = False
        aside = f"{self.path}.{self.token}.released"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            text, _ = _read(aside)
            if text != self._text:  # taken over meanwhile: not ours to remove
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(aside)
