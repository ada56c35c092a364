"""``hbm://``: device memory as the top tier, a pool of fixed-size slots.

Inference engines keep their paged KV cache as one device tensor of ``num_slots`` blocks of
``block_bytes`` each; this tier works the same way, either over a pool it allocates
(``hbm://?capacity=8GiB&block_bytes=2MiB``) or over the engine's own buffer
(:meth:`HBMTier.attach`). One block occupies one slot whatever its size (up to
``block_bytes``); the tier remembers each block's dtype and shape. Bytes move through a
:class:`~kvtier.backends.DeviceBackend` (numpy, torch, cupy, or the engine's own).

Slots the engine uses are never written: slots it allocated itself are declared with
:meth:`HBMTier.reserve_slots` (and given back with :meth:`HBMTier.release_slots`), and blocks
kvtier placed that the engine reads in place are protected with :meth:`~Tier.pin`. A put
that finds no free slot evicts by the tier's policy (demoting the victim through the eviction
callback first, see :mod:`kvtier.tiers.budget`) or, when every slot is reserved or pinned,
raises :class:`~kvtier.errors.TierFullError`.

Device copies never block the event loop: with a device backend (CUDA through torch or
CuPy, or a third-party backend) each copy and the ``synchronize()`` that waits for it run in a
worker thread; host-memory backends (numpy, torch on CPU) copy synchronously and inline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import numpy as np

from kvtier.backends import DeviceBackend, backend_for, get_backend
from kvtier.errors import BlockTooLargeError, ConfigError, TierFullError
from kvtier.policy import Clock
from kvtier.tiers.base import Block, check_output_spec, run_to_end
from kvtier.tiers.budget import BudgetedTier, make_policy, parse_policy
from kvtier.tiers.eviction_state import Leaving
from kvtier.urls import merge_options, parse_size, parse_tier_url

__all__ = ["HBMTier"]

T = TypeVar("T")


def _copies_are_synchronous(backend: DeviceBackend) -> bool:
    """Whether ``backend`` copies host memory synchronously (numpy, torch on CPU), so a copy
    may run inline on the loop and there is nothing to synchronize."""
    return backend.name == "numpy" or (backend.name == "torch"
                                       and getattr(backend, "is_cuda", True) is False)


@dataclass(frozen=True, slots=True)
class _Entry:
    slot: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    nbytes: int


class HBMTier(BudgetedTier):
    """Device-memory tier over a slot pool.

    Parameters
    ----------
    capacity
        Pool size in bytes (own pool); rounded down to whole slots.
    block_bytes
        Slot size in bytes: the largest block the tier holds. Required for an own pool; in
        attach mode it defaults to ``buffer.nbytes // buffer.shape[0]``.
    backend
        Backend name (``"torch"``, ``"numpy"``, ``"cupy"``) or a :class:`DeviceBackend`
        object. Own pool default ``"torch"``; attach mode infers it from ``buffer``.
    device
        Device string for the backend (``"cuda:0"``); ``None`` picks the backend's default.
    buffer
        An engine-owned buffer to attach to instead of allocating (see :meth:`attach`).
    policy
        Eviction policy: ``"lru"`` (default), ``"s3fifo"`` or ``"arc"``.
    clock
        Time source of the recency policy.
    name
        Label in stats.

    Examples
    --------
    URL form: ``hbm://?capacity=8GiB&block_bytes=2MiB&backend=torch&device=cuda:0``.
    """

    scheme = "hbm"

    def __init__(self, capacity: int | None = None, *, block_bytes: int | None = None,
                 backend: str | DeviceBackend | None = None, device: str | None = None,
                 buffer: object | None = None, policy: str = "lru",
                 clock: Clock = time.monotonic, name: str | None = None) -> None:
        super().__init__(name=name)
        if block_bytes is not None and (type(block_bytes) is not int or block_bytes < 1):
            raise ConfigError(f"block_bytes: expected an int >= 1, got {block_bytes!r}")
        if buffer is None:
            if capacity is None or type(capacity) is not int or capacity < 0:
                raise ConfigError(f"capacity: an hbm pool needs a byte size, got {capacity!r}")
            if block_bytes is None:
                raise ConfigError("block_bytes: required for an hbm pool (the size of one KV "
                                  "block, e.g. block_bytes=2MiB)")
            num_slots = capacity // block_bytes
            if num_slots < 1:
                raise ConfigError(f"capacity: {capacity} bytes hold no slot of {block_bytes}")
            self._backend = get_backend("torch" if backend is None else backend, device)
            self._buffer: Any = self._backend.allocate(num_slots * block_bytes)
        else:
            if capacity is not None:
                raise ConfigError("capacity: attach mode takes its size from buffer")
            self._backend = self._attach_backend(buffer, backend, device)
            try:
                self._buffer = self._backend.from_dlpack(buffer)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
            total = int(self._buffer.shape[0])
            if block_bytes is None:
                shape: tuple[int, ...] = tuple(getattr(buffer, "shape", ()))
                if len(shape) < 2 or int(shape[0]) < 1:
                    raise ConfigError("block_bytes: required unless buffer is shaped "
                                      "[num_slots, ...]")
                block_bytes = total // int(shape[0])
            if total % block_bytes or total == 0:
                raise ConfigError(f"block_bytes: buffer of {total} bytes is not a whole number "
                                  f"of {block_bytes}-byte slots")
            num_slots = total // block_bytes
        self.attached = buffer is not None
        self._slot_bytes = block_bytes
        self._num_slots = num_slots
        # Insertion-ordered set: the lowest slots are handed out first.
        self._free: dict[int, None] = dict.fromkeys(range(num_slots))
        self._reserved: set[int] = set()
        self._entries: dict[bytes, _Entry] = {}
        self._owner: dict[int, bytes] = {}
        # Eviction order and pins over keys; every block is charged a whole slot.
        self._policy = make_policy(policy, num_slots * block_bytes, clock)
        self._inline_copies = _copies_are_synchronous(self._backend)

    @staticmethod
    def _attach_backend(buffer: object, backend: str | DeviceBackend | None,
                        device: str | None) -> DeviceBackend:
        try:
            native = backend_for(buffer)
        except TypeError:  # a foreign DLPack object: the named backend imports it
            native = None
        if native is not None and device is None and backend in (None, native.name):
            return native  # the buffer's own device (cuda:1 stays cuda:1)
        if backend is None:
            raise ConfigError(f"backend: cannot infer one for {type(buffer).__name__}; pass "
                              f"backend=")
        return get_backend(backend, device)

    @classmethod
    def attach(cls, buffer: object, *, block_bytes: int | None = None,
               backend: str | DeviceBackend | None = None, policy: str = "lru",
               clock: Clock = time.monotonic, name: str | None = None) -> Self:
        """Adapt an engine-owned paged KV buffer: ``[num_slots, ...]`` C-contiguous memory.

        kvtier writes blocks only into slots that are neither reserved by the engine
        (:meth:`reserve_slots`) nor hold a pinned block. The buffer is shared, not copied.

        Parameters
        ----------
        buffer
            numpy array, torch tensor, CuPy array or DLPack object.
        block_bytes
            Slot size; default ``nbytes // buffer.shape[0]``.
        backend
            Backend name or object; default inferred from the buffer's type.
        """
        return cls(block_bytes=block_bytes, backend=backend, buffer=buffer, policy=policy,
                   clock=clock, name=name)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``hbm://?capacity=SIZE&block_bytes=SIZE[&backend=torch][&device=cuda:0]
        [&policy=lru|s3fifo|arc][&name=]``."""
        parsed = parse_tier_url(url)
        if parsed.netloc or parsed.path not in ("", "/"):
            raise ConfigError(f"url: hbm:// takes no host or path, got {url!r}")
        opts = merge_options(parsed, options,
                             {"capacity", "block_bytes", "backend", "device", "name", "clock",
                              "policy"})
        if "capacity" not in opts:
            raise ConfigError(f"url: hbm:// needs capacity= (e.g. capacity=8GiB), got {url!r}")
        if "block_bytes" not in opts:
            raise ConfigError(f"url: hbm:// needs block_bytes= (one KV block), got {url!r}")
        device = opts.get("device")
        return cls(
            capacity=parse_size(opts["capacity"]),  # type: ignore[arg-type]
            block_bytes=parse_size(opts["block_bytes"], "block_bytes"),  # type: ignore[arg-type]
            backend=opts.get("backend", "torch"),  # type: ignore[arg-type]
            device=None if device in (None, "") else str(device),
            policy=parse_policy(opts.get("policy")),
            name=str(opts["name"]) if "name" in opts else None,
            **({"clock": opts["clock"]} if "clock" in opts else {}),  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------- properties
    @property
    def capacity(self) -> int:
        return self._num_slots * self._slot_bytes

    @property
    def block_bytes(self) -> int:
        """Slot size in bytes."""
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        """Number of slots in the buffer."""
        return self._num_slots

    @property
    def free_slots(self) -> int:
        """Slots neither holding a block nor reserved by the engine."""
        return len(self._free)

    @property
    def reserved_slots(self) -> frozenset[int]:
        """Slots the engine reserved with :meth:`reserve_slots`."""
        return frozenset(self._reserved)

    @property
    def backend(self) -> DeviceBackend:
        """The device backend that moves this tier's bytes."""
        return self._backend

    @property
    def buffer(self) -> Any:
        """The flat ``uint8`` device buffer (shares memory with an attached engine buffer)."""
        return self._buffer

    def __len__(self) -> int:
        return len(self._entries)

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key``, or ``None``; does not refresh recency."""
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    # ---------------------------------------------------------------- copies
    async def _device(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a copy (and the wait for it) inline for host backends, else off the loop."""
        if self._inline_copies:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def _read_sync(self, entry: _Entry) -> Block:
        host = self._backend.empty_host(entry.nbytes)
        self._backend.to_host(self._buffer, entry.slot * self._slot_bytes, host)
        if not self._inline_copies:
            self._backend.synchronize()
        return host.view(entry.dtype).reshape(entry.shape)

    def _write_sync(self, slot: int, block: Block) -> None:
        self._backend.to_device(block.reshape(-1).view(np.uint8), self._buffer,
                                slot * self._slot_bytes)
        if not self._inline_copies:
            self._backend.synchronize()

    def _get_into_sync(self, entry: _Entry, target: Any) -> None:
        offset = entry.slot * self._slot_bytes
        if isinstance(target, np.ndarray):
            self._backend.to_host(self._buffer, offset, target.reshape(-1).view(np.uint8))
        elif (target.backend.name, target.backend.device) == \
                (self._backend.name, self._backend.device):
            self._backend.copy(self._buffer, offset, target.flat, 0, entry.nbytes)
        else:
            # Across backends (a numpy pool into a torch tensor, say): through host memory.
            target.write(self._read_sync(entry))
        if not self._inline_copies:
            self._backend.synchronize()

    # ------------------------------------------------------------- slot state
    def _drop(self, key: bytes) -> _Entry | None:
        entry = self._entries.pop(key, None)
        self._policy.remove(key)
        if entry is not None:
            del self._owner[entry.slot]
            self._free[entry.slot] = None
        return entry

    # ------------------------------------------------- eviction template hooks
    def _unavailable(self) -> int:
        return len(self._reserved) * self._slot_bytes

    async def _read_leaving(self, keys: list[bytes]) -> list[Block | None]:
        blocks: list[Block | None] = []
        for key in keys:
            entry = self._entries.get(key)
            blocks.append(None if entry is None else await self._device(self._read_sync, entry))
        return blocks

    def _dropped(self, entry: Leaving) -> None:
        self._drop(entry.key)

    async def _drop_stored(self, keys: list[bytes]) -> None:
        for key in keys:
            self._drop(key)

    async def _commit(self, items: Sequence[tuple[bytes, Block]],
                      dropped: list[bytes]) -> None:
        for key in dropped:
            self._drop(key)
        for key, block in items:
            old = self._entries.get(key)
            # A key is a content digest, so rewriting its own slot in place is safe.
            if old is not None:
                slot = old.slot
            elif self._free:
                slot = next(iter(self._free))
                del self._free[slot]
            else:  # the engine reserved the slot this put had room for
                raise TierFullError(f"tier {self.name!r}: no free slot (of {self._num_slots}: "
                                    f"{len(self._reserved)} reserved by the engine)")
            try:
                await self._device(self._write_sync, slot, block)
            except BaseException:
                if old is not None:
                    self._drop(key)
                else:
                    self._free[slot] = None
                raise
            self._entries[key] = _Entry(slot, block.dtype, tuple(block.shape), block.nbytes)
            self._owner[slot] = key

    # --------------------------------------------------------------- contract
    async def _get(self, key: bytes) -> Block | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._policy.touch(key)
        return await self._device(self._read_sync, entry)

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return [await self._get(k) for k in keys]

    async def _get_into(self, key: bytes, out: Block) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        target = check_output_spec(entry.dtype, entry.shape, out)
        if self._inline_copies:
            self._get_into_sync(entry, target)
        elif isinstance(target, np.ndarray):
            # The thread copies into host memory of the tier's own; the copy into ``out``
            # happens here, so a caller that gave up never finds ``out`` written later.
            host = await asyncio.to_thread(self._read_sync, entry)
            np.copyto(target.reshape(-1).view(np.uint8), host.reshape(-1).view(np.uint8))
        else:
            # A device copy into ``out`` cannot be taken back once queued: the call returns
            # only after it finished, even when cancelled (a copy of one block is short).
            await run_to_end(asyncio.ensure_future(
                asyncio.to_thread(self._get_into_sync, entry, target)))
        self._policy.touch(key)
        return True

    async def _contains(self, key: bytes) -> bool:
        return key in self._entries

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._entries for k in keys]

    async def _put(self, key: bytes, block: Block) -> None:
        if block.nbytes > self._slot_bytes:
            raise BlockTooLargeError(
                f"block: {block.nbytes} bytes exceed the {self._slot_bytes}-byte slot of tier "
                f"{self.name!r}")
        try:
            await self._store_evicting(((key, block),), (self._slot_bytes,))
        except TierFullError as exc:
            raise TierFullError(
                f"tier {self.name!r}: no free slot (of {self._num_slots}: "
                f"{len(self._reserved)} reserved by the engine, {len(self._entries)} "
                f"holding blocks, all of them pinned)") from exc

    async def _delete(self, key: bytes) -> bool:
        # Waits for an in-flight eviction so a deleted key is not demoted afterwards.
        if self._busy():
            await self._settled([key])
        return self._drop(key) is not None

    async def _aclose(self) -> None:
        await self._commits_done()
        for key in list(self._entries):
            self._drop(key)
        self._reserved.clear()
        self._buffer = None  # an own pool's device memory goes back to its allocator

    # ----------------------------------------------------- engine-owned slots
    def _slot_ids(self, slot_ids: Iterable[int]) -> list[int]:
        if isinstance(slot_ids, int | str | bytes) or not isinstance(slot_ids, Iterable):
            raise TypeError(f"slot_ids: expected an iterable of ints, got "
                            f"{type(slot_ids).__name__}")
        ids = list(slot_ids)
        for i, slot in enumerate(ids):
            if type(slot) is not int and not isinstance(slot, np.integer):
                raise TypeError(f"slot_ids[{i}]: expected int, got {type(slot).__name__}")
            if not 0 <= int(slot) < self._num_slots:
                raise ValueError(f"slot_ids[{i}]: {slot} out of range 0..{self._num_slots - 1}")
        return [int(s) for s in ids]

    async def acquire_slots(self, count: int) -> list[int]:
        """Pick ``count`` slots and reserve them for the engine (an engine page allocator).

        Free slots come first; then the slots of the least recently used unpinned blocks,
        each demoted through the eviction callback before its slot is handed over.

        Raises
        ------
        TierFullError
            If fewer than ``count`` slots are free or hold unpinned blocks, or no tier below
            takes a block to demote (it keeps its slot); nothing is reserved.
        """
        self._check_open()
        if type(count) is not int or count < 0:
            raise ValueError(f"count: expected an int >= 0, got {count!r}")
        unpinned = sum(1 for k in self._entries if not self._policy.is_pinned(k)
                       and not self._eviction_state.is_leaving(k))
        if count > len(self._free) + unpinned:
            raise TierFullError(
                f"count: {count} slots wanted, {len(self._free)} free and {unpinned} "
                f"holding unpinned blocks")
        while len(self._free) < count:
            if not await self._evict_more((count - len(self._free)) * self._slot_bytes):
                raise TierFullError(f"count: {count} slots wanted, {len(self._free)} free "
                                    "and the rest pinned meanwhile")
        taken = list(self._free)[:count]
        for slot in taken:
            del self._free[slot]
        self._reserved.update(taken)
        return taken

    async def reserve_slots(self, slot_ids: Iterable[int]) -> None:
        """Hand slots to the engine: kvtier will not write them until :meth:`release_slots`.

        A slot holding a kvtier block is emptied first (the block is demoted through the
        eviction callback). Reserving an already reserved slot does nothing.

        Raises
        ------
        TierFullError
            If one of the slots holds a pinned block, or a block no tier below takes; then
            nothing is reserved.
        """
        self._check_open()
        ids = self._slot_ids(slot_ids)

        def pinned_owners() -> list[tuple[int, bytes]]:
            owners = [(slot, self._owner.get(slot)) for slot in ids]
            return [(slot, key) for slot, key in owners
                    if key is not None and self._policy.is_pinned(key)]

        if pinned := pinned_owners():
            slot, key = pinned[0]
            raise TierFullError(f"slot_ids: slot {slot} holds pinned block {key.hex()}")
        while True:
            owners = [owner for slot in ids if (owner := self._owner.get(slot)) is not None]
            if not owners:
                break
            if self._busy():
                await self._settled(owners)
            await self._evict_keys([k for k in owners if k in self._entries])
            if pinned := pinned_owners():
                slot, key = pinned[0]
                raise TierFullError(f"slot_ids: slot {slot} holds block {key.hex()}, "
                                    "pinned while it was being demoted")
        for slot in ids:
            self._free.pop(slot, None)
            self._reserved.add(slot)

    def release_slots(self, slot_ids: Iterable[int]) -> None:
        """Return engine-reserved slots to kvtier's free pool.

        Raises
        ------
        ValueError
            If a slot is not reserved; then nothing is released.
        """
        self._check_open()
        ids = self._slot_ids(slot_ids)
        for i, slot in enumerate(ids):
            if slot not in self._reserved:
                raise ValueError(f"slot_ids[{i}]: slot {slot} is not reserved")
        for slot in ids:
            self._reserved.discard(slot)
            self._free[slot] = None

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backend": self._backend.name,
                "device": self._backend.device, "attached": self.attached,
                "block_bytes": self._slot_bytes, "slots": self._num_slots,
                "free_slots": len(self._free), "reserved_slots": len(self._reserved)}
