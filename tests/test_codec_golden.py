"""Golden frames: the bytes below pin the on-disk / on-wire block format (docs/codec.md).

A change that alters any of them breaks every LMDB file, object-store copy and peer of an
older version: bump ``FORMAT_VERSION`` and keep decoding version 1 instead.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import xxhash
import zstandard

from kvtier.codec import FLAG_SHUFFLE, FLAG_ZSTD, MAGIC, decode_frame, encode_frame, parse_header

try:
    import ml_dtypes

    BF16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    BF16 = None

# name -> (array factory, encode options, frame hex)
GOLDEN: dict[str, tuple[Any, dict[str, Any], str]] = {
    "u8_raw": (
        lambda: np.arange(4, dtype=np.uint8), {},
        "4b565442010001030400000000000000040000000000000004000000000000007c75311c96e06f320bef"
        "2300010203"),
    "f16_2x3_raw": (
        lambda: np.arange(6, dtype=np.float16).reshape(2, 3), {},
        "4b565442010002030c000000000000000c00000000000000020000000000000003000000000000003c66"
        "32d9a5454c83fbad3e0000003c0040004200440045"),
    "i4_scalar_raw": (
        lambda: np.array(7, dtype="<i4"), {},
        "4b56544201000003040000000000000004000000000000003c6934afc9b6e3480b94dc07000000"),
    "f8_big_endian_raw": (
        lambda: np.array([1.5, -2.0], dtype=">f8"), {},
        "4b565442010001031000000000000000100000000000000002000000000000003e66384847b83ba33018"
        "b53ff8000000000000c000000000000000"),
    "bf16_raw": (
        lambda: np.array([1.0, -2.5, 3.0], dtype=BF16), {},
        "4b5654420100010806000000000000000600000000000000030000000000000062666c6f61743136d88e"
        "5c09eb47503d803f20c04040"),
    "empty_f4": (
        lambda: np.zeros((0, 3), dtype=np.float32), {},
        "4b5654420100020300000000000000000000000000000000000000000000000003000000000000003c66"
        "34fa8e3e10b78f123e"),
    "f16_zstd3_shuffle": (
        lambda: np.full(64, 1.0, dtype=np.float16), {"compress_level": 3, "shuffle": True},
        "4b565442010301038000000000000000140000000000000040000000000000003c6632e2bcdc379f5f7b"
        "9228b52ffd20805d00001800003c020004929804b0"),
    "u16_zstd1": (
        lambda: np.zeros(64, dtype=np.uint16), {"compress_level": 1},
        "4b565442010101038000000000000000110000000000000040000000000000003c75321095ba65239378"
        "0d28b52ffd208045000010000001003b0558"),
}
# Compressed payload bytes are libzstd's choice; decoding them is pinned for every version,
# encoding them byte-for-byte only for the libzstd these vectors were made with.
ZSTD_VERSION_OF_VECTORS = (1, 5, 7)


def _array(name: str) -> np.ndarray[Any, Any]:
    factory, _, _ = GOLDEN[name]
    if name.startswith("bf16") and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    arr: np.ndarray[Any, Any] = factory()
    return arr


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_decode_golden(name: str) -> None:
    expected = _array(name)
    got = decode_frame(bytes.fromhex(GOLDEN[name][2]))
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_encode_golden(name: str) -> None:
    arr = _array(name)
    options = GOLDEN[name][1]
    frame = encode_frame(arr, **options)
    golden = bytes.fromhex(GOLDEN[name][2])
    if options.get("compress_level") and zstandard.ZSTD_VERSION != ZSTD_VERSION_OF_VECTORS:
        # Another libzstd may pick other bytes; the header's fixed part is still ours.
        assert frame.header[:8] == golden[:8]
        assert decode_frame(frame.to_bytes()).tobytes() == arr.tobytes()
    else:
        assert frame.to_bytes() == golden


def test_layout_matches_documentation() -> None:
    """Build a frame by hand from the layout table in kvtier/codec.py and docs/codec.md."""
    arr = np.arange(6, dtype="<u2").reshape(3, 2)
    payload = arr.tobytes()
    head = (b"KVTB" + bytes([1, 0, 2, 3]) + struct.pack("<QQ", 12, 12) + struct.pack("<2Q", 3, 2)
            + b"<u2")
    checksum = xxhash.xxh3_64(head + payload).intdigest()
    hand = head + struct.pack("<Q", checksum) + payload
    assert encode_frame(arr).to_bytes() == hand
    assert hand[:4] == MAGIC
    header = parse_header(hand)
    assert (header.flags, header.shape, header.raw_size, header.stored_size) == (0, (3, 2), 12, 12)
    assert header.header_len == 24 + 16 + 3 + 8 and header.checksum == checksum
    assert header.frame_len == len(hand)


def test_golden_flags() -> None:
    assert bytes.fromhex(GOLDEN["f16_zstd3_shuffle"][2])[5] == FLAG_ZSTD | FLAG_SHUFFLE
    assert bytes.fromhex(GOLDEN["u16_zstd1"][2])[5] == FLAG_ZSTD
    assert all(bytes.fromhex(v[2])[5] == 0 for k, v in GOLDEN.items() if "zstd" not in k)
