"""Block keys: chained digests over full blocks of prompt tokens.

``key_i = H(key_{i-1} || tokens of block i)`` with ``key_{-1} = H(namespace)`` and
``H = blake2b(digest_size=16)``. Keys are identical across processes, hosts and restarts
(no use of Python's salted ``hash()``), and two namespaces never share a key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.errors import InvalidKeyError

__all__ = [
    "KEY_DIGEST_BYTES",
    "MAX_KEY_BYTES",
    "KeyNamespace",
    "PrefixKeys",
    "key_from_hex",
    "prefix_keys",
    "validate_key",
]

KEY_DIGEST_BYTES = 16
MAX_KEY_BYTES = 128
_KEY_SCHEMA_VERSION = 1


def validate_key(key: object, name: str = "key") -> bytes:
    """Check that ``key`` is ``bytes`` of 1..128 bytes and return it.

    Raises
    ------
    TypeError
        If ``key`` is not ``bytes`` (``bytearray``/``memoryview`` are mutable and refused).
    InvalidKeyError
        If ``key`` is empty or longer than 128 bytes (a ``ValueError``).
    """
    if type(key) is not bytes:
        raise TypeError(f"{name}: expected bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidKeyError(f"{name}: length must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def key_from_hex(text: str, name: str = "key") -> bytes:
    """Parse a lowercase-hex key as used on the peer wire and in file names."""
    if not isinstance(text, str):
        raise TypeError(f"{name}: expected str, got {type(text).__name__}")
    if len(text) % 2 or text != text.lower():
        raise InvalidKeyError(f"{name}: expected lowercase hex of even length, got {text[:40]!r}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise InvalidKeyError(f"{name}: not hex: {text[:40]!r}") from None
    return validate_key(key, name)


def _field(value: str | bytes | int) -> bytes:
    # Length-prefixed fields: ("ab", "c") and ("a", "bc") must not encode alike.
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that must match for two engines to share KV blocks.

    Parameters
    ----------
    model
        Model identity, e.g. ``"llama-3.1-8b"`` (include the revision if weights change).
    dtype
        KV cache dtype, e.g. ``"bf16"``.
    layout
        Engine KV layout tag (e.g. ``"vllm-paged-nhd"``); engines with different layouts
        must not share blocks.
    tp_rank, tp_size
        Tensor-parallel rank and world size: each rank caches its own head shard.
    schema_version
        Key schema version; bump to invalidate every cached block at once.
    salt
        Optional tenant salt: tenants with different salts never share blocks.
    """

    model: str
    dtype: str = ""
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    schema_version: int = _KEY_SCHEMA_VERSION
    salt: str | bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: expected a non-empty str")
        for name in ("model", "dtype", "layout", "salt"):
            value = getattr(self, name)
            if name != "salt" and not isinstance(value, str):
                raise TypeError(f"{name}: expected str")
            if isinstance(value, str) and not value.isascii():
                try:  # root_key() hashes UTF-8; fail here, not at the first prefix_keys().
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{name}: not encodable as UTF-8: {value!r}") from None
        for name in ("tp_rank", "tp_size", "schema_version"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
        if self.tp_size < 1 or self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank/tp_size: need 0 <= tp_rank < tp_size, got "
                             f"{self.tp_rank}/{self.tp_size}")
        if not isinstance(self.salt, str | bytes):
            raise TypeError("salt: expected str or bytes")

    def root_key(self) -> bytes:
        """Return ``H(namespace)``, the seed of every prefix chain in this namespace."""
        h = hashlib.blake2b(digest_size=KEY_DIGEST_BYTES, person=b"kvtier-ns")
        for value in (self.model, self.dtype, self.layout, self.tp_rank, self.tp_size,
                      self.schema_version, self.salt):
            h.update(_field(value))
        return h.digest()


class PrefixKeys(list[bytes]):
    """The keys :func:`prefix_keys` returns: a plain ``list`` of the keys that also
    remembers how they were made (the namespace, the block size and the tokens hashed), so
    a lookup log can tell why two instances hash one prompt differently
    (:mod:`kvtier.lookuplog`). A slice or copy is a plain list.
    """

    __slots__ = ("_tokens", "block_tokens", "namespace")

    def __init__(self, keys: list[bytes], namespace: KeyNamespace, block_tokens: int,
                 tokens: bytes) -> None:
        super().__init__(keys)
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._tokens = tokens  # the hashed tokens, little-endian int64 (no copy is made)

    def prefix_digests(self) -> list[str]:
        """Per block, a digest of the prompt's tokens up to the block's end that does not
        depend on the namespace or the block size: two instances that see one prompt get
        equal digests at equal token counts, whatever their keys (hex, 16 characters)."""
        h = hashlib.blake2b(digest_size=8, person=b"kvtier-prompt")
        stride = self.block_tokens * 8
        out: list[str] = []
        for i in range(len(self)):
            h.update(self._tokens[i * stride:(i + 1) * stride])
            out.append(h.copy().hexdigest())
        return out


def _as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if isinstance(tokens, str | bytes):
            raise TypeError("tokens: expected a sequence of ints or an int array, got "
                            f"{type(tokens).__name__}")
        try:
            arr = np.asarray(tokens) if len(tokens) else np.zeros(0, dtype=np.int64)
        except (TypeError, ValueError) as exc:  # no len(), ragged nesting
            raise TypeError(f"tokens: expected a sequence of ints or an int array: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-d sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**63):
        raise ValueError("tokens: token ids must be in [0, 2**63)")
    # Fixed little-endian width so hosts of any byte order and any input dtype agree.
    return np.ascontiguousarray(arr, dtype="<i8")


def prefix_keys(
    tokens: Sequence[int] | npt.NDArray[np.integer],
    block_tokens: int,
    namespace: KeyNamespace,
) -> PrefixKeys:
    """Hash a prompt into one 16-byte key per *full* block of ``block_tokens`` tokens.

    Parameters
    ----------
    tokens
        Token ids, as a list of ints or a 1-d integer numpy array.
    block_tokens
        Tokens per KV block (the engine's page size), >= 1.
    namespace
        The :class:`KeyNamespace` the keys belong to.

    Returns
    -------
    PrefixKeys
        ``len(tokens) // block_tokens`` chained digests (a ``list`` of ``bytes``); a
        trailing partial block gets no key.

    Examples
    --------
    >>> ns = KeyNamespace(model="m", dtype="bf16")
    >>> keys = prefix_keys(list(range(1000)), block_tokens=256, namespace=ns)
    >>> len(keys), len(keys[0])
    (3, 16)
    """
    if type(block_tokens) is not int or block_tokens < 1:
        raise ValueError(f"block_tokens: expected an int >= 1, got {block_tokens!r}")
    if not isinstance(namespace, KeyNamespace):
        raise TypeError(f"namespace: expected KeyNamespace, got {type(namespace).__name__}")
    arr = _as_token_array(tokens)
    n_blocks = arr.size // block_tokens
    raw = arr[: n_blocks * block_tokens].tobytes()
    stride = block_tokens * 8
    keys = PrefixKeys([], namespace, block_tokens, raw)
    prev = namespace.root_key()
    blake2b = hashlib.blake2b
    for i in range(n_blocks):
        h = blake2b(prev, digest_size=KEY_DIGEST_BYTES)
        h.update(raw[i * stride : (i + 1) * stride])
        prev = h.digest()
        keys.append(prev)
    return keys
