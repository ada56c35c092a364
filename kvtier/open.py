"""``open_store``: a :class:`~kvtier.store.TieredStore` built from tier URLs (and/or tier
objects), awaitable or used as an async context manager.

It checks the arguments before any tier exists, builds the tiers (``tier_from_url`` with
per-tier options), runs the async ``open()`` of tiers that have one (a pool checks its token
there), and closes the tiers it built if anything fails. ``kvtier.store.open_store`` is this
function.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, NotOpenedError
from kvtier.tiers.base import Tier
from kvtier.tiers.registry import tier_from_url

if TYPE_CHECKING:
    from kvtier.store import TieredStore

__all__ = ["open_store"]

_STORE_OPTIONS = ("promote", "write_policy", "timeout", "write_queue_size", "write_queue_bytes",
                  "write_workers", "promote_counter_size", "pool_write_through", "close_flush",
                  "close_flush_timeout", "node", "block_tokens", "miss_record_size",
                  "lookup_log")


class _OpeningStore:
    """What :func:`open_store` returns: awaitable (``store = await open_store(...)``) and an
    async context manager (``async with open_store(...) as store:``, closed on exit)."""

    def __init__(self, urls: Sequence[str | Tier],
                 tier_options: Mapping[int | str, Mapping[str, Any]] | None,
                 options: dict[str, Any]) -> None:
        _check_open_args(urls, tier_options, options)
        self._args = (urls, tier_options, options)
        self._store: TieredStore | None = None

    def __await__(self) -> Generator[Any, None, TieredStore]:
        return _open(*self._args).__await__()

    async def __aenter__(self) -> TieredStore:
        self._store = await _open(*self._args)
        return self._store

    async def __aexit__(self, *exc: object) -> None:
        if self._store is not None:
            await self._store.aclose()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: a store method on the opener itself
        # means the caller forgot to await it (the usual message names _OpeningStore only).
        raise NotOpenedError(
            f"open_store(...) was not awaited: it returns an opener, which has no {name!r}; "
            "write `store = await open_store(...)` or `async with open_store(...) as store:`")


def open_store(urls: Sequence[str | Tier], *,
               tier_options: Mapping[int | str, Mapping[str, Any]] | None = None,
               **options: Any) -> _OpeningStore:
    """Build a :class:`~kvtier.store.TieredStore` from tier URLs (and/or tier objects), top first.

    Use it as ``store = await open_store(urls)`` or ``async with open_store(urls) as store:``
    (the store is closed when the block exits).

    Parameters
    ----------
    urls
        Tier URLs such as ``"dram://?capacity=8GiB"``, or ready :class:`Tier` objects.
    tier_options
        Keyword options for individual tiers, keyed by position in ``urls`` or by the URL
        string itself; they override the URL's query options (e.g. ``{0: {"clock": c}}``).
    **options
        Store options: ``promote``, ``write_policy``, ``timeout``, ``write_queue_size``,
        ``write_queue_bytes``, ``write_workers``, ``promote_counter_size``,
        ``pool_write_through``, ``close_flush``, ``close_flush_timeout``, ``node``,
        ``block_tokens``, ``miss_record_size``, ``lookup_log`` (see
        :class:`~kvtier.store.TieredStore`).

    Raises
    ------
    ConfigError
        For a malformed URL, capacity or option, or an unknown scheme or store option.
    """
    return _OpeningStore(urls, tier_options, options)


def _check_open_args(urls: object, tier_options: Mapping[int | str, Mapping[str, Any]] | None,
                     options: dict[str, Any]) -> None:
    if isinstance(urls, str | Tier) or not isinstance(urls, Sequence) or not urls:
        raise TypeError("urls: expected a non-empty list of tier URLs or Tier objects")
    unknown = sorted(set(options) - set(_STORE_OPTIONS))
    if unknown:
        raise ConfigError(f"open_store: unknown option(s) {', '.join(unknown)} "
                          f"(store options: {', '.join(_STORE_OPTIONS)}; per-tier options go "
                          "in the URL or tier_options)")
    for ref in tier_options or {}:
        if not (isinstance(ref, str) and ref in urls) and not (
                isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(urls)):
            raise ConfigError(f"tier_options: {ref!r} is neither an index nor a URL in urls")


async def _open(urls: Sequence[str | Tier],
                tier_options: Mapping[int | str, Mapping[str, Any]] | None,
                options: dict[str, Any]) -> TieredStore:
    per_tier = dict(tier_options or {})
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
                _raise_if_cancelled()
        from kvtier.store import TieredStore  # kvtier.store re-exports open_store

        store = TieredStore(tiers, **options)
    except BaseException:
        for tier in owned:
            await tier.aclose()
        raise
    store._gate.enter()  # the store belongs to the loop that opened it
    return store


def _raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the opening task was cancelled meanwhile: a tier's open
    may swallow the cancellation (a client library turning it into a connection error that
    the tier logs as "unreachable"), and a cancelled ``open_store`` must never return a
    store. The tiers it built are then closed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("open_store was cancelled")
