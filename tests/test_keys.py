"""Prefix keys: stable across processes, chained over full blocks, separated by namespace."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidKeyError
from kvtier.keys import (
    KEY_DIGEST_BYTES,
    MAX_KEY_BYTES,
    KeyNamespace,
    key_from_hex,
    prefix_keys,
    validate_key,
)

REPO = Path(__file__).resolve().parents[1]
NS = KeyNamespace(model="llama-3.1-8b", dtype="bf16")

# prefix_keys(range(1024), 256, NS): if these change, every cached block in every deployment
# is orphaned. Change them only together with KeyNamespace.schema_version's default.
GOLDEN_ROOT = "66b637011360118dd25a90c0b2825b56"
GOLDEN_KEYS = [
    "eac255fcdd3c23246f07d00bcd670add",
    "1a3599efb30d4585c403800be2a4d5a3",
    "6313747c889232fa411799840fca3bb4",
    "180e0ae2a77bbd0fdadc3a55e7cc78a0",
]


def test_golden_keys_are_pinned() -> None:
    assert NS.root_key().hex() == GOLDEN_ROOT
    assert [k.hex() for k in prefix_keys(range(1024), 256, NS)] == GOLDEN_KEYS


def test_scheme_matches_its_specification() -> None:
    """Re-derive the keys from the documented scheme (docs/keys.md) with hashlib alone."""

    def field(raw: bytes) -> bytes:
        return len(raw).to_bytes(4, "little") + raw

    h = hashlib.blake2b(digest_size=16, person=b"kvtier-ns")
    for raw in (b"llama-3.1-8b", b"bf16", b"", b"0", b"1", b"1", b""):
        h.update(field(raw))
    prev = h.digest()
    assert prev.hex() == GOLDEN_ROOT
    expected = []
    for i in range(4):
        block = np.arange(i * 256, (i + 1) * 256, dtype="<i8").tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        expected.append(prev.hex())
    assert expected == GOLDEN_KEYS


_CHILD = """
import sys
from kvtier.keys import KeyNamespace, prefix_keys
ns = KeyNamespace(model="llama-3.1-8b", dtype="bf16", layout="nhd", tp_rank=1, tp_size=2,
                  salt="tenant-a")
print(",".join(k.hex() for k in prefix_keys(list(range(3000)), 128, ns)))
"""


@pytest.mark.slow
def test_keys_identical_across_processes_with_different_hash_seeds() -> None:
    ns = KeyNamespace(model="llama-3.1-8b", dtype="bf16", layout="nhd", tp_rank=1, tp_size=2,
                      salt="tenant-a")
    here = ",".join(k.hex() for k in prefix_keys(list(range(3000)), 128, ns))
    outs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        outs.append(proc.stdout.strip())
    assert outs[0] == outs[1] == here
    assert len(here.split(",")) == 3000 // 128


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint16, np.uint64])
def test_list_and_numpy_inputs_agree(dtype: type[np.integer]) -> None:
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 60000, 1000)]
    expected = prefix_keys(tokens, 64, NS)
    assert prefix_keys(np.asarray(tokens, dtype=dtype), 64, NS) == expected
    assert prefix_keys(tuple(tokens), 64, NS) == expected
    # Byte order and strides of the input do not matter either.
    assert prefix_keys(np.asarray(tokens, dtype=">i8"), 64, NS) == expected
    assert prefix_keys(np.repeat(np.asarray(tokens, dtype=np.int64), 2)[::2], 64, NS) == expected


@pytest.mark.parametrize(("n", "block"), [(0, 4), (3, 4), (4, 4), (1023, 256), (1024, 256),
                                          (1025, 256), (7, 1)])
def test_only_full_blocks_are_hashed(n: int, block: int) -> None:
    keys = prefix_keys(list(range(n)), block, NS)
    assert len(keys) == n // block
    assert all(type(k) is bytes and len(k) == KEY_DIGEST_BYTES for k in keys)
    # The trailing partial block never influences the keys.
    assert prefix_keys([*range(n), 99, 98], block, NS)[: n // block] == keys


@given(st.lists(st.integers(0, 2**31), min_size=8 * 4, max_size=8 * 6), st.data())
@settings(max_examples=60, deadline=None)
def test_chaining(tokens: list[int], data: st.DataObject) -> None:
    block = 8
    keys = prefix_keys(tokens, block, NS)
    j = data.draw(st.integers(0, len(keys) * block - 1), label="changed token")
    changed = list(tokens)
    changed[j] = tokens[j] + 1
    new = prefix_keys(changed, block, NS)
    b = j // block
    assert new[:b] == keys[:b]
    assert all(x != y for x, y in zip(new[b:], keys[b:], strict=True))
    # A key depends on the whole prefix, not just its own block's tokens.
    assert prefix_keys(tokens[block:], block, NS)[0] != keys[1]
    assert len(set(keys)) == len(keys) or len(set(tokens)) < len(tokens)


def _identity(ns: KeyNamespace) -> tuple[object, ...]:
    # A str salt is its UTF-8 bytes: salt="t1" and salt=b"t1" name the same tenant.
    salt = ns.salt.encode() if isinstance(ns.salt, str) else ns.salt
    return (ns.model, ns.dtype, ns.layout, ns.tp_rank, ns.tp_size, ns.schema_version, salt)


_text = st.text(max_size=6)
namespaces = st.builds(
    lambda model, dtype, layout, tp, schema, salt: KeyNamespace(
        model=model, dtype=dtype, layout=layout, tp_rank=tp[0], tp_size=tp[1],
        schema_version=schema, salt=salt),
    st.text(min_size=1, max_size=6), _text, _text,
    st.integers(1, 4).flatmap(lambda size: st.tuples(st.integers(0, size - 1), st.just(size))),
    st.integers(0, 3), st.one_of(_text, st.binary(max_size=6)),
)


@pytest.mark.slow
@given(namespaces, namespaces, st.lists(st.integers(0, 50000), min_size=4, max_size=12))
@settings(max_examples=300, deadline=None)
def test_distinct_namespaces_never_share_keys(a: KeyNamespace, b: KeyNamespace,
                                              tokens: list[int]) -> None:
    keys_a, keys_b = prefix_keys(tokens, 2, a), prefix_keys(tokens, 2, b)
    if _identity(a) == _identity(b):
        assert keys_a == keys_b
    else:
        assert a.root_key() != b.root_key()
        assert not set(keys_a) & set(keys_b)


@pytest.mark.parametrize("change", [
    {"model": "llama-3.1-70b"}, {"dtype": "fp8"}, {"layout": "hnd"}, {"tp_size": 2},
    {"tp_rank": 1, "tp_size": 2}, {"schema_version": 2}, {"salt": "tenant"}, {"salt": b"\x00"},
    # Length prefixes: moving a character between adjacent fields changes the key.
    {"model": "llama-3.1-8bb", "dtype": "f16"},
])
def test_each_namespace_field_separates_keys(change: dict[str, object]) -> None:
    other = replace(NS, **change)  # type: ignore[arg-type]
    assert not set(prefix_keys(range(1024), 256, NS)) & set(prefix_keys(range(1024), 256, other))


def test_str_salt_is_its_utf8_bytes() -> None:
    a = KeyNamespace(model="m", salt="tenant-é")
    b = KeyNamespace(model="m", salt="tenant-é".encode())
    assert prefix_keys(range(8), 4, a) == prefix_keys(range(8), 4, b)


@pytest.mark.parametrize(("tokens", "exc", "match"), [
    ([1.0, 2.0], TypeError, "tokens"),
    (np.array([1.5, 2.5]), TypeError, "tokens"),
    (np.array([True, False]), TypeError, "tokens"),
    (np.zeros((2, 4), dtype=np.int64), ValueError, "tokens"),
    ([[1, 2], [3, 4]], ValueError, "tokens"),
    ([[1, 2], [3]], TypeError, "tokens"),
    ([1, -1], ValueError, "tokens"),
    (np.array([5, -3], dtype=np.int32), ValueError, "tokens"),
    (np.array([2**63], dtype=np.uint64), ValueError, "tokens"),
    ([1, 2**64], TypeError, "tokens"),
    (["a", "b"], TypeError, "tokens"),
    ("abcd", TypeError, "tokens"),
    (b"abcd", TypeError, "tokens"),
    ([1, None], TypeError, "tokens"),
    (iter([1, 2]), TypeError, "tokens"),
])
def test_bad_tokens(tokens: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        prefix_keys(tokens, 2, NS)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_tokens", [0, -1, True, 2.0, "4", None])
def test_bad_block_tokens(block_tokens: object) -> None:
    with pytest.raises((TypeError, ValueError), match="block_tokens"):
        prefix_keys([1, 2, 3, 4], block_tokens, NS)  # type: ignore[arg-type]


@pytest.mark.parametrize("namespace", [None, "llama", {"model": "m"}, ("m",)])
def test_bad_namespace(namespace: object) -> None:
    with pytest.raises(TypeError, match="namespace"):
        prefix_keys([1, 2, 3, 4], 2, namespace)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"model": ""}, "model"), ({"model": 3}, "model"), ({"model": "m", "dtype": 1}, "dtype"),
    ({"model": "m", "layout": None}, "layout"), ({"model": "m", "tp_rank": -1}, "tp_rank"),
    ({"model": "m", "tp_size": 0}, "tp_size"), ({"model": "m", "tp_rank": 2, "tp_size": 2},
                                                 "tp_rank"),
    ({"model": "m", "tp_rank": True}, "tp_rank"), ({"model": "m", "schema_version": 1.0},
                                                   "schema_version"),
    ({"model": "m", "salt": 5}, "salt"), ({"model": "\udc80"}, "model"),
    ({"model": "m", "salt": "\ud800"}, "salt"),
])
def test_bad_namespace_fields(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        KeyNamespace(**kwargs)  # type: ignore[arg-type]


def test_validate_key() -> None:
    assert validate_key(b"x") == b"x"
    assert validate_key(b"x" * MAX_KEY_BYTES) == b"x" * MAX_KEY_BYTES
    with pytest.raises(InvalidKeyError, match="key"):
        validate_key(b"")
    with pytest.raises(InvalidKeyError, match="129"):
        validate_key(b"x" * (MAX_KEY_BYTES + 1))
    for bad in ("abc", bytearray(b"abc"), memoryview(b"abc"), 5, None):
        with pytest.raises(TypeError, match="my_key"):
            validate_key(bad, "my_key")


def test_key_from_hex() -> None:
    key = prefix_keys(range(4), 4, NS)[0]
    assert key_from_hex(key.hex()) == key
    assert key_from_hex("00") == b"\x00"
    for bad in ("", "0", "ABCD", "zz", "0g", " 00", "00 ", "ab" * (MAX_KEY_BYTES + 1)):
        with pytest.raises(InvalidKeyError, match="k"):
            key_from_hex(bad, "k")
    with pytest.raises(TypeError, match="k"):
        key_from_hex(b"00", "k")  # type: ignore[arg-type]
