"""Whether bytes of a memory map are in the page cache (``mincore``), so a tier can read
them on the event loop without a thread hop: the read then costs a memcpy, never a disk
wait.

The answer can go stale right after it is given (the kernel may evict a page a moment
later); a read that trusts it then takes one page fault on the loop. Callers use it only
for pages that were just found resident and are copied at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

__all__ = ["is_resident", "mincore_available"]

_PAGE = mmap.PAGESIZE


def _load_mincore() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.mincore
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_mincore = _load_mincore()


def mincore_available() -> bool:
    """Whether :func:`is_resident` can answer ``True`` on this platform."""
    return _mincore is not None


def is_resident(*buffers: memoryview | bytes) -> bool:
    """Whether every page under ``buffers`` (views into a memory map) is resident.
    ``False`` when it cannot tell (no ``mincore``, or it failed)."""
    if _mincore is None:
        return False
    for buf in buffers:
        if not len(buf):
            continue
        addr = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
        start = addr - addr % _PAGE
        length = addr + len(buf) - start
        pages = -(-length // _PAGE)
        vec = ctypes.create_string_buffer(pages)
        if _mincore(start, length, vec) != 0:
            return False
        # One byte per page: 1 when resident (Linux sets no other bit).
        if vec.raw.count(1) != pages:
            return False
    return True
