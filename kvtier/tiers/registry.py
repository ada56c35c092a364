"""Tier URL schemes -> tier classes: built-ins (imported lazily), the ``kvtier.tiers``
entry-point group for third-party tiers, and fsspec protocols as a fallback."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from kvtier.errors import ConfigError, UnknownSchemeError
from kvtier.tiers.base import Tier
from kvtier.urls import parse_tier_url

__all__ = ["ENTRY_POINT_GROUP", "known_schemes", "register_tier", "tier_class", "tier_from_url"]

ENTRY_POINT_GROUP = "kvtier.tiers"
_FSSPEC_TIER = "kvtier.tiers.fsspec:FsspecTier"
_BUILTIN: dict[str, str] = {
    "dram": "kvtier.tiers.dram:DRAMTier",
    "hbm": "kvtier.tiers.hbm:HBMTier",
    "lmdb": "kvtier.tiers.lmdb:LMDBTier",
    "local": "kvtier.tiers.local:LocalTier",
    "peers": "kvtier.peer.tier:PeerTier",
    "peers+dns": "kvtier.peer.tier:PeerTier",
    "redis": "kvtier.tiers.redis_tier:RedisTier",
    "redis+cluster": "kvtier.tiers.redis_tier:RedisTier",
    "mooncake": "kvtier.tiers.mooncake_tier:MooncakeTier",
}
# fsspec protocols taken only when asked for with the explicit prefix (fsspec+https://):
# an http(s) URL as a tier is almost always a typo for peers://.
_REFUSED_FSSPEC = frozenset({"http", "https"})
_EXPLICIT_FSSPEC = "fsspec+"
_registered: dict[str, type[Tier] | str] = {}


def register_tier(scheme: str, target: type[Tier] | str) -> None:
    """Register a tier class (or a lazy ``"module:Class"`` path) for ``scheme``."""
    if not isinstance(scheme, str) or not scheme or scheme != scheme.lower():
        raise ValueError(f"scheme: expected a non-empty lowercase scheme, got {scheme!r}")
    if isinstance(target, str):
        if not all(target.partition(":")[::2]):
            raise ValueError(f"target: expected 'module:Class', got {target!r}")
    elif not (isinstance(target, type) and issubclass(target, Tier)):
        raise TypeError(f"target: expected a Tier subclass or 'module:Class', got {target!r}")
    _registered[scheme] = target


def _fsspec_protocols() -> set[str]:
    from fsspec.registry import known_implementations, registry

    return set(known_implementations) | set(registry)


def _entry_point_schemes() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every scheme :func:`tier_from_url` accepts (fsspec protocols included; ``http`` and
    ``https`` only as ``fsspec+http``/``fsspec+https``)."""
    return sorted(set(_BUILTIN) | set(_registered) | set(_entry_point_schemes())
                  | (_fsspec_protocols() - _REFUSED_FSSPEC)
                  | {_EXPLICIT_FSSPEC + p for p in _REFUSED_FSSPEC})


def _load(target: type[Tier] | str, scheme: str) -> type[Tier]:
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"scheme {scheme!r}: cannot load {target}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"scheme {scheme!r}: {target} is not a Tier subclass")
    return cls


def tier_class(scheme: str) -> type[Tier]:
    """Return the tier class that handles ``scheme``.

    Raises
    ------
    UnknownSchemeError
        Listing the known schemes.
    """
    if not isinstance(scheme, str):
        raise TypeError(f"scheme: expected str, got {type(scheme).__name__}")
    scheme = scheme.lower()
    if scheme in _registered:
        return _load(_registered[scheme], scheme)
    if scheme in _BUILTIN:
        return _load(_BUILTIN[scheme], scheme)
    eps = _entry_point_schemes()
    if scheme in eps:
        return _load(eps[scheme].value, scheme)
    if scheme in _REFUSED_FSSPEC:
        raise ConfigError(
            f"url: {scheme}:// is not a tier (a kvtier peer pool is peers://host:port); to "
            f"use an HTTP server as an fsspec tier, ask for it explicitly: fsspec+{scheme}://...")
    protocol = scheme.removeprefix(_EXPLICIT_FSSPEC)
    if protocol in _fsspec_protocols():
        return _load(_FSSPEC_TIER, scheme)
    builtin = ", ".join(sorted(set(_BUILTIN) | set(_registered) | set(eps)))
    raise UnknownSchemeError(
        f"url: unknown tier scheme {scheme!r}; known: {builtin}, or any fsspec protocol "
        "(file, memory, s3, gs, ...)")


def tier_from_url(url: str, **options: Any) -> Tier:
    """Build a tier from its URL, e.g. ``tier_from_url("dram://?capacity=8GiB")``."""
    parsed = parse_tier_url(url)
    return tier_class(parsed.scheme).from_url(url, **options)
