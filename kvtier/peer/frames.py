"""What a client accepts from a peer: the block it asked for, within its own limits.

A peer can be buggy, misconfigured, or a process that took over a member's port; whatever it
sends may cost a miss, never a stalled event loop or unbounded memory. So every frame from a
peer is checked against what was asked before anything is decompressed: bound to the
requested key (version 2, see :mod:`kvtier.codec`; a member of the previous protocol
version may answer version-1 frames), declaring no more than the client's
``max_block_bytes``, and, when the client knows its blocks' size (``block_bytes``: KV
blocks of one namespace all have one size), declaring exactly that. Frames that take long
to verify or decompress are decoded off the event loop, a batch's in one worker call.

The checksum detects errors, not forgery: xxh3 is public, so a process answering on a
member's port can compute a valid checksum for wrong bytes bound to the asked key. Only an
authenticated member (TLS with a pinned CA, or mutual TLS; docs/peer-pool.md, "Security")
rules that out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.codec import FLAG_ZSTD, KEYED_FORMAT_VERSION, FrameHeader, decode_frame, parse_header
from kvtier.errors import CorruptBlockError
from kvtier.tiers.base import Block

__all__ = ["INLINE_DECODE_BYTES", "Accept", "decode_batch_from_peer", "decode_from_peer"]

# Raw frames up to this size are verified on the loop (xxh3 runs at >10 GB/s: ~0.1 ms per
# MiB, less than a thread hand-off costs); larger or compressed ones go to a worker thread.
INLINE_DECODE_BYTES = 1 << 20


@dataclass(frozen=True)
class Accept:
    """What a client accepts as one block from a peer.

    Parameters
    ----------
    max_block_bytes
        The largest decoded block.
    block_bytes
        The one decoded size every block has, when the client knows it (``None``: any size
        up to ``max_block_bytes``).
    unbound
        Whether version-1 frames (not bound to their key) are accepted: only from a member
        that announced the previous protocol version.
    """

    max_block_bytes: int
    block_bytes: int | None = None
    unbound: bool = False

    def check(self, head: FrameHeader) -> None:
        """Refuse a frame whose header does not fit (nothing decompressed yet)."""
        if head.version < KEYED_FORMAT_VERSION and not self.unbound:
            raise CorruptBlockError(f"frame: version {head.version} is not bound to its key "
                                    f"(peers must answer version {KEYED_FORMAT_VERSION})")
        if self.block_bytes is not None and head.raw_size != self.block_bytes:
            raise CorruptBlockError(f"frame: raw_size {head.raw_size} is not this client's "
                                    f"block_bytes {self.block_bytes}")
        if head.raw_size > self.max_block_bytes:
            raise CorruptBlockError(f"frame: raw_size {head.raw_size} exceeds this client's "
                                    f"max_block_bytes {self.max_block_bytes}")


def _off_loop(head: FrameHeader) -> bool:
    return bool(head.flags & FLAG_ZSTD) or head.stored_size > INLINE_DECODE_BYTES


async def decode_from_peer(frame: bytes | memoryview, key: bytes, accept: Accept) -> Block:
    """Verify that ``frame`` is the block of ``key`` and decode it.

    Parameters
    ----------
    frame
        The frame exactly as the peer sent it.
    key
        The key that was asked for.
    accept
        What this client accepts (checked before decompressing).

    Returns
    -------
    Block
        The block; for an uncompressed frame a view of ``frame``.

    Raises
    ------
    CorruptBlockError
        If the frame is malformed, not bound to ``key``, or not a size ``accept`` takes.
    """
    view = memoryview(frame)
    head = parse_header(view)
    accept.check(head)
    if _off_loop(head):
        return await asyncio.to_thread(decode_frame, view, key=key)
    return decode_frame(view, key=key)


def _decode_or_error(frame: memoryview, key: bytes) -> Block | CorruptBlockError:
    try:
        return decode_frame(frame, key=key)
    except CorruptBlockError as exc:
        return exc
    except MemoryError as exc:  # a frame the client has no room for is that frame's miss
        return CorruptBlockError(f"frame: no memory to decode it ({exc})")


def _decode_all(jobs: list[tuple[int, memoryview, bytes]]
                ) -> list[tuple[int, Block | CorruptBlockError]]:
    return [(i, _decode_or_error(frame, key)) for i, frame, key in jobs]


async def decode_batch_from_peer(frames: Sequence[bytes | memoryview | None],
                                 keys: Sequence[bytes], accept: Accept
                                 ) -> list[Block | CorruptBlockError | None]:
    """:func:`decode_from_peer` for a batch answer: every header is checked before any frame
    is decompressed, and the frames to decode off the loop go to one worker-thread call.

    Returns
    -------
    list
        Per key: the block, ``None`` for a frame the peer did not send, or the
        :class:`~kvtier.errors.CorruptBlockError` that frame was refused with.
    """
    out: list[Block | CorruptBlockError | None] = [None] * len(keys)
    later: list[tuple[int, memoryview, bytes]] = []
    for i, (frame, key) in enumerate(zip(frames, keys, strict=True)):
        if frame is None:
            continue
        view = memoryview(frame)
        try:
            head = parse_header(view)
            accept.check(head)
        except CorruptBlockError as exc:
            out[i] = exc
            continue
        if _off_loop(head):
            later.append((i, view, key))
        else:
            out[i] = _decode_or_error(view, key)
    if later:
        for i, result in await asyncio.to_thread(_decode_all, later):
            out[i] = result
    return out
