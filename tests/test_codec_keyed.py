"""Version-2 frames: the key bound into the checksum (version 1 stays readable)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.codec import (
    FORMAT_VERSION,
    KEYED_FORMAT_VERSION,
    decode_frame,
    encode_frame,
    parse_header,
)
from kvtier.errors import CorruptBlockError

BLOCK = np.arange(4096, dtype="<u2").reshape(64, 64)


@pytest.mark.parametrize("compress", [None, 1])
def test_keyed_frame_verifies_only_under_its_key(compress: int | None) -> None:
    frame = encode_frame(BLOCK, compress_level=compress, shuffle=True, key=b"k1").to_bytes()
    assert parse_header(frame).version == KEYED_FORMAT_VERSION
    assert np.array_equal(decode_frame(frame, key=b"k1"), BLOCK)
    for other in (b"k2", b"k1\x00", b"\x00k1", b"K1"):
        with pytest.raises(CorruptBlockError, match="another key"):
            decode_frame(frame, key=other)
    with pytest.raises(CorruptBlockError, match="key="):
        decode_frame(frame)


def test_keyed_and_unkeyed_frames_differ_only_in_version_and_checksum() -> None:
    plain = encode_frame(BLOCK).to_bytes()
    keyed = encode_frame(BLOCK, key=b"k1").to_bytes()
    head = parse_header(plain)
    assert parse_header(plain).version == FORMAT_VERSION
    assert len(plain) == len(keyed) and plain[:4] == keyed[:4] and plain[5:head.header_len - 8] \
        == keyed[5:head.header_len - 8] and plain[head.header_len:] == keyed[head.header_len:]
    # Old frames stay readable, with or without a key given.
    assert np.array_equal(decode_frame(plain), BLOCK)
    assert np.array_equal(decode_frame(plain, key=b"anything"), BLOCK)


def test_every_bit_flip_of_a_keyed_frame_is_detected() -> None:
    frame = bytearray(encode_frame(np.arange(16, dtype=np.uint8), key=b"\xaa\xbb").to_bytes())
    for bit in range(len(frame) * 8):
        frame[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptBlockError):
            decode_frame(bytes(frame), key=b"\xaa\xbb")
        frame[bit // 8] ^= 1 << (bit % 8)


@pytest.mark.parametrize("key", [b"", b"x" * 256, "str-key", 7])
def test_bad_binding_keys_are_refused(key: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        encode_frame(BLOCK, key=key)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)):
        decode_frame(encode_frame(BLOCK, key=b"k").to_bytes(), key=key)  # type: ignore[arg-type]
