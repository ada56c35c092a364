"""``dram://``: blocks in this process's host memory, under a byte budget with LRU eviction.

A bounded tier keeps its blocks in a :class:`~kvtier.tiers.dram_arena.HostArena` (its
capacity mapped once); an unbounded one (or ``arena=0``) in heap memory, recycling the
buffers of large dropped blocks through a spare pool.
"""

from __future__ import annotations

import asyncio
import mmap
import sys
import time
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.policy import Clock
from kvtier.shm.files import SharedArenaFile
from kvtier.tiers.base import Block
from kvtier.tiers.budget import BudgetedTier, make_policy, parse_policy
from kvtier.tiers.dram_arena import HostArena, Prefault
from kvtier.tiers.eviction_state import Leaving
from kvtier.urls import merge_options, parse_bool, parse_size, parse_tier_url

__all__ = ["DRAMTier"]

# Spare buffers a tier keeps for reuse: at most this many bytes (and an eighth of its budget).
_SPARE_MAX_BYTES = 64 << 20
# Smaller blocks come from malloc's heap, which reuses freed memory about as fast as the
# spare pool would; larger ones are fresh mmap()ed pages that fault in on first write.
_RECYCLE_MIN_BYTES = 256 << 10

_ONE_LOCAL = 0
_PAGE = mmap.PAGESIZE


def _pages(nbytes: int) -> int:
    return (nbytes + _PAGE - 1) // _PAGE * _PAGE


def _extra_refs(obj: object) -> int:
    """References to ``obj`` beyond one local variable of the calling function.

    ``sys.getrefcount`` counts the references a call itself holds, and how many that is
    differs between CPython versions, so ``_ONE_LOCAL`` is measured on this interpreter.
    """
    return sys.getrefcount(obj) - _ONE_LOCAL


def _measure_one_local() -> int:
    probe = np.empty(0)
    return _extra_refs(probe)  # while _ONE_LOCAL is 0: the raw count for one local


_ONE_LOCAL = _measure_one_local()


class _SparePool:
    """Buffers of blocks the tier dropped, by size, for the next put of that size.

    Copying into a buffer that was in use a moment ago skips the allocation and the
    first-touch page faults of fresh memory, which dominate a large put's tail latency.
    LIFO per size, so an overwrite copies into the buffer it just released (still in cache).
    """

    def __init__(self, max_bytes: int) -> None:
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self._max_bytes = max_bytes
        self.bytes = 0
        self.reused = 0

    def take(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        free = self._free.get(nbytes)
        if not free:
            return None
        self.bytes -= nbytes
        self.reused += 1
        return free.pop()

    def give(self, raw: npt.NDArray[np.uint8]) -> None:
        nbytes = raw.nbytes
        # Room for one buffer even past the cap: a small tier's overwrite reuses it at once.
        if self.bytes + nbytes <= self._max_bytes or (not self.bytes
                                                       and nbytes <= _SPARE_MAX_BYTES):
            self._free.setdefault(nbytes, []).append(raw)
            self.bytes += nbytes

    def clear(self) -> None:
        self._free.clear()
        self.bytes = 0


def _prefault_mode(value: bool | str | None) -> Prefault:
    """The ``prefault`` option as the arena takes it: ``"background"`` (default), or a
    bool (``1``/``0``, ``true``/``false``...)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "background"):
        return "background"
    if isinstance(value, bool | int | str):
        return parse_bool(value, "prefault")
    raise ConfigError(f"prefault: expected background, 1 or 0, got {value!r}")


class DRAMTier(BudgetedTier):
    """Host-memory tier.

    ``put`` copies the caller's array once (the engine may reuse its buffer); ``get`` returns
    a read-only zero-copy view of the stored copy. The buffer of a large block the tier
    drops (overwritten, evicted after its demotion returned, deleted) is reused by a later
    put only if nothing references the block or a view of it any more, so a reader's view
    never changes; ``stats()`` counts such puts as ``recycled``.

    With an arena (the default when ``capacity`` is set) every block lives in a slot of
    one mapping of ``capacity`` bytes, reused only once nothing references the block or a
    view of it (:mod:`kvtier.tiers.dram_arena`); :meth:`register_host_memory` pins that
    mapping for a device backend.

    Parameters
    ----------
    capacity
        Byte budget (``None``: unbounded).
    arena
        Keep blocks in an arena of ``capacity`` bytes mapped up front (default: when
        ``capacity`` is set). Blocks that find no slot (other size classes fill it, or
        readers still hold dropped blocks) go to the heap, counted in ``arena_overflow``.
    prefault
        Fault the arena's pages in so no put pays a page fault. ``None`` (default) or
        ``"background"``: in a background thread from construction on (``open`` does not
        wait; at most half the memory available then, the memory cgroup's limit included;
        progress in ``stats()``: ``prefaulted_bytes``, ``prefaulted``). It stands aside
        while puts carve fresh slots, so a fill right after open runs at least as fast as
        with ``False`` (:mod:`kvtier.tiers.dram_arena`). ``True``: at construction, which
        takes about capacity / a few GB/s. ``False``: pages fault in on each block's first
        put (a fill right after open then runs at about half the speed of a copy into warm
        memory: the kernel zeroes each page first; ``docs/performance.md``).
    hugepages
        Ask for transparent huge pages for the arena (``madvise(MADV_HUGEPAGE)``; default:
        on with an arena). Copies into 4 KiB pages that are not in the TLB ran at half the
        speed on the benchmark machine (``docs/performance.md``).
    policy
        Eviction policy: ``"lru"`` (default), ``"s3fifo"`` or ``"arc"``.
    clock
        Time source for the recency policy (tests inject a fake clock).
    shm
        Keep the arena in a shared-memory file under ``/dev/shm`` that engine processes on
        this host map (the host daemon, ``kvtier serve --shm NAME``; see
        ``docs/host-daemon.md``). Needs a capacity. The name is locked for the tier's life.
        A put of a read-only block that already lies in this arena (a save an engine copied
        into a slot the daemon handed out) keeps it where it is instead of copying it again.
    shm_staging
        Bytes of the shared arena beyond ``capacity`` for slots in flight: saves between
        prepare and commit, and blocks engines still copy from after their eviction
        (default: a quarter of the capacity, at least 16 MiB).
    name
        Label in stats.

    Examples
    --------
    URL form: ``dram://?capacity=8GiB&policy=lru&prefault=background&hugepages=1``.
    """

    scheme = "dram"

    _atomic_commit = True

    def __init__(self, capacity: int | None = None, *, arena: bool | None = None,
                 prefault: bool | str | None = None, hugepages: bool | None = None,
                 policy: str = "lru",
                 clock: Clock = time.monotonic, shm: str | None = None,
                 shm_staging: int | None = None, name: str | None = None) -> None:
        super().__init__(name=name)
        self._policy = make_policy(policy, capacity, clock)
        if arena is None:
            arena = capacity is not None
        mode = _prefault_mode(prefault)
        if ((prefault is not None and mode) or hugepages) and not arena:
            raise ConfigError("prefault/hugepages: need an arena (a capacity, arena=1)")
        if arena and capacity is None:
            raise ConfigError("arena: needs a capacity")
        if shm is not None and not (arena and capacity):
            raise ConfigError("shm: a shared arena needs a capacity (and arena on)")
        huge = True if hugepages is None else hugepages
        self._shm: SharedArenaFile | None = None
        if shm is not None and capacity:
            staging = max(capacity // 4, 16 << 20) if shm_staging is None else shm_staging
            self._shm = SharedArenaFile(shm, _pages(capacity + staging), flag="--shm")
            try:
                self._arena: HostArena | None = HostArena(
                    self._shm.nbytes, prefault=mode, hugepages=huge, backing=self._shm.map)
            except BaseException:
                self._shm.close()
                raise
        else:
            self._arena = (HostArena(capacity, prefault=mode, hugepages=huge)
                           if arena and capacity else None)
        # A large stored block is a read-only view of its own uint8 buffer (``block.base``),
        # so a dropped block's buffer can go to the spare pool whatever its dtype and shape.
        self._blocks: dict[bytes, Block] = {}
        self._spare = _SparePool(_SPARE_MAX_BYTES if capacity is None
                                 else min(_SPARE_MAX_BYTES, capacity // 8))

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``dram://?capacity=SIZE[&arena=1][&prefault=background|1|0][&hugepages=1]
        [&policy=lru|s3fifo|arc][&name=LABEL]``."""
        parsed = parse_tier_url(url)
        if parsed.netloc or parsed.path not in ("", "/"):
            raise ConfigError(f"url: dram:// takes no host or path, got {url!r}")
        opts = merge_options(parsed, options, {"capacity", "name", "clock", "policy", "arena",
                                               "prefault", "hugepages", "shm", "shm_staging"})
        capacity = opts.get("capacity")
        flags: dict[str, bool] = {}
        for flag in ("arena", "hugepages"):
            value = opts.get(flag)
            if value not in (None, ""):
                flags[flag] = parse_bool(value, flag)  # type: ignore[arg-type]
        return cls(
            capacity=None if capacity in (None, "") else parse_size(capacity),  # type: ignore[arg-type]
            arena=flags.get("arena"), prefault=opts.get("prefault") or None,  # type: ignore[arg-type]
            hugepages=flags.get("hugepages"), policy=parse_policy(opts.get("policy")),
            shm=str(opts["shm"]) if opts.get("shm") else None,
            shm_staging=None if opts.get("shm_staging") in (None, "") else
            parse_size(opts["shm_staging"], "shm_staging"),  # type: ignore[arg-type]
            name=str(opts["name"]) if "name" in opts else None,
            **({"clock": opts["clock"]} if "clock" in opts else {}),  # type: ignore[arg-type]
        )

    def __len__(self) -> int:
        return len(self._blocks)

    async def _get(self, key: bytes) -> Block | None:
        block = self._blocks.get(key)
        if block is not None:
            self._policy.touch(key)
            return block
        leaving = self._eviction_state.leaving_entry(key)  # being demoted: still readable
        return None if leaving is None else leaving.block

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return [await self._get(k) for k in keys]

    async def _contains(self, key: bytes) -> bool:
        return key in self._blocks or self._eviction_state.is_leaving(key)

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        state = self._eviction_state
        return [k in self._blocks or state.is_leaving(k) for k in keys]

    async def _put(self, key: bytes, block: Block) -> None:
        self._policy.check_fits(block.nbytes)
        await self._store_evicting(((key, block),), (block.nbytes,))

    async def _commit(self, items: Sequence[tuple[bytes, Block]],
                      dropped: list[bytes]) -> None:
        # Never yields: readers see the old block until the new one is in.
        for key, block in items:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._reclaim(old)  # an unread overwritten block lends its buffer to the copy
                old = None  # released first, so its arena slot (still in cache) takes the copy
            self._blocks[key] = self._copy(block)

    def _detach(self, key: bytes) -> Block | None:
        return self._blocks.pop(key, None)

    def _reattach(self, entry: Leaving) -> None:
        if entry.block is not None:
            self._blocks.setdefault(entry.key, entry.block)

    def _dropped(self, entry: Leaving) -> None:
        old, entry.block = entry.block, None
        if old is not None:
            self._reclaim(old)

    def _copy(self, block: Block) -> Block:
        """A read-only copy of ``block`` in an arena slot, else (no arena, or no slot) in
        a spare buffer of its size when it is large and there is one."""
        stored: Block
        if self._shm is not None and not block.flags.writeable and \
                self._arena is not None and self._arena.offset_of(block) is not None:
            return block  # an engine's save, already copied into a slot of the shared arena
        raw = None if self._arena is None else self._arena.allocate(block.nbytes)
        if raw is not None:
            stored = np.ndarray(block.shape, block.dtype, raw)
            np.copyto(stored, block, casting="no")
        elif block.nbytes < _RECYCLE_MIN_BYTES:
            stored = np.array(block, copy=True, order="C")
        else:
            raw = self._spare.take(block.nbytes)
            if raw is None:
                raw = np.empty(block.nbytes, np.uint8)
            stored = np.ndarray(block.shape, block.dtype, raw)
            np.copyto(stored, block, casting="no")
        # Read-only like a fresh copy would be; ``stored.base`` (the buffer) is reachable
        # only by deliberately unwrapping, as is setting a fresh copy writeable again.
        stored.flags.writeable = False
        return stored

    def _reclaim(self, old: Block) -> None:
        """Give the buffer of a block this tier just dropped to the spare pool, unless
        anything still references the block or its buffer.

        ``old`` must be held by one local variable of the caller and nothing else of the
        tier's. A reader's ``get`` result, any view of it (numpy views keep their base
        alive), a lower tier or a queue still holding it all count as references, so a
        buffer is only reused when no one can see it change.
        """
        if old.nbytes < _RECYCLE_MIN_BYTES or _extra_refs(old) != 1:  # the caller's variable
            return
        raw = old.base
        if self._arena is not None and self._arena.owns(raw):
            return  # an arena slot frees itself once its last reference is gone
        if isinstance(raw, np.ndarray) and _extra_refs(raw) == 1:  # ``old.base``
            self._spare.give(raw)

    async def _delete(self, key: bytes) -> bool:
        # Waits for an in-flight eviction so a deleted key is not demoted afterwards.
        if self._busy():
            await self._settled([key])
        self._policy.remove(key)
        old = self._blocks.pop(key, None)
        if old is None:
            return False
        self._reclaim(old)
        return True

    @property
    def shared_file(self) -> SharedArenaFile | None:
        """The shared arena's file (``None`` unless built with ``shm``)."""
        return self._shm

    @property
    def arena(self) -> HostArena | None:
        """The arena holding this tier's blocks (``None``: heap memory)."""
        return self._arena

    async def evict_ahead(self, nbytes: int) -> bool:
        """Evict about ``nbytes`` of the least recently used unpinned blocks now, ahead of
        the put they make room for: the host daemon lends a save's arena slots before its
        commit, whose put would evict as much anyway (victims are demoted to the tiers
        below as for any eviction). Returns whether anything was evicted."""
        self._check_open()
        return await self._evict_more(nbytes)

    def register_host_memory(self, backend: object) -> None:
        """Register the tier's arena once with a device ``backend`` as pinned host memory,
        so copies between device memory and stored blocks are one DMA with no staging
        buffer; undone at :meth:`aclose`. ``backend`` needs ``register_host(array)``
        (the torch and cupy backends call ``cudaHostRegister``). Calling it again does
        nothing.

        Raises
        ------
        ConfigError
            If the tier has no arena or the backend cannot register host memory.
        """
        if self._arena is None:
            raise ConfigError("register_host_memory: the tier has no arena "
                              "(give it a capacity and leave arena on)")
        self._arena.register(backend)

    async def _aclose(self) -> None:
        if self._arena is not None:
            self._arena.stop_prefault()
        self._blocks.clear()
        self._eviction_state.forget_leaving()
        self._spare.clear()
        for key in list(self._policy.lru_order()):
            self._policy.remove(key)
        if self._arena is not None:
            # Unmapped now (its blocks are dropped above), not when the cycle collector
            # frees the tier: a store and its tiers reference each other.
            await asyncio.to_thread(self._arena.close)
        if self._shm is not None:
            self._shm.close()

    def stats(self) -> dict[str, Any]:
        """Tier figures plus ``blocks``, ``pinned_bytes``, ``spare_bytes`` (buffers and
        arena slots of dropped blocks kept for reuse, not counted in ``used``),
        ``recycled`` (puts that copied into such a buffer instead of fresh memory) and,
        with an arena, its figures (:meth:`HostArena.stats`)."""
        arena = {} if self._arena is None else self._arena.stats()
        return {**super().stats(), **arena,
                "spare_bytes": self._spare.bytes + arena.get("arena_free_bytes", 0),
                "recycled": self._spare.reused + arena.get("arena_reused", 0)}
