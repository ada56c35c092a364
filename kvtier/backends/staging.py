"""Chunked, double-buffered copies through pinned host staging buffers.

A DMA engine can only read and write page-locked ("pinned") host memory at full speed, and
callers hand kvtier ordinary pageable ``numpy`` arrays. Copying through a pinned staging
buffer in chunks lets the CPU fill (or drain) one buffer while the device copies the other,
so a transfer costs about ``max(memcpy, DMA)`` instead of their sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["StagingPipeline"]

#: ``dma(buffer_index, byte_offset, length)`` issues one asynchronous chunk copy.
Dma = Callable[[int, int, int], None]


class StagingPipeline:
    """Round-robin over pinned ``buffers`` of equal size, fenced by per-buffer events.

    Parameters
    ----------
    buffers
        Pinned host ``uint8`` arrays (at least one), all of the same length: the chunk size.
    wait
        ``wait(i)`` blocks until the last copy recorded for buffer ``i`` has completed.
    record
        ``record(i)`` marks the copies issued so far as the ones ``wait(i)`` waits for.
    """

    def __init__(self, buffers: Sequence[npt.NDArray[np.uint8]], wait: Callable[[int], None],
                 record: Callable[[int], None]) -> None:
        if not buffers:
            raise ValueError("buffers: need at least one staging buffer")
        self._buffers = list(buffers)
        self._chunk = int(self._buffers[0].size)
        self._wait = wait
        self._record = record

    def upload(self, src: npt.NDArray[np.uint8], dma: Dma) -> None:
        """Stage ``src`` chunk by chunk; ``dma`` copies staging buffer -> device. The last
        chunks may still be in flight on return (``src`` itself may be reused)."""
        count = len(self._buffers)
        for i, start in enumerate(range(0, src.size, self._chunk)):
            k = i % count
            length = min(self._chunk, src.size - start)
            self._wait(k)  # the DMA that last read this buffer must be done before refilling
            np.copyto(self._buffers[k][:length], src[start:start + length], casting="no")
            dma(k, start, length)
            self._record(k)

    def download(self, dst: npt.NDArray[np.uint8], dma: Dma) -> None:
        """Fill ``dst``; ``dma`` copies device -> staging buffer. Complete on return."""
        count = len(self._buffers)
        starts = list(range(0, dst.size, self._chunk))

        def issue(j: int) -> None:
            k = j % count
            dma(k, starts[j], min(self._chunk, dst.size - starts[j]))
            self._record(k)

        for j in range(min(count, len(starts))):
            issue(j)
        for i, start in enumerate(starts):
            k = i % count
            length = min(self._chunk, dst.size - start)
            self._wait(k)
            np.copyto(dst[start:start + length], self._buffers[k][:length], casting="no")
            if i + count < len(starts):
                issue(i + count)
