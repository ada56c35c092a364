"""``TieredStore``: one async facade over a chain of tiers, fastest first.

The facade validates arguments and delegates to the parts it builds (see
``docs/architecture.md``):

* :class:`~kvtier.callgate.CallGate`: each call's check that the store is open and used
  from its own event loop, and the calls in flight that :meth:`TieredStore.aclose` waits
  for;
* :class:`~kvtier.tierchain.TierChain`: the tiers, their counters and guarded calls, and
  closing them;
* :class:`~kvtier.singleflight.KeyRegistry`: per-key generations, locks and shared fetches;
* :class:`~kvtier.promotion.Promotion`: the ``promote=`` policy;
* :class:`~kvtier.readpath.ReadPath`: get, batch and buffer reads, presence, promotion;
* :class:`~kvtier.placement.Placement`: put placement, pool copies, demotion, delete;
* :class:`~kvtier.writethrough.WriteThrough`: the byte-bounded write-through queue;
* :class:`~kvtier.closeflush.CloseFlush`: the warm hand-off into persistent tiers at close;
* :mod:`kvtier.stats`: the figures of :meth:`TieredStore.stats`;
* :class:`~kvtier.events.EventHub`: the KV events (:meth:`TieredStore.events`), fed by the
  tier chain;
* :mod:`kvtier.peer.locate`: :meth:`TieredStore.locate_prefix` (imported on first use).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

from kvtier.callgate import CallGate, in_flight
from kvtier.closeflush import CloseFlush
from kvtier.codec import as_block
from kvtier.deadline import Deadline
from kvtier.errors import ConfigError
from kvtier.events import EventHub, Subscription
from kvtier.explain import Explanation, explain_keys
from kvtier.keys import PrefixKeys, validate_key
from kvtier.lookuplog import open_lookup_log
from kvtier.misses import DEFAULT_MISS_RECORD_SIZE, MissLedger
from kvtier.open import open_store
from kvtier.placement import Placement
from kvtier.promotion import Promote, Promotion
from kvtier.readpath import ReadPath
from kvtier.singleflight import KeyRegistry
from kvtier.stats import StoreCounters, store_stats
from kvtier.tierchain import TierChain, check_positive_int, check_timeout, keys_list
from kvtier.tiers.base import Block, Tier
from kvtier.writethrough import WritesDone, WriteThrough

if TYPE_CHECKING:
    from kvtier.peer.locate import PrefixLocation

T = TypeVar("T")

__all__ = ["Promote", "TieredStore", "WritePolicy", "open_store"]

#: Default seconds :meth:`TieredStore.locate_prefix` waits for the pool's members.
LOCATE_DEADLINE = 0.05

WritePolicy = Literal["write_back", "write_through"]


class TieredStore:
    """A chain of tiers behind one async API (``get``/``put``/batch/prefix forms).

    Parameters
    ----------
    tiers
        Tier objects, fastest first. The store takes ownership: it sets each tier's
        ``on_evict`` (except the last tier's) to demote into the tiers below, and closes them
        in :meth:`aclose`.
    promote
        Where a hit in a lower tier is copied: ``"all"`` (every tier above it, the default),
        ``"top"`` (the top tier only) or an int ``N`` (into every tier above, once the key
        has hit ``N`` times below; counts are kept for at most ``promote_counter_size`` keys).
    write_policy
        ``"write_back"`` (lower tiers receive a block only when it is evicted above) or
        ``"write_through"`` (every put is also written to the lower tiers by background
        workers through a bounded queue; a full queue makes ``put`` wait).
    timeout
        Default deadline in seconds for read calls (``get``, ``get_many``, ``get_into``,
        ``get_many_into``, ``contains``, ``contains_many``, ``lookup_prefix``); ``None``: none.
        A tier that has not answered by the deadline counts as a miss.
    write_queue_size, write_queue_bytes
        Bounds of the write-through queue: blocks and bytes queued or being written
        (default 256 blocks, 256 MiB; a larger block is written alone).
    write_workers
        Tasks draining the write-through queue.
    promote_counter_size
        Keys whose lower-tier hits are counted for ``promote=N``.
    pool_write_through
        With a shared tier (``peers://``) in the chain, a put that lands above it is also
        written into it before ``put`` returns, so every store of the pool can read it
        (default ``True``). If that copy fails, ``put`` raises :class:`TierError` (the
        block stays in the private tier that took it).
    close_flush
        At :meth:`aclose`, copy what volatile tiers hold into the first persistent tier below
        them (``lmdb://``, ``file://``), so the next open is warm (default ``True``; a no-op
        without a persistent tier).
    close_flush_timeout
        Seconds that copy may take at most (default 30).
    node
        This node's id in KV events and :meth:`locate_prefix` (default: the ``self=`` member
        id of a ``peers://`` tier in the chain, else the host name).
    block_tokens
        Tokens per block, reported in ``BlockStored`` events (default ``None``: unknown).
    miss_record_size
        Keys each tier remembers evicting or dropping as corrupt, so that a later miss can
        say why (:meth:`explain`, ``miss_reasons`` in :meth:`stats`); the oldest is
        forgotten first (default 32768 per tier, about 200 bytes each).
    lookup_log
        ``"PATH[?max_bytes=64MiB&backups=3&instance=NAME]"``: write each
        :meth:`lookup_prefix`'s keys and result to rotating JSON lines, with the namespace
        when the keys came from :func:`~kvtier.keys.prefix_keys` (see
        :mod:`kvtier.lookuplog`; ``kvtier explain --log A --log B`` compares two
        instances'). Default ``None``: none.

    Raises
    ------
    TypeError, ValueError
        For a malformed argument (the message names it).

    Notes
    -----
    A store belongs to the event loop it is first used on (:func:`open_store`'s); a call
    from another loop raises :class:`~kvtier.errors.WrongLoopError`. Synchronous callers use
    ``kvtier.BlockingStore``. Calls may run concurrently on that loop; a cancelled call
    leaves its full effect or none.

    Examples
    --------
    >>> import numpy as np
    >>> from kvtier import DRAMTier, TieredStore
    >>> store = TieredStore([DRAMTier(capacity=1 << 30), DRAMTier(capacity=8 << 30)])
    >>> async def demo() -> None:
    ...     async with store:
    ...         await store.put(b"k" * 16, np.zeros(1024, np.uint16))
    ...         assert (await store.get(b"k" * 16)).shape == (1024,)
    >>> import asyncio; asyncio.run(demo())
    """

    def __init__(self, tiers: Sequence[Tier], *, promote: Promote = "all",
                 write_policy: WritePolicy = "write_back", timeout: float | None = None,
                 write_queue_size: int = 256, write_queue_bytes: int = 256 << 20,
                 write_workers: int = 4, promote_counter_size: int = 65536,
                 pool_write_through: bool = True, close_flush: bool = True,
                 close_flush_timeout: float = 30.0, node: str | None = None,
                 block_tokens: int | None = None,
                 miss_record_size: int = DEFAULT_MISS_RECORD_SIZE,
                 lookup_log: str | None = None) -> None:
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence) or not tiers:
            raise TypeError("tiers: expected a non-empty sequence of Tier objects")
        for i, tier in enumerate(tiers):
            if not isinstance(tier, Tier):
                raise TypeError(f"tiers[{i}]: expected a Tier, got {type(tier).__name__}")
        if len({id(t) for t in tiers}) != len(tiers):
            raise ConfigError("tiers: the same tier object appears twice")
        if write_policy not in ("write_back", "write_through"):
            raise ConfigError(f"write_policy: expected 'write_back' or 'write_through', "
                              f"got {write_policy!r}")
        for name, flag in (("pool_write_through", pool_write_through),
                           ("close_flush", close_flush)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        flush_timeout = check_timeout(close_flush_timeout, "close_flush_timeout")
        if node is not None and (not isinstance(node, str) or not node):
            raise ConfigError(f"node: expected a non-empty str, got {node!r}")
        if block_tokens is not None:
            check_positive_int(block_tokens, "block_tokens")
        # The chain is built below, before any subscription can ask for a resync.
        self._events = EventHub(node or _default_node(tiers),
                                resident=lambda: self._chain.resident())
        self._timeout = check_timeout(timeout)
        self._write_policy: WritePolicy = write_policy
        self._gate = gate = CallGate()
        misses = MissLedger(len(tiers), check_positive_int(miss_record_size, "miss_record_size"))
        self._chain = chain = TierChain(list(tiers), StoreCounters(), self._events,
                                        block_tokens, misses)
        self._keys = KeyRegistry()
        self._promotion = Promotion(promote, promote_counter_size)
        self._writes = WriteThrough(
            keys=self._keys, write=lambda i, k, b: chain.write(i, k, b, "write_through"),
            n_tiers=len(chain), max_items=check_positive_int(write_queue_size, "write_queue_size"),
            max_bytes=check_positive_int(write_queue_bytes, "write_queue_bytes"),
            workers=check_positive_int(write_workers, "write_workers"), counters=chain.counters)
        self._reads = ReadPath(chain, self._keys, self._promotion, lambda: gate.closed)
        self._placement = Placement(
            chain, self._keys, self._promotion,
            self._writes if write_policy == "write_through" else None,
            pool_write_through=pool_write_through)
        self._close_flush = CloseFlush(chain, flush_timeout or float("inf")) \
            if close_flush else None
        for i, tier in enumerate(chain.tiers[:-1]):
            tier.on_evict = self._placement.demoter(i)
        # Last: it starts a writer thread, which a constructor that raised would leak.
        self._lookup_log = open_lookup_log(lookup_log, node)

    # ------------------------------------------------------------------ properties
    @property
    def tiers(self) -> list[Tier]:
        """The tier objects, top (fastest) first."""
        return list(self._chain.tiers)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._gate.closed

    @property
    def write_policy(self) -> WritePolicy:
        """``"write_back"`` or ``"write_through"``."""
        return self._write_policy

    @property
    def node(self) -> str:
        """This node's id, as stamped on KV events and keyed in :meth:`locate_prefix`."""
        return self._events.node

    @property
    def event_hub(self) -> EventHub:
        """The store's KV event hub (what :meth:`events` subscribes to; hand it to
        ``kvtier.events_zmq.ZmqEventPublisher`` to publish on ZMQ)."""
        return self._events

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self._timeout if timeout is None else check_timeout(timeout)
        return TierChain.deadline(seconds)

    # ------------------------------------------------------------------ reads
    @in_flight
    async def get(self, key: bytes, *, timeout: float | None = None) -> Block | None:  # noqa: ASYNC109
        """Return the block stored under ``key``, or ``None`` on a miss.

        Walks the tiers top-down; a hit below the top is promoted per the ``promote`` policy.
        Concurrent gets of one key that miss the top tier share one lower-tier fetch.

        Parameters
        ----------
        key
            ``bytes`` of 1..128 bytes.
        timeout
            Deadline in seconds for the whole call (default: the store's); ``math.inf``
            disables the store default for this call.

        Returns
        -------
        numpy.ndarray or None
            The block (possibly a read-only zero-copy view) or ``None``.
        """
        self._gate.enter()
        validate_key(key)
        deadline = None if timeout is None and self._timeout is None else self._deadline(timeout)
        return await self._reads.get(key, deadline)

    @in_flight
    async def get_many(self, keys: Sequence[bytes], *, timeout: float | None = None  # noqa: ASYNC109
                       ) -> list[Block | None]:
        """Batch :meth:`get`: one batch call per tier for the keys still missing.

        Below the top tier, keys another call is already fetching are waited for instead of
        read again (single flight). Hits below the top are promoted, and every tier that
        served or received part of the chain has its recency refreshed tail-to-head (``keys``
        is taken as a prefix chain).

        Returns
        -------
        list
            Blocks or ``None``, in the order of ``keys``.
        """
        self._gate.enter()
        key_list = keys_list(keys)
        return await self._reads.get_many(key_list, self._deadline(timeout))

    @in_flight
    async def get_into(self, key: bytes, out: Any, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Copy the block into caller-owned ``out``; ``False`` on a miss.

        The top tier copies straight into ``out``; a hit below it is read through the same
        path as :meth:`get` (single flight, promotion) and copied.

        Raises
        ------
        TypeError, ShapeMismatchError
            If ``out`` does not fit the block; ``out`` is then left untouched.
        """
        self._gate.enter()
        validate_key(key)
        return await self._reads.get_into(key, out, self._deadline(timeout))

    @in_flight
    async def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                            timeout: float | None = None) -> list[bool]:  # noqa: ASYNC109
        """Batch :meth:`get_into`; ``outs[i]`` receives ``keys[i]``.

        Raises
        ------
        ValueError
            If ``keys`` and ``outs`` differ in length.
        TypeError, ShapeMismatchError
            If an ``out`` does not fit its block (earlier buffers may have been written).
        """
        self._gate.enter()
        key_list = keys_list(keys)
        if isinstance(outs, bytes | str) or not isinstance(outs, Sequence):
            raise TypeError(f"outs: expected a sequence of buffers, got {type(outs).__name__}")
        if len(outs) != len(key_list):
            raise ValueError(f"outs: expected {len(key_list)} buffers (one per key), "
                             f"got {len(outs)}")
        return await self._reads.get_many_into(key_list, list(outs), self._deadline(timeout))

    @in_flight
    async def contains(self, key: bytes, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Whether any tier holds ``key`` (refreshes no recency)."""
        self._gate.enter()
        validate_key(key)
        return (await self._reads.contains_many([key], self._deadline(timeout)))[0]

    @in_flight
    async def contains_many(self, keys: Sequence[bytes], *, timeout: float | None = None  # noqa: ASYNC109
                            ) -> list[bool]:
        """Batch :meth:`contains`: one batch call per tier for the keys not yet found."""
        self._gate.enter()
        return await self._reads.contains_many(keys_list(keys), self._deadline(timeout))

    @in_flight
    async def lookup_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """How many leading ``keys`` (a prefix chain) are present in some tier.

        One ``contains_many`` per tier for the keys still unaccounted for, up to the first
        key no tier has. The found prefix's recency is then refreshed tail-to-head in every
        tier, so eviction takes chain ends first.
        """
        self._gate.enter()
        key_list = keys_list(keys)
        hit = await self._reads.lookup_prefix(key_list, self._deadline(timeout))
        if self._lookup_log is not None:
            # The caller's PrefixKeys carries the namespace (key_list is a plain copy).
            self._lookup_log.record(keys if isinstance(keys, PrefixKeys) else key_list, hit)
        return hit

    @in_flight
    async def explain(self, keys: Sequence[bytes], *, timeout: float | None = None  # noqa: ASYNC109
                      ) -> list[Explanation]:
        """Where each key was looked for, and where it hits or why it misses.

        Every tier is asked with its presence check (nothing is read, no recency refreshed,
        nothing promoted). A key no tier holds is explained from what the tiers noted of it:
        evicted (which tier, how long ago, which policy), dropped as corrupt, a tier that did
        not answer now (down, failing, or slower than the deadline), else never stored under
        this namespace. See ``docs/troubleshooting.md``.

        Parameters
        ----------
        keys
            Keys to explain (e.g. a prompt's prefix chain).
        timeout
            Deadline in seconds for the probes (default: the store's).

        Returns
        -------
        list of kvtier.explain.Explanation
            One per key, in order; ``str()`` of one is a readable report.
        """
        self._gate.enter()
        return await explain_keys(self._chain, self._reads, keys_list(keys),
                                  self._deadline(timeout))

    # ------------------------------------------------------------------ writes
    @in_flight
    async def put(self, key: bytes, value: object, *, timeout: float | None = None  # noqa: ASYNC109
                  ) -> None:
        """Store ``value`` under ``key`` in the top tier that can hold it.

        The block goes into the first tier (top-down) whose capacity fits it; if that tier
        fails, the next one is tried. Copies above it are deleted; an older copy below stays
        shadowed and is never served again. With a shared tier below (``peers://``) the block
        is also written there before ``put`` returns (``pool_write_through``). With
        ``write_through`` the block is then queued for the tiers below (``put`` waits while
        the queue is full).

        Parameters
        ----------
        key
            ``bytes`` of 1..128 bytes.
        value
            A C-contiguous numpy array of a fixed-size dtype, or a bytes-like object.
        timeout
            Deadline in seconds for the whole call (``None``, the default, or ``math.inf``:
            none). The store's ``timeout`` bounds reads only: it is sized for reads a
            scheduler waits on, where a miss is cheap, while a write past it is lost work.

        Raises
        ------
        TypeError, ValueError
            For a bad key or value (nothing is written).
        BlockTooLargeError
            If the block exceeds every tier's capacity (nothing is written).
        TierError
            If every tier that could hold the block failed, or the pool copy failed.
        TimeoutError
            If ``timeout`` passed first (:class:`kvtier.deadline.DeadlineExceeded`). The
            block may or may not be stored, but nothing the put started acts after this is
            raised: a tier's worker-thread call still queued at the deadline is cancelled
            (never runs), one that had begun has ended (it no longer reads ``value``), and
            none lands over a later put of ``key``; the message says which.
        """
        self._gate.enter()
        seconds = check_timeout(timeout)
        validate_key(key)
        block = as_block(value)
        first = self._placement.first_fitting(block.nbytes, "value")
        await self._within(seconds, "put", self._placement.put(key, block, first))

    @in_flight
    async def put_many(self, items: Iterable[tuple[bytes, object]], *,
                       parent: bytes | None = None,
                       timeout: float | None = None) -> WritesDone:  # noqa: ASYNC109
        """Store ``(key, value)`` pairs; all are validated before anything is written.

        Blocks that fit the top tier go there in one batch call, and the chain's recency is
        refreshed tail-to-head so eviction takes the end of a prefix chain first. A repeated
        key keeps its last value.

        Parameters
        ----------
        items
            ``(key, value)`` pairs, a prefix chain in order.
        parent
            The key chained before the first item's (for KV events' ``parent``; ``None``:
            unknown or the prompt's start).
        timeout
            Deadline in seconds for the whole call, as for :meth:`put`.

        Returns
        -------
        kvtier.writethrough.WritesDone
            The completion of the write-through writes this call queued (``write_through``;
            already done with ``write_back``): ``await`` it to wait for these blocks to be
            written to the tiers below without waiting for other callers' writes, as
            :meth:`flush` would. Dropping it is fine.

        Raises
        ------
        TypeError, ValueError, BlockTooLargeError
            For a bad item (nothing is written); the message names it (``items[i]``).
        TierError
            If every tier that could hold one of the blocks failed, or the pool copy failed.
        TimeoutError
            If ``timeout`` passed first (as for :meth:`put`: some blocks may be stored,
            nothing acts later).
        """
        self._gate.enter()
        seconds = check_timeout(timeout)
        if parent is not None:
            validate_key(parent, "parent")
        if isinstance(items, bytes | str | Mapping) or not isinstance(items, Iterable):
            raise TypeError(f"items: expected an iterable of (key, value) pairs, "
                            f"got {type(items).__name__}")
        # Only a repeated key's last value is observable, and writing just that one keeps
        # the order of puts into different tiers from mattering.
        last: dict[bytes, tuple[Block, int]] = {}
        count = 0
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"items[{i}]: expected a (key, value) tuple")
            key = validate_key(item[0], f"items[{i}] key")
            block = as_block(item[1], f"items[{i}] value")
            first = self._placement.first_fitting(block.nbytes, f"items[{i}] value")
            last.pop(key, None)
            last[key] = (block, first)
            count += 1
        if not last:
            return WritesDone()
        return await self._within(seconds, "put_many",
                                  self._placement.put_many(last, count, parent))

    @in_flight
    async def flush(self) -> None:
        """Wait until every write-through write queued before this call has been attempted.

        Writes queued meanwhile are not waited for, so ``flush`` returns under a steady stream
        of puts; to wait for one batch's writes only, await what :meth:`put_many` returned.
        """
        self._gate.enter()
        await self._writes.flush()

    @in_flight
    async def delete(self, key: bytes, *, timeout: float | None = None  # noqa: ASYNC109
                     ) -> bool:
        """Remove ``key`` from every tier; returns whether any tier held it.

        Once started, a delete completes even if the caller is cancelled (the cancellation
        is raised afterwards), so no older value is ever exposed.

        Parameters
        ----------
        key
            ``bytes`` of 1..128 bytes.
        timeout
            Deadline in seconds, as for :meth:`put`. A delete is never left half done:
            at the deadline, a tier call that has not started is cancelled only while no
            tier has removed the key yet (the key then stays where it was); once one has,
            the delete finishes in every tier. Either way it then raises
            ``TimeoutError`` (:class:`kvtier.deadline.DeadlineExceeded`, saying which), and
            it never removes a later put's block.
        """
        self._gate.enter()
        seconds = check_timeout(timeout)
        validate_key(key)
        return (await self._within(seconds, "delete", self._placement.delete([key])))[0]

    @in_flight
    async def delete_many(self, keys: Sequence[bytes], *,
                          timeout: float | None = None) -> list[bool]:  # noqa: ASYNC109
        """Batch :meth:`delete`; one batch call per tier (``timeout`` as for :meth:`delete`)."""
        self._gate.enter()
        seconds = check_timeout(timeout)
        return await self._within(seconds, "delete_many",
                                  self._placement.delete(keys_list(keys)))

    @staticmethod
    async def _within(seconds: float | None, op: str, call: Awaitable[T]) -> T:
        """``call`` under a write's deadline (checked seconds; ``None``: none): at it, tier
        calls still queued are cancelled and started ones waited for
        (:mod:`kvtier.deadline`); the ``TimeoutError`` says which."""
        if seconds is None:
            return await call
        async with Deadline.after(seconds, op):
            return await call

    # ------------------------------------------------------------------ routers
    def events(self, *, buffer: int | None = None, resync: bool = True) -> Subscription:
        """Subscribe to this store's KV events (call on the store's event loop).

        It starts with ``AllBlocksCleared`` (every tier of this node) and ``BlockStored``
        for what the tiers hold now (a warm LMDB or file tier after a restart), then
        ``BlockStored`` when a tier admits blocks (puts, promotions, demotions, write-through
        and pool copies, the close flush), ``BlockRemoved`` when blocks leave a tier (budget
        eviction, delete, a copy superseded above a newer one; always after the
        ``BlockStored`` that listed them) and, when the store closes, ``BlockRemoved`` for
        what each tier held and ``AllBlocksCleared`` per tier. Every event carries the
        store's ``incarnation`` and a ``seq``; see ``docs/events.md``.

        Parameters
        ----------
        buffer
            Events this subscription buffers (default 10,000). A consumer that falls behind
            loses the oldest ones, counted in ``Subscription.dropped``; the store never waits.
        resync
            Start with the ``AllBlocksCleared`` and ``BlockStored`` of what the tiers hold
            (default); ``False``: only the events from now on.

        Returns
        -------
        kvtier.events.Subscription
            An async iterator of events (``async for batch in sub.batches()`` takes them in
            batches); ``sub.close()`` ends it, as does :meth:`aclose`.
        """
        self._gate.enter()
        return self._events.subscribe(buffer=buffer, resync=resync)

    @in_flight
    async def locate_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None  # noqa: ASYNC109
                            ) -> PrefixLocation:
        """Where the leading blocks of a prefix can be served without a network fetch.

        This node answers for its private tiers (and the pool segment it serves, if any);
        every member of each ``peers://`` tier is asked (``POST /v1/locate``), concurrently,
        one request each; the store's own leading run over all its tiers gives the
        pool-wide count. Nothing refreshes recency.

        Parameters
        ----------
        keys
            A prefix chain, in order.
        timeout
            Seconds to wait for answers (default: the store's ``timeout``, else 0.05;
            ``math.inf``: no limit, each pool member then bounded by its pool tier's
            ``timeout``). A member that has not answered by then is left out of ``nodes``.

        Returns
        -------
        kvtier.peer.locate.PrefixLocation
            ``.nodes``: ``{node id: LocalPrefix(blocks, tier, by_tier)}``; ``.pool``: leading
            blocks readable pool-wide; ``.node``: this node's id.
        """
        from kvtier.peer.locate import locate_in_pool  # aiohttp: only when locating

        self._gate.enter()
        key_list = keys_list(keys)
        # An explicit timeout is taken as given (math.inf: no limit, as for every verb).
        seconds = (self._timeout or LOCATE_DEADLINE) if timeout is None \
            else check_timeout(timeout)
        deadline = TierChain.deadline(seconds)

        async def leading() -> int:
            present = await self._reads.contains_many(key_list, deadline)
            return next((i for i, p in enumerate(present) if not p), len(present))

        return await locate_in_pool(self.node, self._chain.tiers, key_list, seconds, leading())

    def route(self, keys: Sequence[bytes], candidates: Sequence[str],
              load: Mapping[str, float] | None = None) -> str:
        """The node a router should send a request for the prompt ``keys`` to.

        Each candidate's local run is the number of leading ``keys`` it owns in this store's
        ``peers://`` tier (one of their first ``replicas`` live owners, under the pool's
        placement). The longest
        run wins among the candidates whose load stays within
        :data:`kvtier.routing.LOAD_BOUND` (1.25) times the mean; ties go to the least
        loaded. Nothing is sent over the network: the runs are predicted from the ring, not
        asked with ``POST /v1/locate`` (:meth:`locate_prefix` measures them).

        Parameters
        ----------
        keys
            The request's prompt as a prefix chain, in order.
        candidates
            Member ids of the pool (``host:port`` of each node's ``kvtier serve``) the
            request may go to; a router maps them to its engines.
        load
            Per candidate, its load now (queue depth or requests in flight; missing: 0).

        Returns
        -------
        str
            One of ``candidates``.

        Raises
        ------
        ConfigError
            If the store has no ``peers://`` tier.
        ValueError
            If ``candidates`` is empty.
        """
        from kvtier.routing import route_by_owner  # aiohttp (PeerTier): only when routing

        self._gate.enter()
        key_list = keys_list(keys)
        return route_by_owner(self._chain.tiers, key_list, candidates, load or {})

    # ------------------------------------------------------------------ pins
    async def pin(self, keys: Sequence[bytes], *, tier: int | None = None) -> None:
        """Keep ``keys`` from eviction until :meth:`unpin`.

        Parameters
        ----------
        keys
            Keys of a running session (they need not be present yet).
        tier
            Index of the one tier to pin in; ``None`` (default) pins in every tier, so a
            block stays in whichever tier holds it and is kept when promoted.

        Notes
        -----
        A tier that fails to pin is counted in its ``errors`` and logged, not raised (the
        other tiers still pin): a pin only protects from eviction, so a failed one can cost
        a recompute, never a wrong block, and raising would make an engine give up a request
        whose blocks are still readable. Bad ``keys`` or ``tier`` raise.
        """
        await self._pin_op("pin", keys, tier)

    async def unpin(self, keys: Sequence[bytes], *, tier: int | None = None) -> None:
        """Release one pin of each key (in the same tier(s) :meth:`pin` used); tier failures
        are counted, not raised, as for :meth:`pin`."""
        await self._pin_op("unpin", keys, tier)

    @in_flight
    async def _pin_op(self, op: str, keys: Sequence[bytes], tier: int | None) -> None:
        self._gate.enter()
        key_list = keys_list(keys)
        n = len(self._chain)
        if tier is None:
            indexes = range(n)
        elif isinstance(tier, bool) or not isinstance(tier, int) or not -n <= tier < n:
            raise ValueError(f"tier: expected None or a tier index < {n}, got {tier!r}")
        else:
            indexes = range(tier % n, tier % n + 1)
        for index in indexes:
            try:
                await getattr(self._chain.tiers[index], op)(key_list)
            except Exception as exc:
                self._chain.error(index, op, exc)

    # ------------------------------------------------------------------ stats / lifecycle
    def stats(self) -> dict[str, Any]:
        """Per-tier and store-wide figures.

        Returns
        -------
        dict
            ``"tiers"``: one dict per tier (top first) merging the tier's own ``stats()``
            (``scheme``, ``name``, ``capacity``, ``used``, ``evictions``, ...) with what the
            store observed (``hits``, ``misses``, ``errors``, ``timeouts``, ``promotions``,
            ``demotions``, ``bytes_in``, ``bytes_out``, ``get_p50_us``, ``get_p99_us``; a
            tier's own figure with one of these names is kept as ``tier_<name>``);
            plus ``gets``, ``hits``, ``misses``, ``hit_rate``, ``puts``, ``deletes``,
            ``single_flight_joins``, ``evictions_refused`` (evictions abandoned because no
            lower tier took a victim: the put that needed the room failed),
            ``pool_writes``, ``close_flushed``, ``write_policy``, ``write_queue_depth``,
            ``write_queue_bytes``, ``node``, ``event_subscribers``, ``events_emitted`` and
            ``events_dropped`` (events subscribers lost to their buffer bound);
            ``miss_reasons`` (``{reason: count}`` over the store's misses: ``not_stored``,
            ``evicted``, ``deleted``, ``corrupt``, ``unavailable``, ``deadline``),
            ``lookup_miss_reasons`` (the same for the key that ended each
            :meth:`lookup_prefix` short of its last key) and ``miss_records`` (keys the
            eviction records hold); each tier's ``miss_reasons`` counts the misses
            attributed to it.
        """
        return {**store_stats(self._chain.tiers, self._chain.tier_counters,
                              self._chain.counters, self._chain.misses),
                "write_policy": self._write_policy,
                "write_queue_depth": self._writes.depth,
                "write_queue_bytes": self._writes.pending_bytes,
                "node": self._events.node,
                "event_subscribers": self._events.subscribers,
                "events_emitted": self._events.emitted,
                "events_dropped": self._events.dropped}

    async def aclose(self) -> None:
        """Let the calls in flight finish (calls made from now on raise ``ClosedError``),
        flush write-through writes, copy volatile tiers into persistent ones (bounded, see
        ``close_flush``), then close every tier (an ``AllBlocksCleared`` event each) and end
        the :meth:`events` subscriptions. Calling it again does nothing."""
        if self._gate.closed:
            return
        self._gate.close()  # calls from now on raise ClosedError
        try:
            await self._gate.idle()
            await self._writes.aclose()
            if self._close_flush is not None and self._close_flush.active:
                await self._close_flush.run()
        finally:
            await self._chain.aclose()
            self._events.close()
            if self._lookup_log is not None:
                self._lookup_log.close()

    async def __aenter__(self) -> Self:
        self._gate.enter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        chain = " -> ".join(t.name for t in self._chain.tiers)
        return (f"<TieredStore {chain} promote={self._promotion.policy!r} "
                f"{self._write_policy}>")


def _default_node(tiers: Sequence[Tier]) -> str:
    """The ``self=`` member id of a pool tier in ``tiers`` (so that locate answers and events
    name this node as its peers do), else the host name."""
    for tier in tiers:
        self_id = getattr(getattr(tier, "members", None), "self_id", None)
        if isinstance(self_id, str) and self_id:
            return self_id
    return socket.gethostname() or "localhost"
