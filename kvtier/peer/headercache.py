"""Key-bound frame headers of the blocks a server answered, so that serving the same stored
block again skips its checksum pass (a pass over the whole payload: ~7% of the server's CPU
for a 1 MiB block GET, see docs/performance.md).

A header is reused only for the very same array object the segment returned before (held
by a weak reference, so the cache never keeps a block, or a DRAM arena slot, alive), and
only when that array is read-only: a tier's stored blocks never change while referenced
(the DRAM tier returns its stored read-only array itself), so the same object means the
same shape, dtype and bytes. A put of the key stores a new object, which misses here. If a
segment broke that contract, the client's checksum check would turn the stale header into
a miss, never into wrong bytes.
"""

from __future__ import annotations

import weakref

import numpy as np

from kvtier.codec import EncodedFrame, encode_frame
from kvtier.tiers.base import Block

__all__ = ["FrameHeaders"]


class FrameHeaders:
    """Encodes blocks as version-2 frames, reusing the header of an unchanged block.

    Parameters
    ----------
    max_entries
        Most headers kept (the oldest go first); each is ~100 bytes plus its key.
    """

    def __init__(self, max_entries: int = 16384) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self.hits = 0
        self._headers: dict[bytes, tuple[weakref.ref[Block], bytes]] = {}

    def encode(self, key: bytes, block: Block) -> EncodedFrame:
        """``encode_frame(block, key=key)``, without the checksum pass on a repeat."""
        entry = self._headers.get(key)
        if entry is not None and entry[0]() is block:
            self.hits += 1
            payload = block.reshape(-1).view(np.uint8).data if block.size else memoryview(b"")
            return EncodedFrame(header=entry[1], payload=payload)
        frame = encode_frame(block, key=key)
        if isinstance(block, np.ndarray) and not block.flags.writeable:
            self._headers.pop(key, None)  # re-inserted last: the oldest go first
            self._headers[key] = (weakref.ref(block), frame.header)
            if len(self._headers) > self.max_entries:
                del self._headers[next(iter(self._headers))]
        return frame

    def forget(self, key: bytes) -> None:
        """Drop the header of ``key`` (it was deleted)."""
        self._headers.pop(key, None)

    def __len__(self) -> int:
        return len(self._headers)
