"""The gc lease of a shared directory: one holder at a time, taken over once expired.

Held by whoever runs a gc of the directory (``kvtier gc``, or a tier's background gc with
``fleet_capacity=``), refreshed while the gc works, released at its end, and taken over by
another node once it has not been refreshed for ``ttl`` seconds (its holder crashed or
lost the mount).

The lease is a sequence of generations, ``ROOT/.kvtier-gc/lease.<n>``: the highest one is
the lease, its holder's token inside, its mtime the last refresh. To take the lease, a node
creates the next generation exclusively; so of several nodes taking over one expired lease
at once, exactly one wins, and nothing is ever renamed or deleted under a live holder.

How it is made atomic on NFS-like mounts (the assumptions)
----------------------------------------------------------
- **Exclusive create:** the contender writes its token into a unique temp file and
  ``link()``-s it to ``lease.<n+1>``. ``link`` fails if the name exists, atomically at the
  server, on every NFS version (``O_EXCL`` create was not atomic before NFSv3). An error
  from a retransmitted ``link`` whose first try worked is recognised by the temp file's
  link count of 2.
- **Expiry** compares the highest generation's mtime with the temp file's, which the same
  server just stamped: client clocks do not enter into it. The holder refreshes with
  ``utime(path, None)``, which NFS sets to the server's time; a release sets it to 0.
  ``ttl`` must be well above the mount's attribute cache time (``actimeo``); files are
  opened before they are stat-ed, so close-to-open consistency revalidates them.
- **Checks by listing:** after its ``link``, and at every refresh, a holder lists the lease
  folder (its own ``link`` just changed the folder, so the listing is fresh): a higher
  generation means another node took over (this one stalled past ``ttl``), and it stops.
  A winner deletes the generations below its own.

Nodes must not share one lease object (each makes its own token).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from dataclasses import dataclass

__all__ = ["LEASE_DIR", "GcLease", "LeaseHolder"]

#: Folder under the tier root holding the lease generations.
LEASE_DIR = ".kvtier-gc"
_LEASE_RE = re.compile(r"^lease\.(\d+)$")


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
    """The gc lease of ``root``: at most one holder at a time, taken over once expired.

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
        self.directory = os.path.join(root, LEASE_DIR)
        self.holder = holder
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self.generation = 0  # held while > 0
        self.takeovers = 0  # leases taken over from a holder that did not release them
        self.last_seen: LeaseHolder | None = None  # the other holder when acquire failed

    @property
    def held(self) -> bool:
        """Whether this object holds the lease (as of its last acquire or refresh)."""
        return self.generation > 0

    @property
    def path(self) -> str:
        """The file of the lease held (or last held)."""
        return self._path(self.generation)

    def _path(self, generation: int) -> str:
        return os.path.join(self.directory, f"lease.{generation}")

    @property
    def _text(self) -> str:
        return f"{self.token} {self.holder}\n"

    def _generations(self) -> list[int]:
        with os.scandir(self.directory) as it:
            return sorted(int(m.group(1)) for e in it if (m := _LEASE_RE.match(e.name)))

    def acquire(self) -> bool:
        """Take the lease if it is free or expired; whether this holder has it now."""
        if self.held:
            return self.refresh()
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(self.directory, f".{self.token}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, self._text.encode())
            now = os.fstat(fd).st_mtime  # the server's clock, as the lease's mtime is
        finally:
            os.close(fd)
        try:
            return self._contend(tmp, now)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _contend(self, tmp: str, now: float) -> bool:
        for _ in range(3):
            generations = self._generations()
            current = generations[-1] if generations else 0
            mtime = 0.0
            if current:
                try:
                    text, mtime = _read(self._path(current))
                except FileNotFoundError:
                    continue  # superseded and cleaned up meanwhile: look again
                self.last_seen = LeaseHolder(text.partition(" ")[2].strip(), now - mtime)
                if now - mtime <= self.ttl:
                    return False
            if not self._link(tmp, self._path(current + 1)):
                with contextlib.suppress(FileNotFoundError):  # another contender won it
                    text, _ = _read(self._path(current + 1))
                    self.last_seen = LeaseHolder(text.partition(" ")[2].strip(), 0.0)
                return False
            self.generation = current + 1
            if not self._highest():
                self._drop(self.generation)
                self.generation = 0
                return False
            self.takeovers += mtime > 0  # not released: its holder died or stalled
            self.last_seen = None
            for older in generations:
                self._drop(older)
            self._drop_leftovers(now)
            return True
        return False

    @staticmethod
    def _link(tmp: str, path: str) -> bool:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            # NFS: a retransmitted LINK may fail although the first one worked.
            if os.stat(tmp).st_nlink != 2:
                raise
        return True

    def _drop(self, generation: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(generation))

    def _drop_leftovers(self, now: float) -> None:
        """Remove temp files of contenders that died between creating and removing them."""
        with os.scandir(self.directory) as it:
            temps = [e.path for e in it if e.name.startswith(".") and e.name.endswith(".tmp")]
        for path in temps:
            with contextlib.suppress(FileNotFoundError):
                if now - os.stat(path).st_mtime > 2 * self.ttl:
                    os.unlink(path)

    def _highest(self) -> bool:
        """Whether no later generation than this holder's exists."""
        generations = self._generations()
        return not generations or generations[-1] <= self.generation

    def _still_mine(self) -> bool:
        try:
            text, _ = _read(self.path)
        except FileNotFoundError:
            return False
        return text == self._text and self._highest()

    def refresh(self) -> bool:
        """Renew the lease; ``False`` (and no longer held) if another node took it over:
        the gc stops."""
        if not self.held:
            return False
        try:
            if self._still_mine():
                os.utime(self.path)
                return True
        except FileNotFoundError:
            pass
        self.generation = 0
        return False

    def release(self) -> None:
        """Give the lease back (it expires at once), if it is still this holder's."""
        if not self.held:
            return
        with contextlib.suppress(FileNotFoundError):
            if self._still_mine():
                os.utime(self.path, (0, 0))
        self.generation = 0
