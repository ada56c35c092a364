"""The host daemon's control channel: JSON requests over HTTP/1.1 on a Unix socket.

Bulk bytes never travel here: a hit is a list of slot descriptors (``lease``, ``offset``,
``nbytes``, ``dtype``, ``shape``) in the shared arena, a save a list of slots to copy into.
Every request is a ``POST`` with a JSON object body (``GET`` for ``/v1/info`` and
``/v1/stats``); keys are lowercase hex. Answers are JSON objects; a malformed request gets
400, a peer of another user 403, a body past :data:`MAX_BODY` 413, each with no side effect.

Why aiohttp and JSON, not a hand-written framing: the parser is a maintained one, and a call
is small beside the copy of a realistic hit it arranges. On the 2-core development box at
load 7-8 a call took 0.5-1.3 ms (``benchmarks/bench_local.py`` prints it), a bare
length-prefixed echo over an asyncio Unix socket 0.13 ms, and a hit's copy 3 ms (16 MiB) to
50 ms (256 MiB); ``docs/host-daemon.md`` says where a faster channel would pay.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from kvtier.codec import dtype_descriptor
from kvtier.errors import CorruptBlockError, ProtocolError

__all__ = ["MAX_BODY", "MAX_KEYS", "MAX_NDIM", "dump", "load", "parse_dtype", "parse_ids",
           "parse_keys", "parse_shape"]

#: Most keys (or slots) one request may name.
MAX_KEYS = 8192
#: Largest request body accepted, in bytes (8192 hex keys of 128 bytes fit).
MAX_BODY = 4 << 20
MAX_NDIM = 16


def dump(obj: dict[str, Any]) -> bytes:
    """Encode a message."""
    return json.dumps(obj, separators=(",", ":")).encode()


def load(body: bytes) -> dict[str, Any]:
    """Decode a message; :class:`ProtocolError` unless it is a JSON object."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"body: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("body: expected a JSON object")
    return obj


def _list(msg: dict[str, Any], field: str) -> list[Any]:
    value = msg.get(field)
    if not isinstance(value, list):
        raise ProtocolError(f"{field}: expected a list")
    if len(value) > MAX_KEYS:
        raise ProtocolError(f"{field}: {len(value)} entries, at most {MAX_KEYS}")
    return value


def parse_keys(msg: dict[str, Any], field: str = "keys") -> list[bytes]:
    """The hex keys of ``msg[field]`` as bytes (1..128 bytes each)."""
    keys: list[bytes] = []
    for i, text in enumerate(_list(msg, field)):
        try:
            key = bytes.fromhex(text) if isinstance(text, str) else b""
        except ValueError:
            key = b""
        if not 1 <= len(key) <= 128:
            raise ProtocolError(f"{field}[{i}]: expected 1-128 bytes as hex")
        keys.append(key)
    return keys


def parse_ids(msg: dict[str, Any], field: str = "leases") -> list[int]:
    """Lease ids (non-negative integers) of ``msg[field]``."""
    ids = _list(msg, field)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ProtocolError(f"{field}: expected non-negative integers")
    return ids


def parse_dtype(text: object) -> np.dtype[Any]:
    """A dtype descriptor (:func:`kvtier.codec.dtype_descriptor`) back to a dtype."""
    if not isinstance(text, str) or not 0 < len(text) <= 64:
        raise ProtocolError("dtype: expected a dtype descriptor")
    from kvtier.codec import _resolve_dtype

    try:
        return _resolve_dtype(text)
    except CorruptBlockError as exc:
        raise ProtocolError(f"dtype: {exc}") from None


def parse_shape(value: object) -> tuple[int, ...]:
    """A block shape: at most :data:`MAX_NDIM` non-negative integers."""
    if not isinstance(value, list) or len(value) > MAX_NDIM or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40 for n in value):
        raise ProtocolError("shape: expected a list of non-negative integers")
    return tuple(value)


def describe(dtype: np.dtype[Any]) -> str:
    """A dtype as the messages carry it."""
    return dtype_descriptor(dtype)
