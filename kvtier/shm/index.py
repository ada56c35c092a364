"""The daemon's presence index in shared memory: ``contains`` and ``lookup_prefix`` for
engines without a call on the control socket.

``kvtier serve --shm NAME`` keeps ``kvtier-NAME.INSTANCE.index`` beside its arena (mode 0600,
sized once, never truncated, unlinked when the daemon stops or a new daemon of the name
starts). It is an open-addressing table (linear probing) of 64-bit key fingerprints, written
by the daemon alone from its store's KV events and mapped read-only by engines.

Layout: a 64-byte header of little-endian ``uint64`` (``magic``, ``slots``, ``seq``,
``count``, ``tombstones``), then ``slots`` ``uint64`` entries (0 empty, 1 a deleted entry,
else a fingerprint). ``seq`` is a sequence lock: the daemon makes it odd before it changes
the table and even again after, so a reader that saw an odd ``seq``, or a ``seq`` that
changed while it probed, retries; after :data:`READ_TRIES` tries it reports nothing present.

**It is a hint.** A false positive (a fingerprint collision, a block evicted just after the
read, an answer from a dead daemon's file) is caught by the lease step, which then lends no
slot: a miss, and the engine recomputes. A false negative (a table too full to take a key,
a reader that gave up retrying, an event not applied yet) costs only that recompute. So
nothing here decides what bytes an engine reads; leases do.

Memory order: the reader's loads (``seq``, the entries, ``seq`` again) run in program order
through CPython's C code; on x86-64 (TSO) loads are not reordered with loads, and the
daemon's stores not with stores, which is what a sequence lock needs. On weaker CPUs a
torn read can go unnoticed, which the two rules above make a miss or a wasted lease, never
a wrong read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["READ_TRIES", "IndexReader", "PresenceIndex", "fingerprint", "open_announced"]

log = logging.getLogger("kvtier.shm")
_MAGIC = 0x58_49_72_65_69_74_76_6B  # b"kvtierIX" little-endian
_HEADER = 8  # uint64 words: magic, slots, seq, count, tombstones, 3 spare
_MAGIC_WORD, _SLOTS, _SEQ, _COUNT, _TOMBS = 0, 1, 2, 3, 4
_EMPTY, _GONE = 0, 1
#: Times a reader retries a read that raced the daemon before it reports nothing present.
READ_TRIES = 64
#: Most of the table a writer fills (entries plus deleted ones) before it rebuilds or refuses.
_LOAD = 0.75


def fingerprint(key: bytes) -> int:
    """The table's 64-bit fingerprint of ``key`` (never 0 or 1, the reserved entries)."""
    fp = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return fp if fp > _GONE else fp + 2


class PresenceIndex:
    """The daemon's side: create ``path`` with room for ``slots`` entries and write it.

    Parameters
    ----------
    path
        The index file (created, must not exist).
    slots
        Entries, a power of two >= 64; the table takes a key while it is at most 3/4 full.

    Raises
    ------
    ConfigError
        For a bad ``slots``.

    Concurrency: one writer thread (the daemon's loop); any number of reader processes.
    """

    def __init__(self, path: Path, slots: int) -> None:
        if slots < 64 or slots & (slots - 1):
            raise ConfigError(f"--shm-index-slots: expected a power of two >= 64, got {slots}")
        self.path = path
        self.slots = slots
        self.nbytes = (_HEADER + slots) * 8
        #: Keys the table refused because it was full (each is a false negative).
        self.refused = 0
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")
        self._words[_SLOTS] = slots
        self._words[_MAGIC_WORD] = _MAGIC

    @property
    def count(self) -> int:
        """Fingerprints in the table."""
        return int(self._words[_COUNT])

    def apply(self, inserts: Iterable[bytes], removes: Iterable[bytes]) -> None:
        """Insert and remove keys as one change readers see whole or retry."""
        words = self._words
        words[_SEQ] += 1  # odd: readers retry
        try:
            for key in removes:
                self._remove(fingerprint(key))
            for key in inserts:
                self._insert(fingerprint(key))
        finally:
            words[_SEQ] += 1

    def clear(self) -> None:
        """Empty the table (every reader then sees nothing present)."""
        words = self._words
        words[_SEQ] += 1
        try:
            self._map[_HEADER * 8:] = bytes(self.slots * 8)
            words[_COUNT] = words[_TOMBS] = 0
        finally:
            words[_SEQ] += 1

    def _insert(self, fp: int) -> None:
        words, mask = self._words, self.slots - 1
        if words[_COUNT] + words[_TOMBS] + 1 > self.slots * _LOAD and (
                not words[_TOMBS] or not self._rebuild()):
            self.refused += 1
            return
        pos, free = fp & mask, -1
        while True:
            entry = words[_HEADER + pos]
            if entry == fp:
                return
            if entry == _GONE and free < 0:
                free = pos
            elif entry == _EMPTY:
                break
            pos = (pos + 1) & mask
        if free >= 0:
            words[_TOMBS] -= 1
            pos = free
        words[_HEADER + pos] = fp
        words[_COUNT] += 1

    def _remove(self, fp: int) -> None:
        words, mask = self._words, self.slots - 1
        pos = fp & mask
        for _ in range(self.slots):
            entry = words[_HEADER + pos]
            if entry == fp:
                words[_HEADER + pos] = _GONE
                words[_COUNT] -= 1
                words[_TOMBS] += 1
                return
            if entry == _EMPTY:
                return
            pos = (pos + 1) & mask

    def _rebuild(self) -> bool:
        """Rehash the live entries without deleted ones (inside a write section);
        whether there is room for one more."""
        words = self._words
        live = [fp for fp in words[_HEADER:] if fp > _GONE]
        self._map[_HEADER * 8:] = bytes(self.slots * 8)
        words[_COUNT] = words[_TOMBS] = 0
        for fp in live:
            self._insert(fp)
        return words[_COUNT] + 1 <= self.slots * _LOAD

    def close(self) -> None:
        """Unlink the file; readers' mappings stay valid (and see the file is gone)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._words.release()
        with contextlib.suppress(BufferError):
            self._map.close()



class IndexReader:
    """An engine's read-only mapping of a daemon's index file.

    Parameters
    ----------
    path
        The file the daemon announced.
    slots
        Its entries, as announced (checked against the header).

    Raises
    ------
    OSError
        If the file is gone, not ours to open, shorter than announced, or not an index.

    Concurrency: any thread may read.
    """

    def __init__(self, path: str, slots: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            nbytes = (_HEADER + slots) * 8
            if os.fstat(self._fd).st_size < nbytes:
                raise OSError(f"{path}: shorter than an index of {slots} slots")
            self._map = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ)
        except BaseException:
            os.close(self._fd)
            raise
        self._words = memoryview(self._map).cast("Q")
        if self._words[_MAGIC_WORD] != _MAGIC or self._words[_SLOTS] != slots:
            self._words.release()
            self._map.close()
            os.close(self._fd)
            raise OSError(f"{path}: not a kvtier index of {slots} slots")
        self._mask = slots - 1
        # The descriptor stays open for stale() (fstat: is the file still linked?) and is
        # closed with the reader or when it is collected (a remap drops the old one).
        self._closer = weakref.finalize(self, os.close, self._fd)
        #: Reads that gave up after :data:`READ_TRIES` races with the daemon.
        self.gave_up = 0

    def stale(self) -> bool:
        """Whether the daemon unlinked the file (it stopped, or a new one started)."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def present_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` the daemon's tiers hold, as of one consistent read (all ``False``
        when every try raced the daemon's writes)."""
        blake, little = hashlib.blake2b, int.from_bytes
        fps = [little(blake(k, digest_size=8).digest(), "little") for k in keys]
        fps = [fp if fp > _GONE else fp + 2 for fp in fps]  # as fingerprint(), inlined
        words, mask = self._words, self._mask
        for _ in range(READ_TRIES):
            seq = words[_SEQ]
            if seq & 1:
                os.sched_yield()
                continue
            found = []
            for fp in fps:  # linear probing, inlined: this is the scheduler's whole lookup
                pos, steps = fp & mask, mask
                entry = words[_HEADER + pos]
                while entry != fp and entry != _EMPTY and steps:  # the daemon keeps 1/4 empty
                    pos, steps = (pos + 1) & mask, steps - 1
                    entry = words[_HEADER + pos]
                found.append(entry == fp)
            if words[_SEQ] == seq:
                return found
        self.gave_up += 1
        return [False] * len(keys)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present (one consistent read)."""
        hit = 0
        for present in self.present_many(keys):
            if not present:
                break
            hit += 1
        return hit

    def close(self) -> None:
        """Drop the mapping and the file descriptor."""
        self._words.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            self._closer()


def open_announced(info: dict[str, Any]) -> IndexReader | None:
    """The index a daemon's ``/v1/info`` announced, mapped; ``None`` if it announced none
    or it cannot be mapped (lookups then go to the socket)."""
    path, slots = info.get("index"), info.get("index_slots")
    if not isinstance(path, str) or not isinstance(slots, int):
        return None
    try:
        return IndexReader(path, slots)
    except OSError as exc:
        log.warning("cannot map the daemon's index %s: %s; asking the socket", path, exc)
        return None
