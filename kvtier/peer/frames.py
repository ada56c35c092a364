"""What a client accepts from a peer: the block it asked for, within its own limits.

A peer can be buggy, misconfigured, or a process that took over a member's port; whatever it
sends may cost a miss, never wrong bytes, a stalled event loop or unbounded memory. So a frame
from a peer must be bound to the requested key (version 2, see :mod:`kvtier.codec`), declare
no more than the client's ``max_block_bytes`` before anything is decompressed, and is
decoded off the event loop when checksumming or decompressing it takes long.
"""

from __future__ import annotations

import asyncio

from kvtier.codec import FLAG_ZSTD, KEYED_FORMAT_VERSION, decode_frame, parse_header
from kvtier.errors import CorruptBlockError
from kvtier.tiers.base import Block

__all__ = ["INLINE_DECODE_BYTES", "decode_from_peer"]

# Raw frames up to this size are verified on the loop (xxh3 runs at >10 GB/s: ~0.1 ms per
# MiB, less than a thread hand-off costs); larger or compressed ones go to a worker thread.
INLINE_DECODE_BYTES = 1 << 20


async def decode_from_peer(frame: bytes | memoryview, key: bytes,
                           max_block_bytes: int) -> Block:
    """Verify that ``frame`` is the block of ``key`` and decode it.

    Parameters
    ----------
    frame
        The frame exactly as the peer sent it.
    key
        The key that was asked for.
    max_block_bytes
        The largest decoded block this client accepts (checked before decompressing).

    Returns
    -------
    Block
        The block; for an uncompressed frame a view of ``frame``.

    Raises
    ------
    CorruptBlockError
        If the frame is malformed, not bound to ``key``, or larger than the limit.
    """
    view = memoryview(frame)
    head = parse_header(view)
    if head.version < KEYED_FORMAT_VERSION:
        raise CorruptBlockError(f"frame: version {head.version} is not bound to its key "
                                f"(peers must answer version {KEYED_FORMAT_VERSION})")
    if head.raw_size > max_block_bytes:
        raise CorruptBlockError(f"frame: raw_size {head.raw_size} exceeds this client's "
                                f"max_block_bytes {max_block_bytes}")
    if head.flags & FLAG_ZSTD or head.stored_size > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(decode_frame, view, key=key)
    return decode_frame(view, key=key)
