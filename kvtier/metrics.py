"""Prometheus metrics of a store embedded in another process (extra ``kvtier[metrics]``).

``kvtier serve`` has ``/metrics``; an inference server that embeds a
:class:`~kvtier.store.TieredStore` exposes the same families through its own
``prometheus_client`` registry::

    import kvtier.metrics
    kvtier.metrics.register(store)                      # the default registry
    kvtier.metrics.start_http_server(store, port=9464)  # or a registry and a server of its own

A scrape from another thread (``prometheus_client``'s HTTP server) reads ``store.stats()``
on the store's event loop, where the figures change, waiting at most ``SCRAPE_TIMEOUT``
seconds (a loop that busy serves the scrape an error rather than a torn snapshot). The
families and their kinds are those of ``/metrics`` (``docs/peer-protocol.md``): levels are
gauges, running totals counters with the ``_total`` suffix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.peer.metrics import Family, segment_families

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from kvtier.store import TieredStore

__all__ = ["SCRAPE_TIMEOUT", "StoreCollector", "families", "register", "start_http_server"]

#: Seconds a scrape from another thread waits for the store's loop to read its statistics.
SCRAPE_TIMEOUT = 5.0

_EXTRA_HINT = ("kvtier.metrics needs prometheus_client: pip install 'kvtier[metrics]' "
               "(or pip install prometheus_client)")


def _prometheus(module: str = "prometheus_client") -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(_EXTRA_HINT) from exc


def families(store: TieredStore) -> list[Family]:
    """The metric families of ``store`` now (per tier, store-wide, misses by reason).

    Raises
    ------
    TimeoutError
        Called from another thread while the store's loop did not get to it within
        :data:`SCRAPE_TIMEOUT` seconds.
    """
    loop = store._gate.loop
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if loop is None or on_loop or loop.is_closed() or not loop.is_running():
        return segment_families(store.stats())
    done: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

    def read() -> None:
        try:
            done.set_result(store.stats())
        except Exception as exc:
            done.set_exception(exc)

    loop.call_soon_threadsafe(read)
    return segment_families(done.result(SCRAPE_TIMEOUT))


class StoreCollector:
    """A ``prometheus_client`` collector of one store's families (see :func:`register`).

    Parameters
    ----------
    store
        The store whose ``stats()`` each scrape reads.
    """

    def __init__(self, store: TieredStore) -> None:
        self._core = _prometheus("prometheus_client.core")
        self.store = store

    def collect(self) -> Iterator[Any]:
        """One ``CounterMetricFamily``/``GaugeMetricFamily`` per family."""
        core = self._core
        for fam in families(self.store):
            cls = core.CounterMetricFamily if fam.kind == "counter" else core.GaugeMetricFamily
            metric = cls(fam.name, fam.help, labels=list(fam.labels))
            for labels, value in fam.samples:
                metric.add_metric(list(labels), value)
            yield metric

    def describe(self) -> list[Any]:
        """Nothing up front: the families follow the tiers, so the registry does not check
        names at registration (two stores on one registry need distinct registries)."""
        return []


def register(store: TieredStore, registry: CollectorRegistry | None = None) -> StoreCollector:
    """Register a collector of ``store``'s metrics on ``registry`` (default:
    ``prometheus_client.REGISTRY``) and return it (``registry.unregister(collector)``
    removes it).

    Raises
    ------
    ConfigError
        If ``prometheus_client`` is not installed (extra ``kvtier[metrics]``).
    TypeError
        If ``store`` has no ``stats()``.
    """
    prom = _prometheus()
    if not callable(getattr(store, "stats", None)):
        raise TypeError(f"store: expected a TieredStore, got {type(store).__name__}")
    collector = StoreCollector(store)
    (prom.REGISTRY if registry is None else registry).register(collector)
    return collector


def start_http_server(store: TieredStore, port: int, addr: str = "127.0.0.1",
                      registry: CollectorRegistry | None = None) -> Any:
    """Serve ``store``'s metrics on ``http://addr:port/metrics`` from a daemon thread
    (``prometheus_client.start_http_server``) and return the WSGI server
    (``server.server_address[1]`` is the port bound, useful with ``port=0``;
    ``server.shutdown()`` stops it).

    Without ``registry`` a new one is made holding only this store's collector, so the
    page has no Python process metrics beside kvtier's; give
    ``prometheus_client.REGISTRY`` to serve both. Binds ``127.0.0.1`` unless told
    otherwise, like ``kvtier serve``; this server has no authentication of its own.

    Raises
    ------
    ConfigError
        If ``prometheus_client`` is not installed.
    ValueError
        On a port outside 0..65535.
    """
    prom = _prometheus()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an int in 0..65535, got {port!r}")
    target = prom.CollectorRegistry(auto_describe=False) if registry is None else registry
    register(store, target)
    server, _thread = prom.start_http_server(port, addr=addr, registry=target)
    return server
