"""``kvtier gc`` of an ``lmdb://`` directory, including one a running process owns.

One process owns an LMDB directory (``kvtier.lock``, :mod:`kvtier.tiers.lmdb_dir`), so
another process cannot delete blocks from it, and the owner's KV events could not say so
if it did. ``kvtier gc lmdb:///DIR --capacity SIZE`` therefore:

- when nobody owns the directory, opens the tier itself and evicts least recently used
  blocks until it fits (:meth:`~kvtier.tiers.lmdb.LMDBTier.trim`);
- when a process owns it (``kvtier serve``), writes a request (:data:`REQUEST_NAME`:
  ``{"id", "capacity", "by"}``) that the owner's watch (``watch=`` seconds,
  :class:`~kvtier.events_watch.DirectoryWatch`) picks up: the owner trims itself, so its
  store reports every block it drops (``BlockRemoved``, then ``AllBlocksCleared`` for the
  tier when it emptied it), writes the answer (:data:`ANSWER_NAME`: ``{"id", "deleted",
  "freed", "remaining"}``) and removes the request. The gc waits for the answer.

The same watch notices ``data.mdb`` removed or replaced (the directory wiped under the
running process): the tier drops what it held, reporting it, and warns that it writes to
the removed file until it is restarted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.events_watch import DirectoryWatch, write_json_atomically

if TYPE_CHECKING:
    from kvtier.tiers.lmdb import LMDBTier

__all__ = ["ANSWER_NAME", "REQUEST_NAME", "GcRequest", "OwnerWatch", "answer",
           "read_request", "wait_answer", "withdraw", "write_request"]

log = logging.getLogger("kvtier.tiers.lmdb")

REQUEST_NAME = "kvtier.gc-request"
ANSWER_NAME = "kvtier.gc-answer"


@dataclass(frozen=True)
class GcRequest:
    """A gc's request to the directory's owner: trim to ``capacity`` bytes."""

    id: str
    capacity: int
    by: str


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, or not ours
        return None
    return record if isinstance(record, dict) else None


def write_request(directory: Path, capacity: int, by: str) -> GcRequest:
    """Ask the owner of ``directory`` to trim itself to ``capacity`` bytes. Blocking.

    Raises
    ------
    OSError
        When the request cannot be written (a read-only directory).
    """
    request = GcRequest(uuid.uuid4().hex, capacity, by)
    (directory / ANSWER_NAME).unlink(missing_ok=True)
    write_json_atomically(directory / REQUEST_NAME, {"id": request.id,
                                                     "capacity": capacity, "by": by})
    return request


def read_request(directory: Path) -> GcRequest | None:
    """The pending request in ``directory``; ``None`` if there is none or it is malformed."""
    record = _read_json(directory / REQUEST_NAME)
    if record is None:
        return None
    rid, capacity, by = record.get("id"), record.get("capacity"), record.get("by", "")
    if not isinstance(rid, str) or type(capacity) is not int or capacity < 0:
        return None
    return GcRequest(rid, capacity, str(by))


def answer(directory: Path, request: GcRequest, *, deleted: int, freed: int,
           remaining: int) -> None:
    """The owner's answer to ``request``; removes the request. Blocking."""
    write_json_atomically(directory / ANSWER_NAME, {"id": request.id, "deleted": deleted,
                                                    "freed": freed, "remaining": remaining})
    if (current := read_request(directory)) is not None and current.id == request.id:
        (directory / REQUEST_NAME).unlink(missing_ok=True)


def wait_answer(directory: Path, request: GcRequest, timeout: float,
                poll: float = 0.05) -> dict[str, object] | None:
    """The owner's answer to ``request``, polled for up to ``timeout`` seconds (a command
    line tool's wait, not for an event loop); ``None`` if none came."""
    end = time.monotonic() + timeout
    while True:
        record = _read_json(directory / ANSWER_NAME)
        if record is not None and record.get("id") == request.id:
            return record
        if time.monotonic() >= end:
            return None
        time.sleep(poll)


def withdraw(directory: Path, request: GcRequest) -> None:
    """Remove ``request`` if it is still pending (its gc stopped waiting). Blocking."""
    if (current := read_request(directory)) is not None and current.id == request.id:
        (directory / REQUEST_NAME).unlink(missing_ok=True)


class OwnerWatch:
    """The owner's side, held by an open :class:`~kvtier.tiers.lmdb.LMDBTier`: a watch on
    the request file and ``data.mdb`` that answers requests and notices a wipe.

    Parameters
    ----------
    tier
        The tier (open: its environment's ``data.mdb`` inode is the one it watches for).
    interval
        Seconds between looks.
    inode
        The inode of the ``data.mdb`` the tier has open.
    """

    def __init__(self, tier: LMDBTier, interval: float, inode: int) -> None:
        self.tier = tier
        self.data = tier.path / "data.mdb"
        self._inode = inode
        self.watch = DirectoryWatch([tier.path / REQUEST_NAME, self.data], interval,
                                    self._changed, name=f"lmdb tier {tier.name}")
        self.requests = self.wipes = 0

    def start(self) -> None:
        """Start the watch on the running loop."""
        self.watch.start()

    async def aclose(self) -> None:
        """Stop the watch."""
        await self.watch.aclose()

    async def _changed(self) -> None:
        tier = self.tier
        try:
            inode: int | None = (await asyncio.to_thread(self.data.stat)).st_ino
        except FileNotFoundError:
            inode = None
        if inode != self._inode:
            if self.wipes == 0:
                log.warning("lmdb tier %s: %s was removed or replaced under this process (the "
                            "directory was wiped): dropping what the tier held; it writes to "
                            "the removed file until it is restarted", tier.name, self.data)
            self.wipes += 1
            await tier.trim(0)
            return
        request = await asyncio.to_thread(read_request, tier.path)
        if request is None:
            return
        self.requests += 1
        log.info("lmdb tier %s: gc request from %s: trim to %d bytes", tier.name, request.by,
                 request.capacity)
        deleted, freed = await tier.trim(request.capacity)
        await asyncio.to_thread(answer, tier.path, request, deleted=deleted, freed=freed,
                                remaining=tier.used)

    def stats(self) -> dict[str, int]:
        """``gc_requests`` answered, ``wipes`` noticed."""
        return {"gc_requests": self.requests, "wipes": self.wipes}
