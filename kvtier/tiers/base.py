"""The tier contract: what every storage backend in a kvtier chain implements.

A tier implements four coroutines (:meth:`Tier._get`, :meth:`Tier._put`,
:meth:`Tier._delete`, :meth:`Tier._contains`) plus :attr:`Tier.capacity`,
:attr:`Tier.used` and :meth:`Tier.from_url`. The public methods validate arguments once,
here, and the batch forms have correct defaults with bounded concurrency that a tier
overrides when it can do better (one transaction, one request per peer).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, overload

import numpy as np
import numpy.typing as npt

from kvtier.codec import as_block
from kvtier.errors import ClosedError, ShapeMismatchError, TierFullError
from kvtier.keys import validate_key
from kvtier.misses import MissReason

if TYPE_CHECKING:
    from kvtier.backends import DeviceOutput

__all__ = [
    "BATCH_CONCURRENCY",
    "BatchTier", "Block", "ClearCallback", "DropCallback", "EvictionCallback", "MissCallback",
    "Tier",
    "check_output_buffer", "check_output_spec", "copy_into", "run_to_end",
]

Block = npt.NDArray[np.generic]
EvictionCallback = Callable[[bytes, Block], Awaitable[None]]
#: ``on_drop(keys)``: keys a tier dropped on its own (budget eviction), once unreadable.
DropCallback = Callable[[Sequence[bytes]], None]
#: ``on_clear()``: the tier holds nothing any more (its directory was wiped or gc-ed away by
#: another process), after ``on_drop`` named what it held.
ClearCallback = Callable[[], None]
#: ``on_miss(keys, reason, detail)``: a read found ``keys`` unusable (``corrupt``, dropped) or
#: could not ask where they live (``unavailable``), so the store can say why they missed.
MissCallback = Callable[[Sequence[bytes], MissReason, str], None]
#: Operations the default batch implementations run at once.
BATCH_CONCURRENCY = 16

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


@overload
def check_output_buffer(block: Block, out: npt.NDArray[Any],
                        name: str = "out") -> npt.NDArray[np.generic]: ...
@overload
def check_output_buffer(block: Block, out: object,
                        name: str = "out") -> npt.NDArray[np.generic] | DeviceOutput: ...
def check_output_buffer(block: Block, out: object,
                        name: str = "out") -> npt.NDArray[np.generic] | DeviceOutput:
    """Return the view of ``out`` that ``block`` is copied into, or raise without writing.

    ``out`` must be a writeable C-contiguous numpy array that either has the block's dtype
    and shape, or is ``uint8`` with exactly ``block.nbytes`` elements (a raw slot). Other
    buffers (torch tensors, CuPy arrays, ``__cuda_array_interface__`` or DLPack objects)
    follow the same rule through a device backend and come back as a
    :class:`~kvtier.backends.DeviceOutput`; see :func:`check_output_spec`.

    Raises
    ------
    TypeError
        If ``out`` is no buffer kvtier can write into.
    ShapeMismatchError
        On a dtype, shape or size mismatch, or a read-only/non-contiguous ``out``.
    """
    return check_output_spec(block.dtype, block.shape, out, name)


def check_output_spec(dtype: np.dtype[Any], shape: tuple[int, ...], out: object,
                      name: str = "out") -> npt.NDArray[np.generic] | DeviceOutput:
    """:func:`check_output_buffer` for a block known only by its ``dtype`` and ``shape``
    (a tier that holds it outside host memory checks ``out`` before copying)."""
    if not isinstance(out, np.ndarray):
        # Lazy: torch/cupy are optional and only needed for non-numpy outputs.
        from kvtier.backends import import_output

        imported = import_output(out, dtype, shape, name)
        if not isinstance(imported, np.ndarray):
            return imported
        out = imported
    if not out.flags.writeable or not out.flags.c_contiguous:
        raise ShapeMismatchError(f"{name}: must be writeable and C-contiguous")
    if out.dtype == dtype and out.shape == shape:
        return out
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if out.dtype == np.uint8 and out.size == nbytes:
        return out.reshape(-1)
    raise ShapeMismatchError(
        f"{name}: block is {dtype}{list(shape)} ({nbytes} bytes), "
        f"buffer is {out.dtype}{list(out.shape)} ({out.nbytes} bytes)")


def copy_into(block: Block, out: object, name: str = "out") -> None:
    """Copy ``block`` into ``out`` after :func:`check_output_buffer` accepted it."""
    target = check_output_buffer(block, out, name)
    if not isinstance(target, np.ndarray):
        target.write(block)
    elif target.dtype == block.dtype and target.shape == block.shape:
        np.copyto(target, block, casting="no")
    else:
        np.copyto(target, block.reshape(-1).view(np.uint8), casting="no")


async def run_to_end(future: asyncio.Future[_Result]) -> _Result:
    """Await ``future`` to its end even if the caller is cancelled meanwhile; the
    cancellation is raised after it.

    For a worker-thread call that reads the caller's memory or changes storage: no
    cancellation stops a thread, so a caller that left early would see it act after the call
    returned (read a buffer it reuses, land an older value over a newer one). Waiting costs
    at most the call's own duration.
    """
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                raise  # the work itself was cancelled (the loop is shutting down)
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result


class Tier(abc.ABC):
    """Base class of every tier.

    Subclasses set :attr:`scheme`, implement the ``_get``/``_put``/``_delete``/``_contains``
    hooks, :attr:`capacity`, :attr:`used` and :meth:`from_url`, and may override the batch
    hooks, ``_touch_chain``, ``_pin``/``_unpin``, ``_get_into`` and ``_aclose``.

    A tier with a byte budget calls :meth:`_evict` for every block it drops by its budget,
    *before* the block stops being readable, so the store can demote it, and
    :meth:`_report_dropped` once it is gone (the store's KV events say so). When
    :meth:`_evict` raises (nothing below took the block), the tier keeps the victim and the
    put that needed the room fails with :class:`~kvtier.errors.TierFullError`.

    The default batch implementations run at most :data:`BATCH_CONCURRENCY` operations at
    once.

    A call that has returned never acts later: worker threads read into memory the tier
    owns (the copy into a caller's buffer happens on the loop after the await), and a
    thread that writes is waited for (:func:`run_to_end`) or ordered before later writes
    of its keys (``docs/writing-a-tier.md``).

    Parameters
    ----------
    name
        Label used in stats and logs (defaults to the scheme).
    """

    scheme: ClassVar[str] = ""
    #: Capability: blocks survive a restart of this process (the store's close flush moves
    #: volatile tiers' blocks into the first persistent tier below them).
    persistent: ClassVar[bool] = False
    #: Capability: other processes read this tier (a pool, e.g. ``peers://``); private tiers
    #: above it are write-through into it, so a put is readable pool-wide once it returns.
    shared: ClassVar[bool] = False
    #: Operations the default batch forms run at once (a tier whose client has a fixed
    #: number of worker threads sets it to that number).
    batch_concurrency: int = BATCH_CONCURRENCY

    def __init__(self, *, name: str | None = None) -> None:
        self.name = name or self.scheme
        self.on_evict: EvictionCallback | None = None
        self.on_drop: DropCallback | None = None
        self.on_clear: ClearCallback | None = None
        self.on_miss: MissCallback | None = None
        self.evictions = 0
        self.eviction_errors = 0
        self._closed = False
        self._closing: asyncio.Future[None] | None = None

    # ----------------------------------------------------------------- contract
    @property
    @abc.abstractmethod
    def capacity(self) -> int | None:
        """Byte budget, or ``None`` when unbounded."""

    @property
    @abc.abstractmethod
    def used(self) -> int:
        """Bytes of blocks currently held."""

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """Build the tier from its URL; keyword options override URL query options."""

    @abc.abstractmethod
    async def _get(self, key: bytes) -> Block | None:
        """Return the block or ``None``; refreshes recency."""

    @abc.abstractmethod
    async def _put(self, key: bytes, block: Block) -> None:
        """Store a copy of ``block`` (the caller may reuse its buffer afterwards)."""

    @abc.abstractmethod
    async def _delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""

    @abc.abstractmethod
    async def _contains(self, key: bytes) -> bool:
        """Whether ``key`` is present; never refreshes recency and never pins."""

    # ---------------------------------------------------------- batch defaults
    async def _bounded(self, op: Callable[[_Item], Awaitable[_Result]],
                       items: Sequence[_Item]) -> list[_Result]:
        """``op(item)`` for every item, at most :attr:`batch_concurrency` at once. Each
        coroutine is created only once its slot is taken, so a cancellation leaves none
        unawaited."""
        sem = asyncio.Semaphore(self.batch_concurrency)

        async def run(item: _Item) -> _Result:
            async with sem:
                return await op(item)

        return list(await asyncio.gather(*(run(i) for i in items)))

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return await self._bounded(self._get, keys)

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        # In order, so that for a repeated key the last value wins.
        for key, block in items:
            await self._put(key, block)

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._bounded(self._contains, keys)

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._bounded(self._delete, keys)

    async def _get_into(self, key: bytes, out: Block) -> bool:
        block = await self._get(key)
        if block is None:
            return False
        copy_into(block, out)
        return True

    async def _get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Batch :meth:`_get_into`, ``outs[i]`` for ``keys[i]``. A tier with its own
        ``_get_into`` (a copy with no block in between: LMDB, HBM) runs it per key; the
        others fetch the batch with ``_get_many`` (one request to a remote tier, not one
        round trip per key) and copy each hit into its buffer, on the loop, after the
        fetch: a call cut short never writes a buffer afterwards."""
        if type(self)._get_into is not Tier._get_into:
            return [await self._get_into(key, out) for key, out in zip(keys, outs, strict=True)]
        blocks = await self._get_many(keys)
        hits: list[bool] = []
        for i, (block, out) in enumerate(zip(blocks, outs, strict=True)):
            if block is not None:
                copy_into(block, out, f"outs[{i}]")
            hits.append(block is not None)
        return hits

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        """Refresh recency from the chain's tail to its head (no-op for unbounded tiers)."""

    async def _pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` from eviction (no-op for tiers that never evict)."""

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        """Release pins taken by :meth:`_pin`."""

    async def _aclose(self) -> None:
        """Release resources; called once."""

    def resident_keys(self) -> list[bytes] | None:
        """Keys this tier holds, least recently used first, or ``None`` if it cannot list
        them cheaply (the store's close flush skips such a tier)."""
        return None

    # ------------------------------------------------------------- public API
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"tier {self.name!r} is closed")

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._closed

    async def get(self, key: bytes) -> Block | None:
        """Return the block stored under ``key``, or ``None`` on a miss."""
        self._check_open()
        return await self._get(validate_key(key))

    async def put(self, key: bytes, value: object) -> None:
        """Store ``value`` (a C-contiguous array or bytes-like) under ``key``."""
        self._check_open()
        await self._put(validate_key(key), as_block(value))

    async def delete(self, key: bytes) -> bool:
        """Remove ``key``; returns whether it was present."""
        self._check_open()
        return await self._delete(validate_key(key))

    async def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (does not refresh recency)."""
        self._check_open()
        return await self._contains(validate_key(key))

    async def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        """Batch :meth:`get`; results are in the order of ``keys``."""
        self._check_open()
        return await self._get_many(_validate_keys(keys))

    async def put_many(self, items: Iterable[tuple[bytes, object]]) -> None:
        """Batch :meth:`put` of ``(key, value)`` pairs; all are validated before any write."""
        self._check_open()
        checked = [(validate_key(k, f"items[{i}] key"), as_block(v, f"items[{i}] value"))
                   for i, (k, v) in enumerate(items)]
        await self._put_many(checked)

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Batch :meth:`contains`."""
        self._check_open()
        return await self._contains_many(_validate_keys(keys))

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Batch :meth:`delete`."""
        self._check_open()
        return await self._delete_many(_validate_keys(keys))

    async def get_into(self, key: bytes, out: Block) -> bool:
        """Copy the block into caller-owned ``out``; returns ``False`` on a miss.

        Raises
        ------
        ShapeMismatchError
            If ``out`` does not fit the block; ``out`` is then left untouched.
        """
        self._check_open()
        return await self._get_into(validate_key(key), out)

    async def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Refresh a prefix chain's recency from its tail to its head."""
        self._check_open()
        await self._touch_chain(_validate_keys(keys))

    async def pin(self, keys: Sequence[bytes]) -> None:
        """Protect ``keys`` from eviction in this tier until :meth:`unpin`."""
        self._check_open()
        await self._pin(_validate_keys(keys))

    async def unpin(self, keys: Sequence[bytes]) -> None:
        """Release one pin of each key."""
        self._check_open()
        await self._unpin(_validate_keys(keys))

    async def aclose(self) -> None:
        """Close the tier. Calling it again does nothing more: it returns once the first
        close has finished (raising what that one raised)."""
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._aclose())
        await run_to_end(self._closing)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def stats(self) -> dict[str, Any]:
        """Tier-side figures: scheme, name, capacity, used, evictions (subclasses add more)."""
        return {
            "scheme": self.scheme,
            "name": self.name,
            "capacity": self.capacity,
            "used": self.used,
            "evictions": self.evictions,
            "eviction_errors": self.eviction_errors,
        }

    # ------------------------------------------------------------ for subclasses
    async def _evict(self, key: bytes, block: Block) -> None:
        """Hand an evicted block to the demotion callback before the tier drops it.

        Raises
        ------
        TierFullError
            If the callback failed (no tier below took the block): the eviction is abandoned
            and counted in ``eviction_errors``, the tier keeps the block, and the put that
            needed the room fails. A refusing lower tier never makes a block vanish.
        """
        if self.on_evict is not None:
            try:
                await self.on_evict(key, block)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.eviction_errors += 1
                if isinstance(exc, TierFullError):
                    raise
                raise TierFullError(f"tier {self.name}: evicted block {key.hex()} kept, its "
                                    f"demotion failed: {type(exc).__name__}: {exc}") from exc
        self.evictions += 1

    def _report_dropped(self, keys: Sequence[bytes]) -> None:
        """Tell ``on_drop`` that ``keys`` left the tier on its own (not by a delete)."""
        if self.on_drop is not None:
            self.on_drop(keys)

    def _report_cleared(self) -> None:
        """Tell ``on_clear`` that the tier was emptied behind its back (a wipe, a gc of
        another process); call it after :meth:`_report_dropped` named the keys."""
        if self.on_clear is not None:
            self.on_clear()

    def _report_miss(self, keys: Sequence[bytes], reason: MissReason, detail: str) -> None:
        """Tell ``on_miss`` why reads of ``keys`` here miss although they were stored
        (``corrupt``: dropped after a failed checksum; ``unavailable``: whoever holds them
        did not answer)."""
        if self.on_miss is not None:
            self.on_miss(keys, reason, detail)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} used={self.used} capacity={self.capacity}>"


def _validate_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, bytes | str) or not isinstance(keys, Iterable):
        raise TypeError(f"keys: expected a sequence of bytes keys, got {type(keys).__name__}")
    return [validate_key(k, f"keys[{i}]") for i, k in enumerate(keys)]


class BatchTier(Tier):
    """A tier whose native calls are batches (one pipeline or one worker-thread call for many
    keys), such as the Redis and Mooncake tiers: it implements the four batch coroutines,
    and the single-key forms here are batches of one."""

    @abc.abstractmethod
    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        """The block or ``None`` per key, in order."""

    @abc.abstractmethod
    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        """Store copies of the blocks; for a repeated key the last value wins."""

    @abc.abstractmethod
    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present; never refreshes recency and never pins."""

    @abc.abstractmethod
    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove the keys; whether each was present."""

    async def _get(self, key: bytes) -> Block | None:
        return (await self._get_many([key]))[0]

    async def _put(self, key: bytes, block: Block) -> None:
        await self._put_many([(key, block)])

    async def _delete(self, key: bytes) -> bool:
        return (await self._delete_many([key]))[0]

    async def _contains(self, key: bytes) -> bool:
        return (await self._contains_many([key]))[0]
