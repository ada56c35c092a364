"""Synchronous LMDB side of :class:`kvtier.tiers.lmdb.LMDBTier`.

Every method runs one whole transaction, start to commit, and is meant to be called inside
one ``asyncio.to_thread`` call. Values never outlive their read transaction: reads copy
out of the memory map (or decompress out of it) before the transaction ends.

A block's frame (see :mod:`kvtier.codec`) is stored split in two named databases, so a put
hands the caller's buffer straight to ``txn.put`` without first joining header and payload:

``header``   key -> frame header (magic .. checksum, ~50 bytes)
``payload``  key -> stored payload
``recency``  key -> ``<Qd``: frame bytes, last access (wall-clock seconds)

The checksum in the header covers header and payload, so a torn or mismatched pair fails
verification exactly like a corrupt single-buffer frame. ``recency`` is all a warm restart
reads: sizes and last-access times, never the values.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import xxhash

from kvtier.codec import FLAG_ZSTD, FrameHeader, decode_frame, parse_header
from kvtier.errors import CorruptBlockError
from kvtier.tiers.base import Block, check_output_buffer, copy_into
from kvtier.tiers.dram_arena import HostArena
from kvtier.tiers.residency import is_resident

__all__ = ["BlockEnv", "Durability", "NotResident", "PendingPut"]

_RECENCY = struct.Struct("<Qd")
#: Memory for blocks that reads return, reused once the caller drops them (a fresh buffer
#: per read is new pages, faulted in by the copy); reads that find no slot use the heap.
READ_BUFFER_BYTES = 64 << 20


class NotResident(Exception):
    """A ``resident_only`` read found a value that is compressed or not in the page cache
    (read it in a worker thread instead)."""


def _check_resident(header: memoryview, payload: memoryview) -> None:
    if parse_header(header).flags & FLAG_ZSTD or not is_resident(header, payload):
        raise NotResident


_TICK_KEY = b"tick"

Durability = str  # "0" | "meta" | "1"
_DURABILITY = {"0": (False, False), "meta": (True, False), "1": (True, True)}


@dataclass(frozen=True)
class PendingPut:
    """One encoded block waiting for its write transaction."""

    key: bytes
    header: bytes
    payload: memoryview
    last_access: float

    @property
    def nbytes(self) -> int:
        """Frame bytes (what the tier's budget accounts)."""
        return len(self.header) + self.payload.nbytes


def verify_split(header: memoryview | bytes, payload: memoryview | bytes) -> FrameHeader:
    """Check a frame stored as separate header and payload buffers.

    Uncompressed frames are fully verified here, in place (in the map: it cannot change under
    a read transaction, and the checksum pass leaves the bytes in cache for the copy that
    follows). Compressed frames are verified by :func:`decode_frame` when decoded.

    Raises
    ------
    CorruptBlockError
        On any header error, size mismatch or checksum failure.
    """
    head = parse_header(header)
    if head.header_len != len(header) or head.stored_size != len(payload):
        raise CorruptBlockError("frame: header and payload lengths disagree")
    if not head.flags & FLAG_ZSTD:
        digest = xxhash.xxh3_64(memoryview(header)[:-8])
        digest.update(payload)
        if digest.intdigest() != head.checksum:
            raise CorruptBlockError("frame: checksum mismatch")
    return head


def _decode_compressed(header: memoryview | bytes, payload: memoryview | bytes) -> Block:
    # Compressed payloads are small next to the block; one join keeps decoding in codec.
    return decode_frame(b"".join((header, payload)))


def decode_split_into(header: memoryview | bytes, payload: memoryview | bytes,
                      out: Block) -> None:
    """Verify a split frame and copy its block into caller-owned ``out``.

    Raises
    ------
    CorruptBlockError
        If verification fails (``out`` is then untouched).
    ShapeMismatchError
        If ``out`` does not fit the block (``out`` is then untouched).
    """
    head = parse_header(header)
    if head.flags & FLAG_ZSTD:
        copy_into(_decode_compressed(header, payload), out)
        return
    if head.header_len != len(header) or head.stored_size != len(payload):
        raise CorruptBlockError("frame: header and payload lengths disagree")
    view = np.frombuffer(payload, dtype=head.dtype).reshape(head.shape)
    target = check_output_buffer(view, out)  # refuse a bad ``out`` before the checksum pass
    verify_split(header, payload)
    if target.shape == view.shape and target.dtype == view.dtype:
        np.copyto(target, view, casting="no")
    else:
        np.copyto(target, np.frombuffer(payload, dtype=np.uint8), casting="no")


class BlockEnv:
    """An open LMDB environment holding blocks (one per directory, one process).

    Parameters
    ----------
    path
        Directory of ``data.mdb``/``lock.mdb``.
    map_size
        Hard upper bound of ``data.mdb`` in bytes.
    durability
        ``"0"``: no fsync at commit (``sync=False, metasync=False``); ``"meta"``: fsync data,
        not the meta page (the last transaction may roll back after an OS crash); ``"1"``:
        full fsync per commit.
    writemap
        Write through the shared memory map instead of ``pwrite`` (faster puts).
    read_only
        Open an existing environment for reading only (``kvtier explain``): nothing is
        created or written; ``lmdb.Error`` if there is none. With ``lock=False`` LMDB's lock
        file is not touched either (only safe while no process writes the environment).
    """

    def __init__(self, path: Path, *, map_size: int, durability: Durability = "0",
                 writemap: bool = False, max_readers: int = 126, read_only: bool = False,
                 lock: bool = True) -> None:
        sync, metasync = _DURABILITY[durability]
        self.path = path
        self.read_only = read_only
        self.env = lmdb.open(
            str(path), map_size=map_size, subdir=True, max_dbs=4, sync=sync,
            metasync=metasync, writemap=writemap, readahead=False, meminit=False,
            max_readers=max_readers, lock=lock, readonly=read_only, create=not read_only)
        self._buffers = HostArena(READ_BUFFER_BYTES, hugepages=True)
        if not read_only:
            # Free reader slots of processes that died holding them (after a crash/SIGKILL).
            self.env.reader_check()
        names = (b"header", b"payload", b"recency", b"meta")
        if read_only:  # each handle opened in its own read transaction, committed
            self.header, self.payload, self.recency, self.meta = (
                self.env.open_db(name, create=False) for name in names)
        else:
            with self.env.begin(write=True) as txn:
                self.header, self.payload, self.recency, self.meta = (
                    self.env.open_db(name, txn=txn) for name in names)

    def load_index(self) -> list[tuple[bytes, int, float]]:
        """``(key, frame bytes, last access)`` of every block, oldest access first."""
        entries: list[tuple[bytes, int, float]] = []
        with self.env.begin(db=self.recency) as txn:
            for key, value in txn.cursor():
                if len(value) != _RECENCY.size:
                    continue
                size, last = _RECENCY.unpack(value)
                entries.append((bytes(key), size, last))
        entries.sort(key=lambda e: e[2])
        return entries

    def read(self, keys: Sequence[bytes], *,
             resident_only: bool = False) -> list[Block | CorruptBlockError | None]:
        """Read and verify ``keys`` in one read transaction; a corrupt frame is returned as
        its :class:`CorruptBlockError` (the caller counts and deletes it).

        ``resident_only``: raise :class:`NotResident` (before copying anything) unless every
        value is uncompressed and in the page cache, so the read costs no disk wait and no
        decompression (what the event loop may run itself).

        Uncompressed blocks are copied into a slot each of a read arena
        (:data:`READ_BUFFER_BYTES`, reused once the caller drops the block), or heap memory
        when it has none free; callers that own a buffer use ``get_into`` (:meth:`read_into`).
        """
        out: list[Block | CorruptBlockError | None] = [None] * len(keys)
        with self.env.begin(buffers=True) as txn:
            plain: list[tuple[int, FrameHeader, memoryview, memoryview]] = []
            for i, key in enumerate(keys):
                header = txn.get(key, db=self.header)
                payload = txn.get(key, db=self.payload)
                if header is None and payload is None:
                    continue
                if header is None or payload is None:
                    out[i] = CorruptBlockError("frame: header or payload missing")
                    continue
                try:
                    if resident_only:
                        _check_resident(header, payload)
                    head = parse_header(header)
                    if head.header_len != len(header) or head.stored_size != len(payload):
                        raise CorruptBlockError("frame: header and payload lengths disagree")
                    if head.flags & FLAG_ZSTD:
                        out[i] = _decode_compressed(header, payload)  # verifies
                        continue
                except CorruptBlockError as exc:
                    out[i] = exc
                    continue
                plain.append((i, head, header, payload))
            for i, head, header, payload in plain:
                # A slot of the read arena per block: a fresh multi-MiB buffer was new pages,
                # faulted in by the copy (bench_persist: get_many x16 of 1 MiB ran at 0.3x
                # py-lmdb, and at 0.6x a single get per byte).
                view = self._buffers.allocate(head.raw_size)
                if view is None:
                    view = np.empty(head.raw_size, dtype=np.uint8)
                # Copy, then checksum the copy while it is in the CPU cache: the map is
                # read once (verifying in place first read it twice; 1 MiB: -16 us).
                view[:] = np.frombuffer(payload, dtype=np.uint8)
                digest = xxhash.xxh3_64(memoryview(header)[:-8])
                digest.update(view.data)
                if digest.intdigest() != head.checksum:
                    out[i] = CorruptBlockError("frame: checksum mismatch")
                    continue
                out[i] = view.view(head.dtype).reshape(head.shape)
        return out

    @property
    def read_slots_reused(self) -> int:
        """Reads whose block went into a slot of the read arena that an earlier, dropped
        block had used."""
        return self._buffers.reused

    def read_into(self, key: bytes, out: Block, *,
                  resident_only: bool = False) -> bool | CorruptBlockError:
        """Verify ``key`` and copy it into ``out`` in one read transaction; ``False`` on a
        miss, the error for a corrupt frame. Raises ``ShapeMismatchError`` for a bad ``out``,
        :class:`NotResident` as :meth:`read` does."""
        with self.env.begin(buffers=True) as txn:
            header = txn.get(key, db=self.header)
            payload = txn.get(key, db=self.payload)
            if header is None and payload is None:
                return False
            if header is None or payload is None:
                return CorruptBlockError("frame: header or payload missing")
            try:
                if resident_only:
                    _check_resident(header, payload)
                decode_split_into(header, payload, out)
            except CorruptBlockError as exc:
                return exc
        return True

    def write(self, puts: Sequence[PendingPut], deletes: Sequence[bytes],
              touches: Sequence[tuple[bytes, int, float]]) -> list[bool]:
        """Delete, put and refresh recency in one write transaction.

        Returns whether each of ``deletes`` was present. Raises ``lmdb.MapFullError`` (and
        writes nothing) when the map has no room; the caller evicts and retries.
        """
        present: list[bool] = []
        with self.env.begin(write=True) as txn:
            for key in deletes:
                found = txn.delete(key, db=self.header)
                found = txn.delete(key, db=self.payload) or found
                present.append(txn.delete(key, db=self.recency) or found)
            for key, size, last in touches:
                # A touch never resurrects a block deleted since it was recorded.
                if txn.get(key, db=self.header) is not None:
                    txn.put(key, _RECENCY.pack(size, last), db=self.recency)
            for put in puts:
                txn.put(put.key, put.payload, db=self.payload)
                txn.put(put.key, put.header, db=self.header)
                txn.put(put.key, _RECENCY.pack(put.nbytes, put.last_access), db=self.recency)
        return present

    def tick(self) -> None:
        """Commit a tiny transaction so pages freed by earlier commits become reusable
        (LMDB reuses a page only once no live snapshot, including the previous meta page,
        can still reference it)."""
        with self.env.begin(write=True, db=self.meta) as txn:
            old = txn.get(_TICK_KEY)
            count = int.from_bytes(old, "little") + 1 if old is not None else 1
            txn.put(_TICK_KEY, count.to_bytes(8, "little"))

    def disk_bytes(self) -> int:
        """Bytes allocated on disk by the environment's files."""
        total = 0
        for name in ("data.mdb", "lock.mdb"):
            with contextlib.suppress(FileNotFoundError):
                total += (self.path / name).stat().st_blocks * 512
        return total

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has a stored frame (one read transaction, nothing copied)."""
        with self.env.begin(buffers=True) as txn:
            return [txn.get(key, db=self.header) is not None for key in keys]

    def close(self) -> None:
        """Flush (whatever the durability setting; a read-only one has nothing to flush)
        and close."""
        if not self.read_only:
            self.env.sync(True)
        self.env.close()
