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
old its blocks are and its co-owners' newer values and tombstones win.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

__all__ = ["STAMP_HEADER", "HybridClock", "Versions", "format_stamps", "parse_stamps",
           "stamped", "write_stamp"]

#: Request header of a write's stamp(s): one decimal u64, or for a batch put or delete a
#: comma-separated list with one per entry, in body order.
STAMP_HEADER = "Kvtier-Stamp"
_MAX_STAMP = (1 << 64) - 1
_RECORD = struct.Struct("<BQdH")  # kind, stamp, wall time, key length; then the key
_VALUE, _TOMB, _FORGET = 1, 2, 3
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
    max_entries
        Most block stamps kept (the oldest go first: their blocks then count as of unknown
        age, which loses to every stamp); tombstones are bounded by the same number.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, grace: float = 600.0,
                 max_entries: int = 4 << 20) -> None:
        if not grace >= 0:
            raise ValueError(f"grace: expected >= 0 seconds, got {grace!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, got {max_entries!r}")
        self.grace = grace
        self.max_entries = max_entries
        self.clock = HybridClock()
        self.stamps: dict[bytes, int] = {}
        #: key -> (stamp, wall time it settled: every owner held it; 0.0 not yet).
        self.tombs: dict[bytes, tuple[int, float]] = {}
        self.dropped = 0  # entries dropped at max_entries
        self._path = None if path is None else Path(path)
        self._fd: int | None = None
        self._pending = bytearray()
        if self._path is not None:
            self._load(self._path)

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
        if held is None or stamp > held:
            return True
        return None if stamp == held else False

    # ------------------------------------------------------------------ changes
    def stored(self, key: bytes, stamp: int) -> None:
        """A block stamped ``stamp`` was stored (any tombstone of the key is superseded)."""
        self.clock.observe(stamp)
        if self.tombs.pop(key, None) is not None or self.stamps.get(key) != stamp:
            self.stamps.pop(key, None)
            self.stamps[key] = stamp
            if self._path is not None:
                self._log(_VALUE, key, stamp, 0.0)
            if len(self.stamps) > self.max_entries:
                old = next(iter(self.stamps))
                del self.stamps[old]
                self.dropped += 1
                self._log(_FORGET, old, 0, 0.0)

    def deleted(self, key: bytes, stamp: int, *, settled: bool = False) -> None:
        """A delete stamped ``stamp`` applied: the key's tombstone (``settled``: no other
        owner needs telling)."""
        self.clock.observe(stamp)
        self.stamps.pop(key, None)
        old = self.tombs.pop(key, None)
        stamp = max(stamp, old[0] if old else 0)
        when = time.time() if settled else 0.0
        self.tombs[key] = (stamp, when)
        self._log(_TOMB, key, stamp, when)
        if len(self.tombs) > self.max_entries:
            del self.tombs[next(iter(self.tombs))]
            self.dropped += 1

    def forget(self, key: bytes) -> None:
        """The segment no longer holds ``key`` (evicted): drop its block stamp."""
        if self.stamps.pop(key, None) is not None:
            self._log(_FORGET, key, 0, 0.0)

    def settle(self, key: bytes, stamp: int) -> None:
        """Every owner holds the tombstone of ``key`` at ``stamp`` or newer: its grace
        period starts."""
        tomb = self.tombs.get(key)
        if tomb is not None and tomb[0] <= stamp and not tomb[1]:
            self.tombs[key] = (tomb[0], time.time())
            self._log(_TOMB, key, tomb[0], self.tombs[key][1])

    def expire(self, now: float | None = None) -> int:
        """Drop the tombstones settled more than ``grace`` ago; returns how many."""
        now = time.time() if now is None else now
        gone = [k for k, (_, when) in self.tombs.items() if when and now - when > self.grace]
        for key in gone:
            del self.tombs[key]
            self._log(_FORGET, key, 0, 0.0)
        return len(gone)

    # -------------------------------------------------------------- persistence
    def _log(self, kind: int, key: bytes, stamp: int, when: float) -> None:
        if self._path is not None:
            self._pending += _RECORD.pack(kind, stamp, when, len(key)) + key

    def flush(self) -> None:
        """Append the changes since the last flush to the log (one small write: the page
        cache takes it in microseconds, and it survives the process being killed)."""
        if self._fd is not None and self._pending:
            data, self._pending = bytes(self._pending), bytearray()
            os.write(self._fd, data)

    def close(self) -> None:
        """Flush and close the log."""
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _load(self, path: Path) -> None:
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
                    self.tombs.pop(key, None)
                    self.stamps.pop(key, None)
                    self.stamps[key] = stamp
                elif kind == _TOMB:
                    self.stamps.pop(key, None)
                    self.tombs[key] = (stamp, when)
                else:
                    self.stamps.pop(key, None)
                    self.tombs.pop(key, None)
                self.clock.observe(stamp)
            if off != len(data):
                os.truncate(path, off)  # appends must start on a record boundary
        entries = len(self.stamps) + len(self.tombs)
        if records > _COMPACT_FACTOR * entries + 1024 or not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as out:
                for key, stamp in self.stamps.items():
                    out.write(_RECORD.pack(_VALUE, stamp, 0.0, len(key)) + key)
                for key, (stamp, when) in self.tombs.items():
                    out.write(_RECORD.pack(_TOMB, stamp, when, len(key)) + key)
            os.replace(tmp, path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
