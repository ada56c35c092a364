"""The peer wire format: paths, versions, limits and the binary batch bodies (see
docs/peer-protocol.md).

Single-block requests carry one codec frame as the whole body. Batch bodies are
length-prefixed, little-endian::

    key list (batch get / exists / delete request):
        u32 count, then count x (u16 key_len, key)
    block list (batch put request, batch get response):
        u32 count, then count x (u16 key_len, key, u64 frame_len, frame)
        frame_len 0 in a batch get response means "missing"
    flag list (batch exists / delete response):
        u32 count, then count x u8 (1 present / 0 absent)
    stamp list (batch stamps response):
        u32 count, then count x (u8 kind: 0 absent / 1 block / 2 tombstone, u64 stamp)

Encoders return lists of buffers so block payloads are never joined with their headers
(the caller writes them one after another); decoders return zero-copy memoryviews.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.codec import MAX_HEADER_BYTES, EncodedFrame
from kvtier.errors import ConfigError, LimitExceededError, ProtocolError
from kvtier.keys import MAX_KEY_BYTES

__all__ = [
    "API_PREFIX",
    "BATCH_DELETE_PATH",
    "BATCH_EXISTS_PATH",
    "BATCH_GET_PATH",
    "BATCH_PUT_PATH",
    "BATCH_STAMPS_PATH",
    "BLOCK_PATH",
    "CONTENT_TYPE",
    "FILL_QUERY",
    "HEALTH_PATH",
    "METRICS_PATH",
    "PREVIOUS_VERSION",
    "VERSION",
    "VERSION_HEADER",
    "LimitExceededError",
    "Limits",
    "ProtocolError",
    "block_path",
    "decode_blocks",
    "decode_flags",
    "decode_keys",
    "decode_stamps",
    "encode_blocks",
    "encode_flags",
    "encode_keys",
    "encode_stamps",
    "version_of",
]

API_PREFIX = "/v1"
BLOCK_PATH = f"{API_PREFIX}/blocks/{{key}}"
BATCH_GET_PATH = f"{API_PREFIX}/batch/get"
BATCH_PUT_PATH = f"{API_PREFIX}/batch/put"
BATCH_EXISTS_PATH = f"{API_PREFIX}/batch/exists"
BATCH_DELETE_PATH = f"{API_PREFIX}/batch/delete"
BATCH_STAMPS_PATH = f"{API_PREFIX}/batch/stamps"
HEALTH_PATH = f"{API_PREFIX}/health"
METRICS_PATH = "/metrics"
CONTENT_TYPE = "application/octet-stream"
#: Query of a block PUT or batch put that only fills holes: the server stores only the
#: blocks its segment does not hold, so a read repair or an anti-entropy push never
#: overwrites a newer value that reached the owner meanwhile.
FILL_QUERY = "fill=1"
# Protocol versions (docs/peer-protocol.md, "Versions"): a server of version 2 says so in
# VERSION_HEADER on every block answer, and answers only key-bound (version-2) frames. A
# server without it is of version 1, whose early releases answered frames not bound to
# their key: a client reads those from it, and only key-bound ones from a server of 2.
VERSION = 2
PREVIOUS_VERSION = 1
VERSION_HEADER = "Kvtier-Protocol"

_COUNT = struct.Struct("<I")
_KEY_LEN = struct.Struct("<H")
_FRAME_LEN = struct.Struct("<Q")
_STAMP = struct.Struct("<BQ")


@dataclass(frozen=True)
class Limits:
    """Request limits a peer server enforces and a client respects when it splits batches.

    Parameters
    ----------
    max_block_bytes
        Largest frame (header plus stored payload) accepted for one block.
    max_batch
        Most blocks or keys in one batch request.
    max_body_bytes
        Largest request body; a larger ``Content-Length`` is refused before reading (413).
    """

    max_block_bytes: int = 64 << 20
    max_batch: int = 1024
    max_body_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("max_block_bytes", "max_batch", "max_body_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {value!r}")
        if self.max_body_bytes < self.max_block_bytes:
            raise ConfigError(f"max_body_bytes ({self.max_body_bytes}) must be >= "
                              f"max_block_bytes ({self.max_block_bytes})")

    @property
    def max_frame_bytes(self) -> int:
        """Largest single-block frame: a block of ``max_block_bytes`` plus its header."""
        return self.max_block_bytes + MAX_HEADER_BYTES


def version_of(value: str | bytes | None) -> int:
    """The protocol version a peer announced in :data:`VERSION_HEADER`; a peer that sent
    none (or anything but a number) is of :data:`PREVIOUS_VERSION`."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if text is None or not text.strip().isdigit() or len(text.strip()) > 6:
        return PREVIOUS_VERSION
    return int(text)


def block_path(key: bytes) -> str:
    """The path of one block: ``/v1/blocks/{lowercase hex key}``."""
    return f"{API_PREFIX}/blocks/{key.hex()}"


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """Encode a key list (batch get / exists / delete request body)."""
    parts = [_COUNT.pack(len(keys))]
    for key in keys:
        parts.append(_KEY_LEN.pack(len(key)))
        parts.append(key)
    return b"".join(parts)


def encode_blocks(
    items: Sequence[tuple[bytes, EncodedFrame | None]],
) -> list[bytes | memoryview]:
    """Encode a block list as buffers to write in order (payloads are not copied).

    ``None`` as a frame encodes a missing block (frame_len 0).
    """
    out: list[bytes | memoryview] = []
    pending = [_COUNT.pack(len(items))]
    for key, frame in items:
        pending += (_KEY_LEN.pack(len(key)), key)
        if frame is None:
            pending.append(_FRAME_LEN.pack(0))
            continue
        # Small pieces (lengths, key, frame header) are joined; the payload stays a view.
        pending += (_FRAME_LEN.pack(frame.nbytes), frame.header)
        out.append(b"".join(pending))
        pending = []
        if frame.payload.nbytes:
            out.append(frame.payload)
    if pending:
        out.append(b"".join(pending))
    return out


def encode_flags(flags: Sequence[bool]) -> bytes:
    """Encode a flag list (batch exists / delete response body)."""
    return _COUNT.pack(len(flags)) + bytes(1 if f else 0 for f in flags)


def _count(view: memoryview, max_count: int) -> int:
    if view.nbytes < _COUNT.size:
        raise ProtocolError(f"body: truncated count ({view.nbytes} bytes)")
    (count,) = _COUNT.unpack_from(view, 0)
    if count > max_count:
        raise LimitExceededError(f"body: {count} entries exceed the limit of {max_count}")
    return int(count)


def _key(view: memoryview, off: int, index: int) -> tuple[bytes, int]:
    if off + _KEY_LEN.size > view.nbytes:
        raise ProtocolError(f"body: entry {index}: truncated key length")
    (klen,) = _KEY_LEN.unpack_from(view, off)
    off += _KEY_LEN.size
    if not 0 < klen <= MAX_KEY_BYTES:
        raise ProtocolError(f"body: entry {index}: key length {klen} not in 1..{MAX_KEY_BYTES}")
    if off + klen > view.nbytes:
        raise ProtocolError(f"body: entry {index}: truncated key")
    return bytes(view[off : off + klen]), off + klen


def decode_keys(body: bytes | bytearray | memoryview, max_count: int) -> list[bytes]:
    """Decode a key list; raises :class:`ProtocolError` on any malformation."""
    view = memoryview(body).cast("B")
    count = _count(view, max_count)
    off = _COUNT.size
    keys: list[bytes] = []
    for i in range(count):
        key, off = _key(view, off, i)
        keys.append(key)
    if off != view.nbytes:
        raise ProtocolError(f"body: {view.nbytes - off} trailing bytes after {count} keys")
    return keys


def decode_blocks(
    body: bytes | bytearray | memoryview, max_count: int, max_frame: int,
) -> list[tuple[bytes, memoryview | None]]:
    """Decode a block list into ``(key, frame view or None for missing)`` pairs.

    Frames are returned unverified (run :func:`kvtier.codec.decode_frame` on each).
    """
    view = memoryview(body).cast("B")
    count = _count(view, max_count)
    off = _COUNT.size
    out: list[tuple[bytes, memoryview | None]] = []
    for i in range(count):
        key, off = _key(view, off, i)
        if off + _FRAME_LEN.size > view.nbytes:
            raise ProtocolError(f"body: entry {i}: truncated frame length")
        (flen,) = _FRAME_LEN.unpack_from(view, off)
        off += _FRAME_LEN.size
        if flen > max_frame:
            raise LimitExceededError(f"body: entry {i}: frame of {flen} bytes exceeds "
                                     f"{max_frame}")
        if off + flen > view.nbytes:
            raise ProtocolError(f"body: entry {i}: truncated frame ({flen} bytes declared)")
        out.append((key, view[off : off + flen] if flen else None))
        off += flen
    if off != view.nbytes:
        raise ProtocolError(f"body: {view.nbytes - off} trailing bytes after {count} blocks")
    return out


def decode_flags(body: bytes | bytearray | memoryview, expected: int) -> list[bool]:
    """Decode a flag list that must hold exactly ``expected`` flags."""
    view = memoryview(body).cast("B")
    count = _count(view, expected)
    if count != expected or view.nbytes != _COUNT.size + count:
        raise ProtocolError(f"body: expected {expected} flags, got {count} "
                            f"in {view.nbytes} bytes")
    return [b != 0 for b in view[_COUNT.size :]]


def encode_stamps(states: Sequence[tuple[int, int]]) -> bytes:
    """Encode a stamp list (batch stamps response): ``(kind, stamp)`` per key."""
    return _COUNT.pack(len(states)) + b"".join(_STAMP.pack(k, s) for k, s in states)


def decode_stamps(body: bytes | bytearray | memoryview, expected: int
                  ) -> list[tuple[int, int]]:
    """Decode a stamp list that must hold exactly ``expected`` entries."""
    view = memoryview(body).cast("B")
    count = _count(view, expected)
    if count != expected or view.nbytes != _COUNT.size + count * _STAMP.size:
        raise ProtocolError(f"body: expected {expected} stamps, got {count} "
                            f"in {view.nbytes} bytes")
    out = [_STAMP.unpack_from(view, _COUNT.size + i * _STAMP.size) for i in range(count)]
    if any(kind > 2 for kind, _ in out):
        raise ProtocolError("body: a stamp entry of unknown kind")
    return [(int(k), int(s)) for k, s in out]
