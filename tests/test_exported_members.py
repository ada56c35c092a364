"""The public surface of ``kvtier`` is exactly ``__all__`` (a change here is an API change)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import kvtier
from kvtier import errors


def test_all_is_pinned() -> None:
    assert sorted(kvtier.__all__) == sorted([
        "BackendUnavailableError", "BlockingStore",
        "BlockTooLargeError", "ClosedError", "ConfigError", "CorruptBlockError",
        "DRAMTier", "DirectoryLockedError", "FsspecTier", "HBMTier", "InvalidKeyError",
        "KVTierError", "KeyNamespace", "LMDBTier", "LimitExceededError", "LocalTier",
        "NotOpenedError", "PeerError", "PeerStatusError", "PeerTier", "ProtocolError",
        "ShapeMismatchError", "Tier", "TierError",
        "TierFullError", "TieredStore", "UnknownSchemeError", "WrongLoopError",
        "__version__", "open_store", "prefix_keys",
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


@pytest.mark.slow
def test_top_level_imports_on_a_base_install_without_extras() -> None:
    """``from kvtier import *`` and ``hasattr`` work without the redis and mooncake extras
    (issue 20 bug 4: both raised ImportError). The extras are hidden from a fresh
    interpreter, so this checks a base install whatever this environment has."""
    script = textwrap.dedent("""
        import sys
        for name in ("redis", "mooncake"):  # as if the extras were not installed
            sys.modules[name] = None
        import kvtier
        namespace = {}
        exec("from kvtier import *", namespace)
        assert set(kvtier.__all__) <= set(namespace), set(kvtier.__all__) - set(namespace)
        assert not hasattr(kvtier, "RedisTier") and not hasattr(kvtier, "MooncakeTier")
        assert hasattr(kvtier, "LMDBTier") and hasattr(kvtier, "PeerTier")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_tier_classes_with_heavy_modules_load_on_first_access() -> None:
    """``import kvtier`` imports none of the lazily exported tier modules (``local://``'s
    pulls in aiohttp and the daemon's client); the first access imports the real class."""
    script = textwrap.dedent("""
        import sys
        import kvtier
        lazy = ("kvtier.tiers.local", "kvtier.tiers.lmdb", "kvtier.tiers.fsspec",
                "kvtier.peer.tier")
        assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]
        from kvtier.tiers.local import LocalTier
        assert kvtier.LocalTier is LocalTier and "LocalTier" in kvtier.__all__
        assert LocalTier.scheme == "local"
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
