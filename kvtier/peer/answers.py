"""The answers a :class:`~kvtier.peer.server.PeerServer` builds on both of its request paths
(aiohttp's routes and :mod:`kvtier.peer.dataplane`): which status an exception becomes, the
raw head of an answer the data plane writes itself, and the body of a batch get.

One implementation each, so that the two paths cannot drift apart: the tests compare their
answers to the same raw requests (``tests/test_peer_server_bounds.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvtier.codec import EncodedFrame
from kvtier.errors import BlockTooLargeError, CorruptBlockError, InvalidKeyError, TierFullError
from kvtier.peer import protocol as proto
from kvtier.peer.guards import BodyBudget
from kvtier.peer.headercache import FrameHeaders

__all__ = ["BatchAnswer", "Failure", "answer_head", "batch_get_answer", "failure_of"]

Block = npt.NDArray[np.generic]
TEXT = "text/plain; charset=utf-8"
_GetMany = Callable[[Sequence[bytes]], Awaitable[list[Block | None]]]


@dataclass(frozen=True)
class Failure:
    """The answer to a request that raised: status, text, whether the connection closes, and
    what kind of failure it was (``server`` ones are logged, the others counted)."""

    status: int
    text: str
    close: bool
    kind: Literal["client", "timeout", "gone", "server"]


def failure_of(exc: Exception, body_timeout: float) -> Failure:
    """The answer to a request that raised ``exc``. Client input never becomes a 5xx: a
    ``503`` means the segment itself failed (or a bug), which the server logs."""
    if isinstance(exc, BlockTooLargeError | proto.LimitExceededError):
        return Failure(413, str(exc), False, "client")
    if isinstance(exc, InvalidKeyError | proto.ProtocolError | CorruptBlockError):
        return Failure(400, str(exc), False, "client")
    if isinstance(exc, TierFullError):
        return Failure(507, str(exc), False, "client")
    if isinstance(exc, TimeoutError):
        return Failure(408, str(exc) or f"no body bytes for {body_timeout} s", True, "timeout")
    if isinstance(exc, ConnectionError):
        # The client went away mid-request (e.g. a truncated body): nobody to answer.
        return Failure(499, "client closed request", False, "gone")
    return Failure(503, "internal error, see server log", False, "server")


def answer_head(status: int, content_type: str, length: int, *, close: bool = False,
                extra: bytes = b"") -> bytes:
    """Status line and headers of an answer (a ``204`` carries no length, RFC 9110);
    ``extra`` is more header lines, each ending in CRLF."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Client Closed Request" if status == 499 else "Error"
    lines = [f"HTTP/1.1 {status} {reason}"]
    if status != 204:
        lines += [f"Content-Type: {content_type}", f"Content-Length: {length}"]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1") + extra + b"\r\n"


@dataclass(frozen=True)
class BatchAnswer:
    """A batch get answer: its buffers, the in-flight budget bytes it took (given back once
    sent), and whether it was cut short."""

    buffers: list[bytes | memoryview]
    reserved: int
    truncated: bool


async def batch_get_answer(segment_get_many: _GetMany, frames: FrameHeaders,
                           keys: Sequence[bytes], limits: proto.Limits,
                           budget: BodyBudget) -> BatchAnswer:
    """The batch get answer for ``keys``.

    Blocks in request order. A key repeated in one request is served once (later repeats
    answer as missing), and the answer stops growing at ``max_body_bytes`` and at the
    in-flight budget: the keys past that point answer as missing, and the client asks for
    them again."""
    unique = list(dict.fromkeys(keys))
    blocks = await segment_get_many(unique) if unique else []
    found = {k: b for k, b in zip(unique, blocks, strict=True) if b is not None}
    room = limits.max_body_bytes
    reserved = 0
    truncated = False
    items: list[tuple[bytes, EncodedFrame | None]] = []
    for key in keys:
        block = found.pop(key, None)  # pop: a repeat finds nothing
        frame = None if block is None else frames.encode(key, block)  # bound to its key
        if frame is not None:
            size = 2 + len(key) + 8 + frame.nbytes
            if size > room or not budget.try_take(frame.nbytes):
                truncated = True
                found.clear()  # the rest answer as missing
                frame = None
            else:
                room -= size
                reserved += frame.nbytes
        items.append((key, frame))
    del blocks, found
    return BatchAnswer(proto.encode_blocks(items), reserved, truncated)
