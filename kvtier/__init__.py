"""kvtier: one logical KV-block pool over HBM, DRAM, peers' DRAM, NVMe and filesystems.

The top level names what a base install provides. Tiers that need an extra are opened by
URL (``redis://``, ``mooncake://``) or imported from their module
(``kvtier.tiers.redis_tier.RedisTier``, ``kvtier.tiers.mooncake_tier.MooncakeTier``), so
``from kvtier import *`` and ``hasattr(kvtier, name)`` never need an extra.
"""

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.blocking import BlockingStore
from kvtier.errors import (
    BackendUnavailableError,
    BlockTooLargeError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    DirectoryLockedError,
    InvalidKeyError,
    KVTierError,
    LimitExceededError,
    NotOpenedError,
    PeerError,
    PeerStatusError,
    ProtocolError,
    ShapeMismatchError,
    TierError,
    TierFullError,
    UnknownSchemeError,
    WrongLoopError,
)
from kvtier.keys import KeyNamespace, prefix_keys
from kvtier.store import TieredStore, open_store
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.registry import register_tier, tier_from_url

if TYPE_CHECKING:
    from kvtier.peer.tier import PeerTier
    from kvtier.tiers.fsspec import FsspecTier
    from kvtier.tiers.hbm import HBMTier
    from kvtier.tiers.lmdb import LMDBTier
    from kvtier.tiers.local import LocalTier

# Tier classes whose modules pull in heavy dependencies (aiohttp, lmdb, fsspec; all in a
# base install) are imported on first access, so ``import kvtier`` stays light.
_LAZY = {"FsspecTier": "kvtier.tiers.fsspec", "HBMTier": "kvtier.tiers.hbm",
         "LMDBTier": "kvtier.tiers.lmdb", "LocalTier": "kvtier.tiers.local",
         "PeerTier": "kvtier.peer.tier"}

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BlockTooLargeError",
    "BlockingStore",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DRAMTier",
    "DirectoryLockedError",
    "FsspecTier",
    "HBMTier",
    "InvalidKeyError",
    "KVTierError",
    "KeyNamespace",
    "LMDBTier",
    "LimitExceededError",
    "LocalTier",
    "NotOpenedError",
    "PeerError",
    "PeerStatusError",
    "PeerTier",
    "ProtocolError",
    "ShapeMismatchError",
    "Tier",
    "TierError",
    "TierFullError",
    "TieredStore",
    "UnknownSchemeError",
    "WrongLoopError",
    "__version__",
    "open_store",
    "prefix_keys",
    "register_tier",
    "tier_from_url",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
