"""``TieredStore``: one async facade over a chain of tiers, fastest first.

Reads walk the chain top-down and promote hits upward; writes land in the top tier (and, with
``write_through``, in the background below it); a block a tier evicts by budget is demoted
into the next tier before that tier stops serving it. See ``docs/architecture.md``.

This module builds the store (constructor, :func:`open_store`) and holds its stats and
lifecycle; the operations are mixins: ``kvtier/store_read.py`` (get, get_many, promotion),
``kvtier/store_lookup.py`` (get_into, presence, prefix lookup), ``kvtier/store_write.py``
(put, delete, demotion, pins), on the shared state of ``kvtier/store_core.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Self

from kvtier.errors import ConfigError
from kvtier.singleflight import KeyRegistry
from kvtier.stats import StoreCounters, TierCounters
from kvtier.store_core import (
    Promote,
    WritePolicy,
    _check_positive_int,
    _check_promote,
    _check_timeout,
)
from kvtier.store_lookup import StoreLookups
from kvtier.store_write import StoreWrites
from kvtier.tiers.base import Tier
from kvtier.tiers.registry import tier_from_url
from kvtier.writethrough import WriteThrough

__all__ = ["TieredStore", "open_store"]

_STORE_OPTIONS = ("promote", "write_policy", "timeout", "write_queue_size", "write_workers",
                  "promote_counter_size")


class TieredStore(StoreLookups, StoreWrites):
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
    write_queue_size, write_workers
        Bound of the write-through queue and number of workers draining it.
    promote_counter_size
        Keys whose lower-tier hits are counted for ``promote=N``.

    Raises
    ------
    TypeError, ValueError
        For a malformed argument (the message names it).

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
                 write_queue_size: int = 256, write_workers: int = 4,
                 promote_counter_size: int = 65536) -> None:
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence) or not tiers:
            raise TypeError("tiers: expected a non-empty sequence of Tier objects")
        for i, tier in enumerate(tiers):
            if not isinstance(tier, Tier):
                raise TypeError(f"tiers[{i}]: expected a Tier, got {type(tier).__name__}")
        if len({id(t) for t in tiers}) != len(tiers):
            raise ValueError("tiers: the same tier object appears twice")
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"write_policy: expected 'write_back' or 'write_through', "
                             f"got {write_policy!r}")
        self._promote = _check_promote(promote)
        self._timeout = _check_timeout(timeout)
        self._write_policy = write_policy
        self._counter_size = _check_positive_int(promote_counter_size, "promote_counter_size")
        self._tiers = list(tiers)
        self._tier_counters = [TierCounters() for _ in self._tiers]
        self._counters = StoreCounters()
        self._keys = KeyRegistry()
        self._hit_counts = OrderedDict()
        self._writes = WriteThrough(
            keys=self._keys, write=self._write_through, n_tiers=len(self._tiers),
            size=_check_positive_int(write_queue_size, "write_queue_size"),
            workers=_check_positive_int(write_workers, "write_workers"), counters=self._counters)
        self._closed = False
        for i, tier in enumerate(self._tiers[:-1]):
            tier.on_evict = self._demoter(i)

    # ------------------------------------------------------------------ properties
    @property
    def tiers(self) -> list[Tier]:
        """The tier objects, top (fastest) first."""
        return list(self._tiers)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._closed

    @property
    def write_policy(self) -> WritePolicy:
        """``"write_back"`` or ``"write_through"``."""
        return self._write_policy

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
            ``single_flight_joins``, ``dropped`` (evicted blocks no lower tier took),
            ``write_policy`` and ``write_queue_depth``.
        """
        tiers: list[dict[str, Any]] = []
        for tier, counters in zip(self._tiers, self._tier_counters, strict=True):
            try:
                own = tier.stats()
            except Exception as exc:  # a broken tier must not break monitoring
                own = {"scheme": tier.scheme, "name": tier.name, "capacity": None, "used": None,
                       "evictions": tier.evictions, "stats_error": repr(exc)}
            observed = counters.as_dict()
            # A tier's own figure of the same name (e.g. an LMDB tier's hits, which include
            # reads that bypassed the store) stays visible as tier_<name>.
            tiers.append({**own, **{f"tier_{k}": own[k] for k in observed if k in own},
                          **observed})
        return {
            "tiers": tiers,
            **self._counters.as_dict(),
            "write_policy": self._write_policy,
            "write_queue_depth": self._writes.depth,
        }

    async def aclose(self) -> None:
        """Flush write-through writes, then close every tier. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._writes.aclose()
        finally:
            for index, tier in enumerate(self._tiers):
                try:
                    await tier.aclose()
                except Exception as exc:
                    self._tier_error(index, "aclose", exc)

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        chain = " -> ".join(t.name for t in self._tiers)
        return f"<TieredStore {chain} promote={self._promote!r} {self._write_policy}>"


async def open_store(urls: Sequence[str | Tier], *,
                     tier_options: Mapping[int | str, Mapping[str, Any]] | None = None,
                     **options: Any) -> TieredStore:
    """Build a :class:`TieredStore` from tier URLs (and/or tier objects), top first.

    Parameters
    ----------
    urls
        Tier URLs such as ``"dram://?capacity=8GiB"``, or ready :class:`Tier` objects.
    tier_options
        Keyword options for individual tiers, keyed by position in ``urls`` or by the URL
        string itself; they override the URL's query options (e.g. ``{0: {"clock": c}}``).
    **options
        Store options: ``promote``, ``write_policy``, ``timeout``, ``write_queue_size``,
        ``write_workers``, ``promote_counter_size`` (see :class:`TieredStore`).

    Raises
    ------
    ConfigError
        For a malformed URL, capacity or option, or an unknown scheme or store option.
    """
    if isinstance(urls, str | Tier) or not isinstance(urls, Sequence) or not urls:
        raise TypeError("urls: expected a non-empty list of tier URLs or Tier objects")
    unknown = sorted(set(options) - set(_STORE_OPTIONS))
    if unknown:
        raise ConfigError(f"open_store: unknown option(s) {', '.join(unknown)} "
                          f"(store options: {', '.join(_STORE_OPTIONS)}; per-tier options go "
                          "in the URL or tier_options)")
    per_tier = dict(tier_options or {})
    for ref in per_tier:
        if not (isinstance(ref, str) and ref in urls) and not (
                isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(urls)):
            raise ConfigError(f"tier_options: {ref!r} is neither an index nor a URL in urls")
    tiers: list[Tier] = []
    owned: list[Tier] = []
    try:
        for i, url in enumerate(urls):
            if isinstance(url, Tier):
                tiers.append(url)
                continue
            if not isinstance(url, str):
                raise TypeError(f"urls[{i}]: expected a URL string or Tier, "
                                f"got {type(url).__name__}")
            opts = {**per_tier.get(url, {}), **per_tier.get(i, {})}
            tier = tier_from_url(url, **opts)
            owned.append(tier)
            tiers.append(tier)
        for tier in owned:
            # A tier with an async open() (peers://) checks its configuration against the
            # world here, so a wrong token fails at open, not at first use.
            opener = getattr(tier, "open", None)
            if opener is not None:
                await opener()
        return TieredStore(tiers, **options)
    except BaseException:
        for tier in owned:
            await tier.aclose()
        raise
