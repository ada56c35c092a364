"""kvtier: one logical KV-block pool over HBM, DRAM, peers' DRAM, NVMe and filesystems."""

from kvtier.blocking import BlockingStore
from kvtier.codec import decode_frame, encode_frame
from kvtier.errors import (
    BackendUnavailableError,
    BlockTooLargeError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    InvalidKeyError,
    KVTierError,
    PeerError,
    ShapeMismatchError,
    TierError,
    TierFullError,
    UnknownSchemeError,
)
from kvtier.keys import KeyNamespace, prefix_keys
from kvtier.store import TieredStore, open_store
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.registry import register_tier, tier_from_url

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BlockTooLargeError",
    "BlockingStore",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DRAMTier",
    "InvalidKeyError",
    "KVTierError",
    "KeyNamespace",
    "PeerError",
    "ShapeMismatchError",
    "Tier",
    "TierError",
    "TierFullError",
    "TieredStore",
    "UnknownSchemeError",
    "__version__",
    "decode_frame",
    "encode_frame",
    "open_store",
    "prefix_keys",
    "register_tier",
    "tier_from_url",
]
