"""The public surface of ``kvtier`` is exactly ``__all__`` (a change here is an API change)."""

from __future__ import annotations

import inspect

import kvtier
from kvtier import errors


def test_all_is_pinned() -> None:
    assert sorted(kvtier.__all__) == sorted([
        "BackendUnavailableError", "BlockingStore",
        "BlockTooLargeError", "ClosedError", "ConfigError", "CorruptBlockError",
        "DRAMTier", "DirectoryLockedError", "FsspecTier", "HBMTier", "InvalidKeyError",
        "KVTierError", "KeyNamespace", "LMDBTier", "LimitExceededError", "MooncakeTier",
        "PeerError", "PeerStatusError", "PeerTier", "RedisTier", "ProtocolError",
        "ShapeMismatchError", "Tier", "TierError",
        "TierFullError", "TieredStore", "UnknownSchemeError", "WrongLoopError",
        "__version__", "decode_frame", "encode_frame", "open_store", "prefix_keys",
        "register_tier", "tier_from_url",
    ])
    for name in kvtier.__all__:
        assert hasattr(kvtier, name), name


def test_every_error_class_is_exported_and_under_kvtier_error() -> None:
    classes = {name for name, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, BaseException)}
    assert classes == set(errors.__all__)
    assert classes <= set(kvtier.__all__)
    assert all(issubclass(getattr(errors, name), kvtier.KVTierError) for name in classes)
