"""Block frames: round trips, zero copy, and corruption that is always CorruptBlockError."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvtier.codec import (
    FLAG_SHUFFLE,
    FLAG_ZSTD,
    MAGIC,
    MAX_HEADER_BYTES,
    MIN_HEADER_BYTES,
    EncodedFrame,
    as_block,
    decode_frame,
    encode_frame,
    parse_header,
)
from kvtier.errors import CorruptBlockError

Array = np.ndarray[Any, Any]


def forge(*, flags: int = 0, shape: tuple[int, ...] = (4,), descriptor: bytes = b"|u1",
          raw_size: int | None = None, stored_size: int | None = None, payload: bytes = b"abcd",
          magic: bytes = MAGIC, version: int = 1, ndim: int | None = None,
          dlen: int | None = None) -> bytes:
    """A frame with arbitrary header fields and a *correct* checksum, as a hostile peer or a
    buggy writer could produce: only the parser's own checks can reject it."""
    raw_size = len(payload) if raw_size is None else raw_size
    stored_size = len(payload) if stored_size is None else stored_size
    head = (struct.pack("<4sBBBBQQ", magic, version, flags,
                        len(shape) if ndim is None else ndim,
                        len(descriptor) if dlen is None else dlen, raw_size, stored_size)
            + struct.pack(f"<{len(shape)}Q", *shape) + descriptor)
    checksum = xxhash.xxh3_64(head + payload).intdigest()
    return head + struct.pack("<Q", checksum) + payload


def kv_like(tokens: int = 64, heads: int = 4, dim: int = 32, seed: int = 0) -> Array:
    """Smooth-along-tokens fp16 data that zstd+shuffle compresses (see benchmarks)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(1, heads, dim)) * rng.uniform(0.1, 4, size=(1, heads, dim))
    drift = np.cumsum(rng.normal(scale=0.02, size=(tokens, heads, dim)), axis=0)
    return np.ascontiguousarray((base + drift).astype(np.float16))


def assert_same(got: Array, expected: Array) -> None:
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()  # bytewise, so NaNs compare too


def assert_decodes_or_corrupt(buf: bytes | bytearray, expected: Array | None = None) -> None:
    try:
        got = decode_frame(buf)
    except CorruptBlockError:
        return
    assert isinstance(got, np.ndarray)
    if expected is not None:
        assert_same(got, expected)


# --------------------------------------------------------------------------- round trips

_dtypes = st.one_of(
    hnp.integer_dtypes(endianness="?"), hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?"), hnp.complex_number_dtypes(endianness="?"),
    hnp.boolean_dtypes(), hnp.datetime64_dtypes(endianness="?"),
    hnp.timedelta64_dtypes(endianness="?"), hnp.byte_string_dtypes(min_len=1, max_len=4),
    hnp.unicode_string_dtypes(endianness="?", min_len=1, max_len=3),
)
_arrays = hnp.arrays(_dtypes, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))


@pytest.mark.slow
@given(_arrays, st.sampled_from([None, 1, 3, 19]), st.booleans(), st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip(arr: Array, level: int | None, shuffle: bool, as_bytearray: bool) -> None:
    arr = np.ascontiguousarray(arr)
    frame = encode_frame(arr, compress_level=level, shuffle=shuffle)
    buf: bytes | bytearray = frame.to_bytes()
    if as_bytearray:
        buf = bytearray(buf)
    assert_same(decode_frame(buf), arr)
    flags = frame.header[5]
    if level is None or arr.nbytes == 0:
        assert flags == 0
    if flags & FLAG_SHUFFLE:
        assert shuffle and arr.dtype.itemsize > 1 and flags & FLAG_ZSTD


@pytest.mark.parametrize("level", [None, 1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_round_trip_kv_like_and_compression(level: int | None, shuffle: bool) -> None:
    arr = kv_like()
    frame = encode_frame(arr, compress_level=level, shuffle=shuffle)
    assert_same(decode_frame(frame.to_bytes()), arr)
    if level is None:
        assert frame.header[5] == 0 and frame.payload.nbytes == arr.nbytes
    else:
        assert frame.header[5] == FLAG_ZSTD | (FLAG_SHUFFLE if shuffle else 0)
        assert frame.payload.nbytes < arr.nbytes * 0.97


def test_shuffle_pays_on_fp16_kv() -> None:
    arr = kv_like(tokens=256)
    plain = encode_frame(arr, compress_level=3).payload.nbytes
    shuffled = encode_frame(arr, compress_level=3, shuffle=True).payload.nbytes
    assert shuffled < plain


def test_bfloat16_round_trip() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arr = kv_like().astype(ml_dtypes.bfloat16)
    for level, shuffle in [(None, False), (1, False), (3, True)]:
        frame = encode_frame(arr, compress_level=level, shuffle=shuffle)
        assert frame.header.find(b"bfloat16") > 0
        got = decode_frame(frame.to_bytes())
        assert got.dtype == ml_dtypes.bfloat16
        assert_same(got, arr)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        arr8 = np.arange(16, dtype=np.float32).astype(getattr(ml_dtypes, name))
        assert_same(decode_frame(encode_frame(arr8).to_bytes()), arr8)


def test_bytes_like_blocks_are_uint8() -> None:
    for value in (b"hello", bytearray(b"hello"), memoryview(b"hello")):
        got = decode_frame(encode_frame(as_block(value)).to_bytes())
        assert got.dtype == np.uint8 and got.tobytes() == b"hello"


# --------------------------------------------------------------------------- zero copy

def test_decode_of_raw_frame_is_a_view_over_the_input() -> None:
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    buf = encode_frame(arr).to_bytes()
    got = decode_frame(buf)
    assert np.shares_memory(got, np.frombuffer(buf, dtype=np.uint8))
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0] = 1
    mutable = bytearray(buf)
    view = decode_frame(memoryview(mutable))
    assert np.shares_memory(view, np.frombuffer(mutable, dtype=np.uint8))
    assert_same(view, arr)


def test_encode_of_raw_frame_does_not_copy_the_payload() -> None:
    arr = np.arange(4096, dtype=np.uint16)
    frame = encode_frame(arr)
    assert np.shares_memory(np.frombuffer(frame.payload, dtype=np.uint8), arr)
    assert len(frame.header) == 24 + 8 + 3 + 8


def test_incompressible_data_stays_raw() -> None:
    arr = np.random.default_rng(3).integers(0, 2**16, 8192, dtype=np.uint16)
    for shuffle in (False, True):
        frame = encode_frame(arr, compress_level=3, shuffle=shuffle)
        assert frame.header[5] == 0
        assert np.shares_memory(np.frombuffer(frame.payload, dtype=np.uint8), arr)
        assert_same(decode_frame(frame.to_bytes()), arr)


@pytest.mark.parametrize("level", [None, 3])
def test_encoded_frame_views_agree(level: int | None) -> None:
    frame = encode_frame(kv_like(), compress_level=level, shuffle=True)
    assert isinstance(frame, EncodedFrame)
    whole = frame.to_bytes()
    header, payload = frame.buffers
    assert header is frame.header and payload is frame.payload
    assert frame.nbytes == len(whole) == len(header) + payload.nbytes
    assert whole == header + bytes(payload)
    assert parse_header(whole[:MAX_HEADER_BYTES]).frame_len == len(whole)
    assert parse_header(header).header_len == len(header)


# --------------------------------------------------------------------------- corruption

def _small_frames() -> dict[str, bytes]:
    return {
        "raw": encode_frame(np.arange(8, dtype=np.uint16).reshape(2, 4)).to_bytes(),
        "zstd+shuffle": encode_frame(np.full(64, 1.0, dtype=np.float16), compress_level=3,
                                     shuffle=True).to_bytes(),
    }


@pytest.mark.parametrize("kind", ["raw", "zstd+shuffle"])
def test_every_flipped_bit_is_detected(kind: str) -> None:
    frame = _small_frames()[kind]
    assert decode_frame(frame) is not None
    for i in range(len(frame) * 8):
        bad = bytearray(frame)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptBlockError):
            decode_frame(bytes(bad))


@pytest.mark.parametrize("kind", ["raw", "zstd+shuffle"])
def test_truncated_and_padded_frames(kind: str) -> None:
    frame = _small_frames()[kind]
    for n in range(len(frame)):
        with pytest.raises(CorruptBlockError):
            decode_frame(frame[:n])
    for extra in (b"\x00", b"x" * 100):
        with pytest.raises(CorruptBlockError, match="length"):
            decode_frame(frame + extra)


def test_forge_helper_builds_valid_frames() -> None:
    # The hostile cases below differ from this one in a single field.
    assert decode_frame(forge()).tobytes() == b"abcd"


@pytest.mark.parametrize(("fields", "match"), [
    ({"magic": b"KVTC"}, "magic"),
    ({"magic": b"\x00\x00\x00\x00"}, "magic"),
    ({"version": 0}, "version"),
    ({"version": 2}, "version"),
    ({"flags": 0x04}, "flags"),
    ({"flags": 0x80}, "flags"),
    ({"flags": FLAG_SHUFFLE}, "flags"),
    ({"ndim": 33, "shape": (1,) * 33, "payload": b"a", "raw_size": 1}, "ndim"),
    ({"ndim": 255}, "ndim"),
    ({"dlen": 0, "descriptor": b""}, "dtype length"),
    ({"dlen": 65, "descriptor": b"<" + b"u" * 64}, "dtype length"),
    ({"shape": (5,)}, "raw_size"),
    ({"shape": (2, 3)}, "raw_size"),
    ({"raw_size": 2**64 - 1}, "raw_size"),
    ({"stored_size": 3}, "stored_size"),
    ({"shape": (2**64 - 1,), "raw_size": 2**64 - 1}, "too large"),
    ({"shape": (0, 2**64 - 1), "raw_size": 0, "payload": b""}, "too large"),
    ({"shape": (0, 2**61), "descriptor": b"<f8", "raw_size": 0, "payload": b""}, "too large"),
    ({"shape": (2**32, 2**32), "raw_size": 2**64 - 1}, "too large"),
    # zstd frames whose sizes cannot be genuine (would make the decoder allocate raw_size).
    ({"flags": FLAG_ZSTD, "shape": (2**45,), "raw_size": 2**45}, "impossible"),
    ({"flags": FLAG_ZSTD, "shape": (0,), "raw_size": 0, "payload": b""}, "impossible"),
    ({"flags": FLAG_ZSTD, "payload": b"abcd"}, "zstd"),
])
def test_hostile_header_fields(fields: dict[str, Any], match: str) -> None:
    frame = forge(**fields)
    with pytest.raises(CorruptBlockError, match=match):
        decode_frame(frame)


def test_zstd_payload_declaring_another_size() -> None:
    import zstandard

    big = zstandard.ZstdCompressor(level=1).compress(b"\x00" * 100_000)
    with pytest.raises(CorruptBlockError, match="content size"):
        decode_frame(forge(flags=FLAG_ZSTD, shape=(10,), raw_size=10, payload=big))
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * 64)
    with pytest.raises(CorruptBlockError, match="content size"):
        decode_frame(forge(flags=FLAG_ZSTD, shape=(64,), raw_size=64, payload=unsized))
    garbage = b"\x28\xb5\x2f\xfd" + bytes(range(40))
    with pytest.raises(CorruptBlockError):
        decode_frame(forge(flags=FLAG_ZSTD, shape=(4,), raw_size=4, payload=garbage))


@pytest.mark.parametrize("descriptor", [
    b"O", b"|O", b"object", b"|O8", b"|V8", b"V8", b"void", b"void64", b"(1000000000,)f8",
    b"(2,)<f8", b"[('a', '<f8')]", b"<f8,<f8", b"x" * 64, b"abcdefghijklmnopqrstuvwxyzabcdefgh",
    "é<f8".encode(), b"\xff\xfe", b"<u\x00", b"<M8[xx]", b"|S0", b"<U0", b"str", b"bytes",
    b"|u1 ", b" |u1", b"<u1\n", b"nonexistent_dtype", b"<f3", b"<i9999999", b"<U999999",
])
def test_hostile_dtype_descriptors(descriptor: bytes) -> None:
    with pytest.raises(CorruptBlockError):
        decode_frame(forge(descriptor=descriptor))


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptBlockError):
        decode_frame(data)
    with pytest.raises(CorruptBlockError):
        decode_frame(MAGIC + b"\x01" + data)


_VALID = {
    "raw": np.arange(12, dtype=np.int32).reshape(3, 4),
    "zstd": kv_like(tokens=16, heads=2, dim=8),
}
_VALID_FRAMES = {
    "raw": encode_frame(_VALID["raw"]).to_bytes(),
    "zstd": encode_frame(_VALID["zstd"], compress_level=1, shuffle=True).to_bytes(),
}


@given(st.sampled_from(sorted(_VALID)),
       st.lists(st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(0, 10**6),
                          st.integers(0, 255)), min_size=1, max_size=4))
@pytest.mark.slow
@settings(max_examples=400, deadline=None)
def test_mutated_frames_decode_right_or_raise_corrupt(
        kind: str, edits: list[tuple[str, int, int]]) -> None:
    buf = bytearray(_VALID_FRAMES[kind])
    for op, pos, value in edits:
        i = pos % (len(buf) + 1)
        if op == "insert":
            buf.insert(i, value)
        elif buf and i < len(buf):
            if op == "set":
                buf[i] = value
            else:
                del buf[i]
    assert_decodes_or_corrupt(bytes(buf), _VALID[kind])


@given(st.sampled_from(sorted(_VALID)), st.integers(0, MIN_HEADER_BYTES + 60), st.binary(
    min_size=1, max_size=9), st.booleans())
@settings(max_examples=400, deadline=None)
def test_mutated_headers_with_valid_checksum_decode_or_raise_corrupt(
        kind: str, pos: int, patch: bytes, keep_magic: bool) -> None:
    """Past the checksum, only the parser's own checks stand between a forged header and
    numpy/zstd: the result must still be an array or CorruptBlockError, never another error."""
    buf = bytearray(_VALID_FRAMES[kind])
    buf[pos:pos + len(patch)] = patch
    if keep_magic:
        buf[:5] = MAGIC + b"\x01"
    ndim, dlen = buf[6], buf[7]
    header_len = 24 + 8 * ndim + dlen + 8
    assume(len(buf) >= header_len)
    checksum = xxhash.xxh3_64(bytes(buf[: header_len - 8]) + bytes(buf[header_len:]))
    buf[header_len - 8: header_len] = checksum.intdigest().to_bytes(8, "little")
    try:
        got = decode_frame(bytes(buf))
    except CorruptBlockError:
        return
    assert got.nbytes == parse_header(bytes(buf)).raw_size


# --------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize(("block", "options", "exc", "match"), [
    ([1, 2, 3], {}, TypeError, "block"),
    ("abc", {}, TypeError, "block"),
    (np.array([object()]), {}, TypeError, "block"),
    (np.zeros(2, dtype=[("a", "<f4")]), {}, TypeError, "block"),
    (np.zeros((4, 4))[:, ::2], {}, ValueError, "block"),
    (np.zeros(3, dtype="V4"), {}, TypeError, "block"),
    (np.zeros((1,) * 33, dtype=np.uint8), {}, ValueError, "block"),
    (np.zeros(4), {"compress_level": 0}, ValueError, "compress_level"),
    (np.zeros(4), {"compress_level": 23}, ValueError, "compress_level"),
])
def test_bad_encode_arguments(block: object, options: dict[str, Any], exc: type[Exception],
                              match: str) -> None:
    with pytest.raises(exc, match=match):
        encode_frame(block, **options)  # type: ignore[arg-type]
