"""The block frame: how a block travels once it leaves process memory.

Layout (all integers little-endian)::

    offset          size        field
    0               4           magic b"KVTB"
    4               1           version (1, or 2 for a frame bound to its key)
    5               1           flags: bit 0 = zstd, bit 1 = byte-shuffle; others 0
    6               1           ndim (0..32)
    7               1           dtype descriptor length D (1..64)
    8               8           raw_size: payload bytes before compression
    16              8           stored_size: payload bytes as stored
    24              8*ndim      shape, one u64 per dimension
    24+8*ndim       D           dtype descriptor, ASCII: numpy ``dtype.str`` (``<u2``)
                                or a registered name (``bfloat16`` from ml_dtypes)
    24+8*ndim+D     8           checksum: xxh3_64 of every header byte before it
                                followed by the stored payload; version 2 first
                                hashes u8 key_len and the key
    header_len      stored_size payload

One checksum covers header and payload, so any flipped bit anywhere is detected. A version-2
frame also binds the block's key: the key is not stored in the frame, but it is hashed in
front of the header, so the frame verifies only against the key it was written for (a peer
answering with another key's valid frame is caught). Version-1 frames stay readable.
Byte-shuffle (bytes of each element grouped by significance) is only applied together
with zstd, and zstd is only kept when it saves at least 3% (otherwise the frame is raw
and decodes zero-copy).
"""

from __future__ import annotations

import re
import struct
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from kvtier.errors import ConfigError, CorruptBlockError

__all__ = [
    "FLAG_SHUFFLE",
    "FLAG_ZSTD",
    "FORMAT_VERSION",
    "KEYED_FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MIN_HEADER_BYTES",
    "EncodedFrame",
    "FrameHeader",
    "as_block",
    "decode_frame",
    "dtype_descriptor",
    "encode_frame",
    "frame_size_bound",
    "parse_compress",
    "parse_header",
]

MAGIC = b"KVTB"
FORMAT_VERSION = 1
KEYED_FORMAT_VERSION = 2
_VERSIONS = (FORMAT_VERSION, KEYED_FORMAT_VERSION)
_MAX_KEY_LEN = 255
FLAG_ZSTD = 0x01
FLAG_SHUFFLE = 0x02
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_SHUFFLE
_MAX_NDIM = 32
_MAX_DTYPE_LEN = 64
_FIXED = struct.Struct("<4sBBBBQQ")
MIN_HEADER_BYTES = _FIXED.size + 1 + 8
MAX_HEADER_BYTES = _FIXED.size + 8 * _MAX_NDIM + _MAX_DTYPE_LEN + 8
_COMPRESS_KEEP_RATIO = 0.97
# numpy refuses arrays whose byte extent (zero dimensions counted as 1) exceeds intp.
_MAX_EXTENT = 2**63 - 1
# A zstd block yields at most 128 KiB and costs at least 4 bytes (3-byte header + 1 RLE
# byte), so no genuine payload inflates more than 32768x; a frame declaring more is forged
# and would only make the decoder allocate raw_size bytes for nothing.
_MAX_ZSTD_RATIO = 32768
_DTYPE_STR_RE = re.compile(r"^[<>|][?biufcmMSU]\d{1,6}(\[\w{1,8}\])?$")
_DTYPE_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{1,31}$")
_local = threading.local()


def as_block(value: object, name: str = "value") -> npt.NDArray[np.generic]:
    """Validate a block value and return it as a numpy array (no copy).

    Accepts C-contiguous arrays of any fixed-size dtype, and bytes-like objects (as uint8).

    Raises
    ------
    TypeError
        For other types, object dtypes and structured dtypes.
    ValueError
        For non-C-contiguous arrays.
    """
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, bytes | bytearray | memoryview):
        view = memoryview(value)
        if not view.c_contiguous:
            raise ValueError(f"{name}: buffer must be C-contiguous")
        arr = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                            dtype=np.uint8)
    else:
        raise TypeError(f"{name}: expected numpy.ndarray or bytes-like, got {type(value).__name__}")
    dtype_descriptor(arr.dtype, name)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (use numpy.ascontiguousarray)")
    return arr


def dtype_descriptor(dtype: np.dtype[np.generic], name: str = "value") -> str:
    """Return the frame's dtype descriptor, refusing dtypes a frame cannot carry."""
    if dtype.hasobject:
        raise TypeError(f"{name}: object dtypes cannot be stored, got {dtype}")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"{name}: structured/subarray dtypes are not supported, got {dtype}")
    if dtype.itemsize == 0:
        raise TypeError(f"{name}: dtype {dtype} has no fixed size")
    if dtype.kind == "V" or dtype.isbuiltin == 2:
        # Extension types (ml_dtypes.bfloat16, float8_*) are kind 'V' or user-defined (e.g.
        # float8_e5m2 is '<f1', which numpy cannot parse back): they travel by name.
        if not _DTYPE_NAME_RE.match(dtype.name) or dtype.name.startswith("void"):
            raise TypeError(f"{name}: raw void dtype {dtype} is not supported")
        return dtype.name
    return dtype.str


def _resolve_dtype(descriptor: str) -> np.dtype[np.generic]:
    try:
        if _DTYPE_STR_RE.match(descriptor):
            dtype = np.dtype(descriptor)
        elif _DTYPE_NAME_RE.match(descriptor):
            try:
                dtype = np.dtype(descriptor)
            except TypeError:
                import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)

                dtype = np.dtype(descriptor)
        else:
            raise CorruptBlockError(f"frame: bad dtype descriptor {descriptor!r}")
        dtype_descriptor(dtype, "frame")
    except (TypeError, ImportError) as exc:
        raise CorruptBlockError(f"frame: unusable dtype {descriptor!r}: {exc}") from None
    return dtype


@dataclass(frozen=True)
class FrameHeader:
    """A parsed frame header (see the module docstring for the layout)."""

    flags: int
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]
    raw_size: int
    stored_size: int
    header_len: int
    checksum: int
    version: int = FORMAT_VERSION

    @property
    def frame_len(self) -> int:
        """Total frame length in bytes (header plus stored payload)."""
        return self.header_len + self.stored_size


@dataclass(frozen=True)
class EncodedFrame:
    """An encoded frame as two buffers, so the payload need not be copied next to the header."""

    header: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        """Total frame length in bytes."""
        return len(self.header) + self.payload.nbytes

    @property
    def buffers(self) -> tuple[bytes, memoryview]:
        """The frame as ``(header, payload)``, ready for a vectored write."""
        return self.header, self.payload

    def to_bytes(self) -> bytes:
        """Return the frame as one contiguous ``bytes`` (one copy of the payload)."""
        return b"".join((self.header, self.payload))


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd (de)compressor objects are not thread-safe; tiers encode from worker threads.
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


# Larger payloads are decompressed into a preallocated array in pieces of this size: a
# one-shot decompress holds the GIL for long stretches (~24 ms measured for 64 MiB), which
# stalls every other thread, the event loop's included, while a worker thread decodes.
_DECOMPRESS_PIECE = 1 << 20


def _decompress(payload: memoryview, raw_size: int) -> bytes | npt.NDArray[np.uint8]:
    if raw_size <= _DECOMPRESS_PIECE:
        return _decompressor().decompress(payload, max_output_size=raw_size)
    out = np.empty(raw_size, dtype=np.uint8)
    view = out.data
    have = 0
    with _decompressor().stream_reader(payload, read_across_frames=False) as reader:
        while have < raw_size:
            got = reader.readinto(view[have : have + _DECOMPRESS_PIECE])
            if not got:
                break
            have += got
    return out[:have]


def _shuffle(raw: memoryview, itemsize: int) -> bytes:
    data = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize)
    return data.T.tobytes()


def _unshuffle(data: bytes | npt.NDArray[np.uint8], itemsize: int) -> npt.NDArray[np.uint8]:
    planes = np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1)
    # One long strided copy per byte plane: ~8x faster than copying the transposed view,
    # whose inner loop is only ``itemsize`` bytes long (measured, benchmarks/bench_codec.py).
    out = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
    for i in range(itemsize):
        out[:, i] = planes[i]
    return out.reshape(-1)


def _checksum(key: bytes | None, prefix: bytes | memoryview,
              payload: bytes | memoryview) -> int:
    digest = xxhash.xxh3_64()
    if key is not None:
        digest.update(bytes((len(key),)))
        digest.update(key)
    digest.update(prefix)
    digest.update(payload)
    return digest.intdigest()


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"key: expected bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= _MAX_KEY_LEN:
        raise ValueError(f"key: expected 1..{_MAX_KEY_LEN} bytes, got {len(key)}")
    return key


def encode_frame(
    block: npt.NDArray[np.generic],
    *,
    compress_level: int | None = None,
    shuffle: bool = False,
    key: bytes | None = None,
) -> EncodedFrame:
    """Encode a block into a checksummed frame.

    Parameters
    ----------
    block
        A C-contiguous array (see :func:`as_block`).
    compress_level
        zstd level (1..22), or ``None`` for no compression.
    shuffle
        Byte-shuffle elements before compressing (pays for fp16/bf16 KV); ignored without
        compression or for 1-byte dtypes.
    key
        Bind the frame to this key (a version-2 frame, which only :func:`decode_frame` given
        the same key accepts); ``None`` writes a version-1 frame.

    Returns
    -------
    EncodedFrame
        Header and payload buffers; for an uncompressed frame the payload is a view of
        ``block`` (no copy), so keep ``block`` alive and unchanged until the frame is sent.
    """
    arr = as_block(block, "block")
    if key is not None:
        _check_key(key)
    descriptor = dtype_descriptor(arr.dtype, "block").encode("ascii")
    if arr.ndim > _MAX_NDIM:
        raise ValueError(f"block: at most {_MAX_NDIM} dimensions, got {arr.ndim}")
    raw = arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")
    flags = 0
    payload: memoryview = raw
    if compress_level is not None and raw.nbytes:
        if not 1 <= compress_level <= 22:
            raise ValueError(f"compress_level: expected 1..22, got {compress_level}")
        use_shuffle = shuffle and arr.dtype.itemsize > 1
        source: bytes | memoryview = _shuffle(raw, arr.dtype.itemsize) if use_shuffle else raw
        packed = _compressor(compress_level).compress(source)
        if len(packed) < raw.nbytes * _COMPRESS_KEEP_RATIO:
            payload = memoryview(packed)
            flags = FLAG_ZSTD | (FLAG_SHUFFLE if use_shuffle else 0)
    prefix = b"".join((
        _FIXED.pack(MAGIC, FORMAT_VERSION if key is None else KEYED_FORMAT_VERSION, flags,
                    arr.ndim, len(descriptor), raw.nbytes, payload.nbytes),
        struct.pack(f"<{arr.ndim}Q", *arr.shape),
        descriptor,
    ))
    checksum = _checksum(key, prefix, payload)
    return EncodedFrame(header=prefix + checksum.to_bytes(8, "little"), payload=payload)


def parse_header(buf: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and sanity-check a frame header (the checksum is verified by :func:`decode_frame`).

    ``buf`` may hold only the first bytes of a frame; at least ``MAX_HEADER_BYTES`` (or the
    whole frame if shorter) are needed to be sure the header is complete.

    Raises
    ------
    CorruptBlockError
        If the magic, version, flags, sizes, shape or dtype are invalid or truncated.
    """
    view = memoryview(buf)
    if view.nbytes < MIN_HEADER_BYTES:
        raise CorruptBlockError(f"frame: truncated header ({view.nbytes} bytes)")
    magic, version, flags, ndim, dlen, raw_size, stored_size = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptBlockError(f"frame: bad magic {bytes(magic)!r}")
    if version not in _VERSIONS:
        raise CorruptBlockError(f"frame: unsupported version {version}")
    if flags & ~_KNOWN_FLAGS or (flags & FLAG_SHUFFLE and not flags & FLAG_ZSTD):
        raise CorruptBlockError(f"frame: bad flags 0x{flags:02x}")
    if ndim > _MAX_NDIM or not 0 < dlen <= _MAX_DTYPE_LEN:
        raise CorruptBlockError(f"frame: bad ndim {ndim} or dtype length {dlen}")
    header_len = _FIXED.size + 8 * ndim + dlen + 8
    if view.nbytes < header_len:
        raise CorruptBlockError(f"frame: truncated header ({view.nbytes} < {header_len} bytes)")
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    off = _FIXED.size + 8 * ndim
    try:
        descriptor = bytes(view[off : off + dlen]).decode("ascii")
    except UnicodeDecodeError:
        raise CorruptBlockError("frame: dtype descriptor is not ASCII") from None
    dtype = _resolve_dtype(descriptor)
    count, extent = 1, dtype.itemsize
    for dim in shape:
        count *= dim
        extent *= max(dim, 1)
    if extent > _MAX_EXTENT:
        raise CorruptBlockError(f"frame: shape {shape} x {dtype} is too large for numpy")
    if count * dtype.itemsize != raw_size:
        raise CorruptBlockError(f"frame: shape {shape} x {dtype} != raw_size {raw_size}")
    if not flags & FLAG_ZSTD and stored_size != raw_size:
        raise CorruptBlockError("frame: uncompressed frame with stored_size != raw_size")
    if flags & FLAG_ZSTD and not 0 < raw_size <= stored_size * _MAX_ZSTD_RATIO:
        raise CorruptBlockError(f"frame: zstd raw_size {raw_size} impossible for "
                                f"stored_size {stored_size}")
    (checksum,) = struct.unpack_from("<Q", view, header_len - 8)
    return FrameHeader(flags, dtype, tuple(shape), raw_size, stored_size, header_len, checksum,
                       version)


def decode_frame(buf: bytes | bytearray | memoryview, *,
                 key: bytes | None = None) -> npt.NDArray[np.generic]:
    """Verify and decode one whole frame.

    Parameters
    ----------
    buf
        The frame, exactly.
    key
        The key the frame was read under. A version-2 frame verifies only with the key it was
        written for; a version-1 frame carries no key binding and ignores it (callers that
        must know the block is the one they asked for check ``parse_header(buf).version``).

    Returns
    -------
    numpy.ndarray
        For an uncompressed frame, a view over ``buf`` (read-only when ``buf`` is ``bytes``);
        for a compressed one, a new array.

    Raises
    ------
    CorruptBlockError
        On any header error, length mismatch or checksum failure, and for a version-2 frame
        read without its key or under another key.
    """
    if key is not None:
        _check_key(key)
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    head = parse_header(view)
    if view.nbytes != head.frame_len:
        raise CorruptBlockError(f"frame: length {view.nbytes} != declared {head.frame_len}")
    payload = view[head.header_len :]
    if head.version == KEYED_FORMAT_VERSION and key is None:
        raise CorruptBlockError("frame: bound to a key (version 2): read it with key=")
    bound = key if head.version == KEYED_FORMAT_VERSION else None
    if _checksum(bound, view[: head.header_len - 8], payload) != head.checksum:
        raise CorruptBlockError("frame: checksum mismatch (or written for another key)"
                                if bound is not None else "frame: checksum mismatch")
    if not head.flags & FLAG_ZSTD:
        return np.frombuffer(view, dtype=head.dtype, count=head.raw_size // head.dtype.itemsize,
                             offset=head.header_len).reshape(head.shape)
    try:
        # python-zstandard allocates the content size the zstd frame declares; that must be
        # the raw_size bounded above (our encoder always writes it).
        if zstandard.frame_content_size(payload) != head.raw_size:
            raise CorruptBlockError("frame: zstd content size != raw_size")
        raw = _decompress(payload, head.raw_size)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"frame: zstd: {exc}") from None
    if len(raw) != head.raw_size:
        raise CorruptBlockError("frame: decompressed size mismatch")
    data = _unshuffle(raw, head.dtype.itemsize) if head.flags & FLAG_SHUFFLE else raw
    return np.frombuffer(data, dtype=head.dtype).reshape(head.shape)


def frame_size_bound(block: npt.NDArray[np.generic]) -> int:
    """Bytes of the frame :func:`encode_frame` makes of ``block``: exact when uncompressed,
    an upper bound when compressed (zstd output is kept only when smaller than the raw
    payload). Tiers budget a block by it before encoding."""
    descriptor = dtype_descriptor(block.dtype, "block")
    return _FIXED.size + 8 * block.ndim + len(descriptor) + 8 + block.nbytes


_DEFAULT_ZSTD_LEVEL = 1


def parse_compress(value: object, name: str = "compress") -> int | None:
    """Parse a ``compress=`` option (every tier that stores frames uses this one parser):
    ``zstd:LEVEL`` (1..22), ``zstd`` (level 1), or ``none``/``0``/``off``/``false``/empty
    for no compression. Returns the zstd level or ``None``.

    Raises
    ------
    ConfigError
        Naming the option, for anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(f"{name}: expected 'zstd:LEVEL' or 'none', got {value!r}")
    text = str(value).strip().lower()
    if text in ("", "0", "none", "false", "off"):
        return None
    codec, _, level_text = text.partition(":")
    if codec != "zstd":
        raise ConfigError(f"{name}: unknown codec {codec!r} (supported: zstd:LEVEL, none)")
    if not level_text:
        return _DEFAULT_ZSTD_LEVEL
    if not level_text.isdigit() or not 1 <= int(level_text) <= 22:
        raise ConfigError(f"{name}: zstd level must be 1..22, got {level_text!r}")
    return int(level_text)
