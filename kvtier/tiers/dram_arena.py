"""The DRAM tier's arena: its capacity mapped once, carved into slots by size class.

Why: a put of a new key into fresh heap memory pays one first-touch page fault per 4 KiB
(256 per MiB), which makes filling a cache about 3x slower than copying into warm memory.
The arena maps the tier's capacity up front (pre-faulted, by default in a background thread;
optionally on transparent huge pages), so puts copy into memory that is already mapped, and
it is one region a device backend can register once as pinned memory (one DMA per HBM <->
DRAM copy, no staging buffer).

Background prefault: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) over the arena in
chunks, from a daemon thread (a ctypes call releases the GIL). It maps pages writable
without touching their bytes, so it is safe while puts already copy into slots. It covers
at most half the memory available at open (the host's ``MemAvailable`` or, in a container,
what its memory cgroup still allows: :mod:`kvtier.tiers.host_memory`), so a capacity larger
than what is free neither pushes the host into swap nor gets a container OOM-killed; it
stops at close.

It walks upwards from where slots are carved, one huge page per call, so the next fresh
slots are the populated ones, and it never faults a page a put already carved. It stands
aside while puts carve fresh slots (until none has for ``PREFAULT_PAUSE``): they take the
populated slots first, and a put past what the thread did faults its own pages, through
its copy, one fault per huge page (on 4 KiB pages in one ``madvise`` over its slot first,
rather than 256 faults per MiB). Why not zero ahead of the puts on another core: on the
2-core benchmark box that made a fill right after open slower than no prefault at all,
even with the thread staying ahead of nearly every put (the two share the CPUs and the
memory bandwidth, and a copy into pages zeroed earlier reads them back from memory, while
a copy that faults a huge page in finds its zeroed lines in the CPU cache;
``docs/performance.md``, "Filling right after open"). So a fill runs as fast as with no
prefault, faster by the slots populated before it, and puts after an idle moment copy into
populated pages. A put that lands in the chunk in flight races the thread over at most
that one huge page.

Close: :meth:`HostArena.close` unmaps the arena at once when no block of it is referenced
any more (else when the last reference goes), so a closed tier's memory does not wait for
the cycle collector.

Slots: a block of ``n`` bytes takes a slot of its size class (``n`` rounded up to 64 bytes);
freed slots go back to their class's free list (LIFO, so an overwrite copies into the slot
it just released, still in the CPU cache); new slots are carved from the unused end. KV
blocks of one model are all one size, so classes do not fragment in practice; a put that
finds no slot (the arena holds other classes, or slots still held by readers) gets heap
memory instead, counted in ``overflow``.

Reuse rule: each slot is handed out as its own ``uint8`` array (numpy views of it, and
views of views, all keep that array alive), and the slot returns to the free list only
when that array is garbage (a weak reference's callback). So a reader's zero-copy view,
a lower tier or a queue holding a block keeps its slot out of circulation, and held bytes
never change. The callback may run on any thread (whoever drops the last view); it only
appends to a deque that the tier's loop drains.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import mmap
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.tiers.host_memory import available_memory

__all__ = ["HostArena", "fault_in", "populate", "slot_bytes"]

_ALIGN = 64  # a cache line: copies into a slot never share a line with a neighbour
_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value (5.14+)
#: Bytes faulted in per madvise call by the background prefault (one GIL-free call each):
#: one huge page, so a put that lands in the chunk in flight races it over at most one
#: page, and a daemon's request handling waits little for the mmap lock each call holds
#: (a malloc that maps memory takes it too).
PREFAULT_CHUNK = _HUGE_PAGE
#: Seconds the background prefault stands aside after a put carved a fresh slot (module
#: notes): longer than the gaps inside a burst of puts, short against an idle period.
PREFAULT_PAUSE = 0.05
#: Arenas up to this size are faulted in at construction even in background mode: it takes
#: about a millisecond, less than starting a thread.
PREFAULT_INLINE_MAX = 4 << 20
Prefault = bool | Literal["background"]


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def _populate(ref: weakref.ref[HostArena], limit: int, stop: threading.Event) -> None:
    """Fault the arena in up to ``limit``, chunk by chunk, standing aside while puts carve
    fresh slots, until done, stopped, refused, or the arena is gone."""
    while True:
        arena = ref()
        if arena is None:
            return
        try:
            pause = arena._populate_chunk(limit)
        except BaseException:
            arena._prefault_done = True
            raise
        if pause is None:
            arena._prefault_done = True
            return
        del arena  # not held between chunks, nor while standing aside
        if pause > 0:
            stop.wait(pause)  # a close wakes it at once


def fault_in(buffer: npt.NDArray[np.uint8]) -> None:
    """Fault every page of ``buffer`` in now, so later writes into it pay no page fault.

    ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it (no GIL held, contents kept);
    else a write of one byte per page, which zeroes those bytes. Blocks the calling thread
    for about ``buffer.nbytes`` / (a few GB/s): call it from a worker thread.
    """
    base = int(buffer.__array_interface__["data"][0])
    start = (base + _PAGE - 1) // _PAGE * _PAGE  # madvise takes page-aligned addresses
    if _MADVISE is not None and start < base + buffer.nbytes and \
            _MADVISE(start, base + buffer.nbytes - start, _MADV_POPULATE_WRITE) == 0:
        if start > base:
            buffer[0] = buffer[0]  # the partial page before the first aligned one
        return
    buffer[::_PAGE] = 0


def populate(buffer: npt.NDArray[np.uint8]) -> bool:
    """Map every page of ``buffer`` writable now without touching its bytes
    (``madvise(MADV_POPULATE_WRITE)``); ``False`` where the kernel cannot (nothing is
    written then, unlike :func:`fault_in`), so it is safe on memory other processes use (a
    shared arena an engine maps). Blocks the calling thread (no GIL held)."""
    base = int(buffer.__array_interface__["data"][0])
    start = (base + _PAGE - 1) // _PAGE * _PAGE
    end = (base + buffer.nbytes) // _PAGE * _PAGE
    return _MADVISE is not None and (end <= start or
                                     _MADVISE(start, end - start, _MADV_POPULATE_WRITE) == 0)


def slot_bytes(nbytes: int) -> int:
    """The size class (slot size) of a block of ``nbytes`` bytes."""
    return max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)


def _released(freed: collections.deque[tuple[int, int]], size: int, offset: int,
              _ref: object) -> None:
    freed.append((size, offset))  # deque.append is atomic: safe from any thread


class HostArena:
    """``nbytes`` of anonymous memory mapped once, handing out slots by size class.

    Parameters
    ----------
    nbytes
        Bytes to map (rounded up to a page).
    prefault
        ``True``: fault every page in now (``MAP_POPULATE``, or a write of one byte per page
        after ``madvise`` when ``hugepages``), so no put pays a page fault; costs about
        ``nbytes`` / (a few GB/s) at construction and makes the memory resident.
        ``"background"``: the same in a daemon thread, bounded to half the available memory
        (see the module notes); :meth:`stats` reports its progress. ``False``: pages fault
        in on first write.
    hugepages
        ``madvise(MADV_HUGEPAGE)``: transparent huge pages (one fault and one TLB entry per
        2 MiB) where the kernel allows them (``/sys/kernel/mm/transparent_hugepage``).
    backing
        Carve slots from this mapping (at least ``nbytes`` long) instead of mapping
        anonymous memory: the host daemon's shared arena file (:mod:`kvtier.shm.files`),
        which engine processes map too. :meth:`offset_of` then locates a block in it.

    Concurrency: :meth:`allocate` may be called from any thread (a lock orders it); slots
    are released from any thread.
    """

    def __init__(self, nbytes: int, *, prefault: Prefault = False,
                 hugepages: bool = False, backing: mmap.mmap | None = None) -> None:
        if nbytes <= 0:
            raise ConfigError(f"capacity: an arena needs a positive size, got {nbytes}")
        #: Bytes slots are carved from (``nbytes`` rounded up to a page).
        self.nbytes = (nbytes + _PAGE - 1) // _PAGE * _PAGE
        # Mapped in whole huge pages when asked, so the last slots can sit on one too.
        mapped = (self.nbytes + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE if hugepages \
            else self.nbytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault is True and not hugepages:
            flags |= mmap.MAP_POPULATE
        elif prefault is not True:
            flags |= getattr(mmap, "MAP_NORESERVE", 0)
        # A backing mapping belongs to its file (the host daemon's): close leaves it alone.
        self._owns_map = backing is None
        if backing is not None:
            if len(backing) < self.nbytes:
                raise ConfigError(f"backing: {len(backing)} bytes, the arena needs "
                                  f"{self.nbytes}")
            mapping = backing
        else:
            try:
                mapping = mmap.mmap(-1, mapped, flags=flags)
            except OSError as exc:
                raise ConfigError(f"capacity: cannot map a {self.nbytes}-byte arena: "
                                  f"{exc}") from exc
        self._map: mmap.mmap | None = mapping
        self.hugepages = False
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
                self.hugepages = True
            except OSError:  # THP disabled in this kernel: plain pages, still correct
                pass
        #: The whole arena as one writable ``uint8`` array (what a backend pins).
        self.buffer: npt.NDArray[np.uint8] = np.frombuffer(mapping, np.uint8, self.nbytes)
        self._address = int(self.buffer.__array_interface__["data"][0])
        if prefault is True and (hugepages or backing is not None):
            self.buffer[::_PAGE] = 0  # first touch after madvise, so faults map huge pages
        self.prefault_mode = "open" if prefault is True else \
            "background" if prefault == "background" else "off"
        #: Bytes faulted in so far (all of them once a prefault at construction returns).
        self.prefaulted_bytes = self.nbytes if prefault is True else 0
        self.prefault_error: str | None = None
        self._prefault_done = prefault != "background"
        self._stop_prefault = threading.Event()
        self._top = 0  # slots are carved from [_top, nbytes)
        self._free: dict[int, list[int]] = {}
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._refs: dict[int, weakref.ref[npt.NDArray[np.uint8]]] = {}
        self.free_bytes = 0
        self.reused = 0
        self.overflow = 0
        self._unregister: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._prefault_thread: threading.Thread | None = None
        # The background prefault has faulted in (or is faulting in) [_top, _ahead) where
        # _ahead > _top, and stands aside until _carved_at + PREFAULT_PAUSE (module notes).
        self._ahead = 0
        self._carved_at = float("-inf")
        self._closed = False
        if prefault == "background":
            self._start_prefault()

    def _start_prefault(self) -> None:
        memory = available_memory()
        limit = self.nbytes if memory is None else min(self.nbytes, memory // 2 // _PAGE * _PAGE)
        if limit <= PREFAULT_INLINE_MAX:
            _populate(weakref.ref(self), limit, self._stop_prefault)
            return
        # The thread holds the arena only while one chunk is faulted in: an arena dropped
        # without a close (its tier garbage) is freed, and the prefault stops.
        self._prefault_thread = threading.Thread(
            target=_populate, args=(weakref.ref(self), limit, self._stop_prefault),
            name="kvtier-arena-prefault", daemon=True)
        self._prefault_thread.start()

    def _populate_chunk(self, limit: int) -> float | None:
        """Fault in the next chunk above the carve point, unless puts are carving fresh
        slots (module notes): seconds to wait before the next call (``0.0`` after a
        chunk), ``None`` when done, stopped or refused."""
        if self._stop_prefault.is_set() or self._closed:
            return None
        if _MADVISE is None:
            self.prefault_error = "no libc madvise"
            return None
        with self._lock:
            # Never below the carve point: those pages are the puts' (faulted by their
            # copies), and the next fresh slots start there.
            start = max(self._ahead, -(-self._top // _PAGE) * _PAGE)
            if start >= limit:
                return None
            quiet = time.monotonic() - self._carved_at
            if quiet < PREFAULT_PAUSE:
                return PREFAULT_PAUSE - quiet
            end = min(limit, start + PREFAULT_CHUNK)
            self._ahead = end  # a put into this chunk leaves its pages to the thread
        base = self.buffer.__array_interface__["data"][0]
        if _MADVISE(base + start, end - start, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            self.prefault_error = "MADV_POPULATE_WRITE unsupported (Linux < 5.14)" \
                if err == errno.EINVAL else f"madvise: {errno.errorcode.get(err, err)}"
            return None
        with self._lock:
            self.prefaulted_bytes += end - start
        return 0.0

    def stop_prefault(self) -> None:
        """Stop a background prefault after its current chunk (at the tier's close)."""
        self._stop_prefault.set()

    def close(self) -> None:
        """Stop the prefault (waiting for its chunk in flight), undo :meth:`register`, and
        unmap the arena now if no slot of it is referenced any more; else the mapping goes
        when the last reference to a slot does (readers' views stay valid). Blocks for at
        most one prefault chunk: call it from a worker thread. Calling it again does
        nothing."""
        if self._closed:
            return
        self.stop_prefault()
        thread = self._prefault_thread
        if thread is not None:
            thread.join()
        self.unregister()
        with self._lock:
            self._closed = True
            self._refs.clear()
        self.buffer = np.empty(0, np.uint8)  # releases its export of the mapping
        mapping, self._map = self._map, None
        if mapping is not None and self._owns_map:
            with contextlib.suppress(BufferError):  # a slot still referenced: unmapped
                mapping.close()                       # when its last view goes

    def allocate(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """A writable ``uint8`` array of ``nbytes`` bytes in a slot of the arena, or ``None``
        when no slot of its class is free and the unused end is too short (the caller
        falls back to the heap). The slot is free again once the array is garbage."""
        size = slot_bytes(nbytes)
        own = False  # populate a fresh slot of 4 KiB pages here, in one call
        with self._lock:
            if self._closed or self._map is None:
                return None
            mapping = self._map
            self._drain()
            free = self._free.get(size)
            if free:
                offset = free.pop()
                self.free_bytes -= size
                self.reused += 1
            elif self._top + size <= self.nbytes:
                offset = self._top
                self._top += size
                self._carved_at = time.monotonic()  # the prefault stands aside (module notes)
                own = offset + size > self._ahead and not self.hugepages and \
                    self.prefault_mode == "background"
            else:
                self.overflow += 1
                return None
        # Its own buffer export, not a slice of ``buffer``: numpy collapses a view's base to
        # the first array whose base is not an array, so every view of this slot (and of
        # the block typed over it) keeps exactly this array alive.
        raw = np.frombuffer(mapping, np.uint8, nbytes, offset)
        if own:
            populate(raw)  # no write: a shared arena's pages may be an engine's too
        self._refs[offset] = weakref.ref(raw, functools.partial(_released, self._freed,
                                                                size, offset))
        return raw

    def offset_of(self, block: npt.NDArray[Any]) -> int | None:
        """Where ``block``'s bytes start in the arena, or ``None`` if they are not all in
        it (a heap block: an overflow, or one a lower tier returned)."""
        start = int(block.__array_interface__["data"][0]) - self._address
        if start >= 0 and start + block.nbytes <= self.nbytes:
            return start
        return None

    def used_bytes(self) -> int:
        """Bytes of slots handed out and not yet released (blocks, and whatever a reader
        or a lease still holds of dropped ones)."""
        with self._lock:
            self._drain()
            return self._top - self.free_bytes

    def _drain(self) -> None:
        freed = self._freed
        while freed:
            size, offset = freed.popleft()
            self._free.setdefault(size, []).append(offset)
            self.free_bytes += size

    def owns(self, raw: object) -> bool:
        """Whether ``raw`` (a block's base) is a slot of this arena."""
        base = getattr(raw, "base", None)
        return isinstance(base, memoryview) and self._map is not None and \
            base.obj is self._map

    def stats(self) -> dict[str, Any]:
        """``arena_bytes``, ``arena_free_bytes`` (released slots), ``arena_unused_bytes``
        (never carved), ``arena_reused`` (allocations from a released slot),
        ``arena_overflow`` (puts that found no slot), ``hugepages``, ``pinned``
        (registered with a device backend), and the prefault's: ``prefault`` (``"off"``,
        ``"open"`` or ``"background"``), ``prefaulted_bytes``, ``prefaulted`` (finished),
        ``prefault_error`` (why it stopped early, else ``None``)."""
        with self._lock:
            self._drain()
        return {"arena_bytes": self.nbytes, "arena_free_bytes": self.free_bytes,
                "arena_unused_bytes": self.nbytes - self._top, "arena_reused": self.reused,
                "arena_overflow": self.overflow, "hugepages": self.hugepages,
                "pinned": self._unregister is not None, "prefault": self.prefault_mode,
                "prefaulted_bytes": self.prefaulted_bytes,
                "prefaulted": self._prefault_done and self.prefault_mode != "off",
                "prefault_error": self.prefault_error}

    def register(self, backend: object) -> None:
        """Register the whole arena with ``backend`` as pinned (page-locked) host memory,
        once; later calls do nothing. ``backend`` must have ``register_host(array)``
        returning the callable that unregisters it (the torch and cupy backends call
        ``cudaHostRegister``; the numpy backend only checks the buffer).

        Raises
        ------
        ConfigError
            If the backend cannot register host memory.
        """
        if self._unregister is not None:
            return
        register = getattr(backend, "register_host", None)
        if not callable(register):
            raise ConfigError(f"backend: {backend!r} cannot register host memory "
                              "(no register_host)")
        self._unregister = register(self.buffer)

    def unregister(self) -> None:
        """Undo :meth:`register` (at the tier's close). The mapping itself stays until the
        last view of it is garbage, so readers' views stay valid."""
        unregister, self._unregister = self._unregister, None
        if unregister is not None:
            unregister()
