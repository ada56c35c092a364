"""Versions and tombstones of a peer server's blocks (docs/peer-protocol.md, "Stamps").

Every write a client sends carries a *stamp*: a hybrid logical clock of the writer, a u64
of unix milliseconds shifted left 16 bits plus a counter (:class:`HybridClock`), in the
``Kvtier-Stamp`` request header (a few bytes a request, no extra round trip). The server
keeps the stamp of each block it holds and, for a deleted key, a *tombstone* with the
delete's stamp, and applies one rule to every write: **a write lands only if its stamp is
newer than what the server holds for the key** (the block's stamp, or its tombstone's).
So a replica back from a crash, or an anti-entropy push, never puts an older value over a
newer one or over a delete. Stamp 0 means "unknown" (a block from before stamps, or a
repair write that carried none) and loses to every stamp.

With a ``path`` the index is persistent: an append-only log next to the segment's files,
replayed (and compacted) at open, so a member restarted on its LMDB directory knows how
old its blocks are and its co-owners' newer values and tombstones win. The log is written
by a worker thread in batches, and a write request is answered only once its records are
in the file (:mod:`kvtier.peer.stamplog` says what survives a crash).

The index is bounded in bytes (``max_bytes``, an estimate of the dictionaries' memory).
Past it the oldest block stamps go first: their blocks count as of unknown age (stamp 0),
which loses to every stamped write. Only when no block stamp is left do the oldest
tombstones go, and a tombstone dropped so, before its grace period ended, raises the
*floor*: a write of a key that this server knows nothing about (no block stamp, no
tombstone) lands only if its stamp is newer than the floor. So a forgotten tombstone is
never undone by a late repair or hint of an older value; fresh client writes carry stamps
newer than the floor and land as before. The floor is kept in the log.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from kvtier.peer.stamplog import StampLog

__all__ = ["STAMP_HEADER", "HybridClock", "Versions", "format_stamps", "parse_stamps",
           "stamped", "write_stamp"]

#: Request header of a write's stamp(s): one decimal u64, or for a batch put or delete a
#: comma-separated list with one per entry, in body order.
STAMP_HEADER = "Kvtier-Stamp"
_MAX_STAMP = (1 << 64) - 1
_RECORD = struct.Struct("<BQdH")  # kind, stamp, wall time, key length; then the key
_VALUE, _TOMB, _FORGET, _FLOOR = 1, 2, 3, 4
# Estimated bytes of one entry past its key: a block stamp (dict slot, bytes and int
# objects) and a tombstone (plus its tuple and float); measured with tracemalloc on
# CPython 3.11-3.12 for 32-byte keys, rounded up.
_STAMP_COST, _TOMB_COST = 128, 208
# Without ``wait``, the most bytes of records the log may owe before a write waits for it
# (the writer's queue stays bounded when the disk stalls).
_MAX_BACKLOG = 8 << 20
_COMPACT_FACTOR = 4  # the log is rewritten at open once it holds this many records per entry

#: The stamp of the client write in progress in this task (set by :func:`stamped`): every
#: copy of one put or delete, on every member and fallback, carries the same stamp, and a
#: put's background copies (tasks it starts) inherit it. Only plain writes send it: a
#: repair write (``fill``) is sent with the stamps it was given, or none.
write_stamp: ContextVar[int | None] = ContextVar("kvtier_write_stamp", default=None)


@contextlib.contextmanager
def stamped(stamp: int) -> Iterator[None]:
    """Run the block with :data:`write_stamp` set to ``stamp``."""
    token = write_stamp.set(stamp)
    try:
        yield
    finally:
        write_stamp.reset(token)


def format_stamps(stamps: list[int]) -> str:
    """A :data:`STAMP_HEADER` value (one stamp, or a list when they differ)."""
    return str(stamps[0]) if len(set(stamps)) == 1 else ",".join(map(str, stamps))


def parse_stamps(value: str | bytes | None, count: int) -> list[int] | None:
    """The stamps of ``count`` entries from a :data:`STAMP_HEADER` value (one stamp for all,
    or one per entry); ``None`` when absent.

    Raises
    ------
    ValueError
        For anything but decimal u64s, or a list of another length than ``count``.
    """
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if text.isdigit() and len(text) < 20:  # the common case: one stamp, below 2**64
        return [int(text)] * count
    parts = text.split(",")
    if len(parts) not in (1, count) or any(not p.strip().isdigit() or len(p.strip()) > 20
                                           for p in parts):
        raise ValueError(f"{STAMP_HEADER}: expected 1 or {count} decimal stamps")
    stamps = [int(p) for p in parts]
    if any(s > _MAX_STAMP for s in stamps):
        raise ValueError(f"{STAMP_HEADER}: a stamp exceeds 64 bits")
    return stamps * count if len(stamps) == 1 and count != 1 else stamps


class HybridClock:
    """Stamps that grow with wall time and never repeat or go back in this process."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        """A stamp newer than every stamp this clock made or :meth:`observe`-d."""
        now = int(time.time() * 1000) << 16
        self._last = max(now, self._last + 1)
        return self._last

    def observe(self, stamp: int) -> None:
        """Keep later stamps newer than ``stamp`` (one a client wrote with)."""
        if stamp > self._last:
            self._last = stamp


class Versions:
    """The stamps of the blocks one server holds, and its tombstones.

    Parameters
    ----------
    path
        The log to keep them in across restarts (``None``: in memory only).
    grace
        Seconds a tombstone is kept once every owner holds it (or, without anti-entropy to
        say so, once written).
    max_bytes
        Most bytes of memory the stamps and tombstones take (estimated); past it the
        oldest block stamps go, then the oldest tombstones, raising the floor (see the
        module's docstring).
    fsync
        Whether the log is fsynced before a write is answered (when the data tier fsyncs).
    wait
        Whether :meth:`commit` waits until the records are in the file (a persistent data
        tier, whose blocks outlive a crash of the process) or only hands them to the
        writer thread (a volatile one: a crash loses its blocks, and with them what their
        last records said, so answering before the log is written loses nothing more).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, grace: float = 600.0,
                 max_bytes: int = 256 << 20, fsync: bool = False, wait: bool = True) -> None:
        if not grace >= 0:
            raise ValueError(f"grace: expected >= 0 seconds, got {grace!r}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes: expected >= 1, got {max_bytes!r}")
        self.grace = grace
        self.max_bytes = max_bytes
        self.wait = wait
        self.clock = HybridClock()
        self.stamps: dict[bytes, int] = {}
        #: key -> (stamp, wall time it settled: every owner held it; 0.0 not yet).
        self.tombs: dict[bytes, tuple[int, float]] = {}
        #: Writes of keys with no entry land only if newer (raised by dropped tombstones).
        self.floor = 0
        self.nbytes = 0  # estimated memory of the entries
        self.dropped = 0  # entries dropped at max_bytes
        self._path = None if path is None else Path(path)
        self._file: StampLog | None = None
        if self._path is not None:
            self._load(self._path, fsync)

    # ------------------------------------------------------------------ queries
    def held(self, key: bytes) -> int:
        """The newest stamp held for ``key``: its block's or its tombstone's (0: none)."""
        tomb = self.tombs.get(key)
        return max(self.stamps.get(key, 0), tomb[0] if tomb else 0)

    def state(self, key: bytes, present: bool) -> tuple[int, int]:
        """``(kind, stamp)`` of ``key``: kind 2 tombstone, 1 a block ``present`` in the
        segment, 0 neither."""
        tomb = self.tombs.get(key)
        stamp = self.stamps.get(key, 0)
        if tomb is not None and tomb[0] >= stamp:
            return 2, tomb[0]
        return (1, stamp) if present else (0, 0)

    def admits(self, key: bytes, stamp: int) -> bool | None:
        """Whether a write stamped ``stamp`` lands: ``True``/``False``, or ``None`` when it
        ties the block's own stamp (it lands only if the segment lost the block)."""
        tomb = self.tombs.get(key)
        if tomb is not None and stamp <= tomb[0]:
            return False
        held = self.stamps.get(key)
        if held is None:
            # Nothing known: a tombstone dropped at max_bytes may have been newer.
            return tomb is not None or stamp > self.floor or not self.floor
        if stamp > held:
            return True
        return None if stamp == held else False

    def admits_fill(self, key: bytes) -> bool | None:
        """Whether a repair write without a stamp (``fill``: only where the key has no
        block and no tombstone) lands: ``False``, or ``None`` (if the segment lacks it).
        Never past a floor: a tombstone dropped at ``max_bytes`` may have been the key's."""
        return False if key in self.tombs or self.floor else None

    # ------------------------------------------------------------------ changes
    def stored(self, key: bytes, stamp: int) -> None:
        """A block stamped ``stamp`` was stored (any tombstone of the key is superseded)."""
        self.clock.observe(stamp)
        tomb = self.tombs.pop(key, None)
        if tomb is not None:
            self.nbytes -= len(key) + _TOMB_COST
        if tomb is not None or self.stamps.get(key) != stamp:
            if self.stamps.pop(key, None) is None:
                self.nbytes += len(key) + _STAMP_COST
            self.stamps[key] = stamp
            self._log(_VALUE, key, stamp, 0.0)
            self._bound()

    def deleted(self, key: bytes, stamp: int, *, settled: bool = False) -> None:
        """A delete stamped ``stamp`` applied: the key's tombstone (``settled``: no other
        owner needs telling)."""
        self.clock.observe(stamp)
        if self.stamps.pop(key, None) is not None:
            self.nbytes -= len(key) + _STAMP_COST
        old = self.tombs.pop(key, None)
        if old is None:
            self.nbytes += len(key) + _TOMB_COST
        stamp = max(stamp, old[0] if old else 0)
        when = time.time() if settled else 0.0
        self.tombs[key] = (stamp, when)
        self._log(_TOMB, key, stamp, when)
        self._bound()

    def forget(self, key: bytes) -> None:
        """The segment no longer holds ``key`` (evicted): drop its block stamp."""
        if self.stamps.pop(key, None) is not None:
            self.nbytes -= len(key) + _STAMP_COST
            self._log(_FORGET, key, 0, 0.0)

    def settle(self, key: bytes, stamp: int) -> None:
        """Every owner holds the tombstone of ``key`` at ``stamp`` or newer: its grace
        period starts."""
        tomb = self.tombs.get(key)
        if tomb is not None and tomb[0] <= stamp and not tomb[1]:
            self.tombs[key] = (tomb[0], time.time())
            self._log(_TOMB, key, tomb[0], self.tombs[key][1])

    def expire(self, now: float | None = None) -> int:
        """Drop the tombstones settled more than ``grace`` ago; returns how many (the
        floor stays: every owner has them, past the grace period)."""
        now = time.time() if now is None else now
        gone = [k for k, (_, when) in self.tombs.items() if when and now - when > self.grace]
        for key in gone:
            del self.tombs[key]
            self.nbytes -= len(key) + _TOMB_COST
            self._log(_FORGET, key, 0, 0.0)
        return len(gone)

    def _bound(self) -> None:
        """Drop the oldest entries past ``max_bytes``: block stamps first, then tombstones
        (raising the floor to theirs)."""
        while self.nbytes > self.max_bytes and (self.stamps or self.tombs):
            self.dropped += 1
            if self.stamps:
                key = next(iter(self.stamps))
                del self.stamps[key]
                self.nbytes -= len(key) + _STAMP_COST
            else:
                key = next(iter(self.tombs))
                stamp, _ = self.tombs.pop(key)
                self.nbytes -= len(key) + _TOMB_COST
                if stamp > self.floor:
                    self.floor = stamp
                    self._log(_FLOOR, b"", stamp, 0.0)
            self._log(_FORGET, key, 0, 0.0)

    # -------------------------------------------------------------- persistence
    def _log(self, kind: int, key: bytes, stamp: int, when: float) -> None:
        if self._file is not None:
            self._file.append(_RECORD.pack(kind, stamp, when, len(key)) + key)

    def flush(self) -> None:
        """Hand the changes made since the last flush to the log's writer thread (no wait:
        for background work; a write request awaits :meth:`commit`)."""
        if self._file is not None:
            self._file.flush()

    async def commit(self) -> None:
        """Return once every change made so far is in the log (see
        :mod:`kvtier.peer.stamplog`); at once without a log, with nothing pending, or
        without ``wait`` (the changes are then handed to the writer thread), unless the
        log owes more than 8 MiB of records then (a stalled disk).

        Raises
        ------
        OSError
            If the log could not be written.
        """
        if self._file is None:
            return
        if self.wait or self._file.backlog > _MAX_BACKLOG:
            await self._file.commit()
        else:
            self._file.flush()

    async def aclose(self) -> None:
        """Write what is pending and close the log."""
        if self._file is not None:
            await self._file.aclose()

    def close(self) -> None:
        """Write what is pending and close the log, blocking (outside a loop)."""
        if self._file is not None:
            self._file.close()

    def _load(self, path: Path, fsync: bool) -> None:
        records = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            data = path.read_bytes()
            off = 0
            while off + _RECORD.size <= len(data):
                kind, stamp, when, klen = _RECORD.unpack_from(data, off)
                key = data[off + _RECORD.size:off + _RECORD.size + klen]
                if len(key) != klen:
                    break  # a record cut short by a crash: the ones before it stand
                off += _RECORD.size + klen
                records += 1
                if kind == _VALUE:
                    self.stored(key, stamp)
                elif kind == _TOMB:
                    self.deleted(key, stamp)
                    if key in self.tombs:  # (else dropped at max_bytes right away)
                        self.tombs[key] = (self.tombs[key][0], when)
                elif kind == _FLOOR:
                    self.floor = max(self.floor, stamp)
                else:
                    self.forget(key)
                    if self.tombs.pop(key, None) is not None:
                        self.nbytes -= len(key) + _TOMB_COST
                self.clock.observe(stamp)
            if off != len(data):
                os.truncate(path, off)  # appends must start on a record boundary
        entries = len(self.stamps) + len(self.tombs)
        if records > _COMPACT_FACTOR * entries + 1024 or not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as out:
                if self.floor:
                    out.write(_RECORD.pack(_FLOOR, self.floor, 0.0, 0))
                for key, stamp in self.stamps.items():
                    out.write(_RECORD.pack(_VALUE, stamp, 0.0, len(key)) + key)
                for key, (stamp, when) in self.tombs.items():
                    out.write(_RECORD.pack(_TOMB, stamp, when, len(key)) + key)
                if fsync:
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(tmp, path)
        self._file = StampLog(os.open(path, os.O_WRONLY | os.O_APPEND), fsync=fsync)
