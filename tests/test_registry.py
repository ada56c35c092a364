"""Scheme -> tier class: built-ins (lazy), registrations, entry points, fsspec protocols."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError, UnknownSchemeError
from kvtier.tiers import registry
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.registry import (
    ENTRY_POINT_GROUP,
    known_schemes,
    register_tier,
    tier_class,
    tier_from_url,
)

REPO = Path(__file__).resolve().parents[1]

# A complete third-party tier: frames in a dict. Written to a temporary directory so that it
# is found only through the import system and importlib.metadata, like an installed plugin.
PLUGIN_SOURCE = '''
from typing import Any

from kvtier.codec import decode_frame, encode_frame
from kvtier.tiers.base import Block, Tier
from kvtier.urls import merge_options, parse_tier_url


class FrameDictTier(Tier):
    scheme = "{scheme}"

    def __init__(self, *, prefix: str = "", name: str | None = None) -> None:
        super().__init__(name=name)
        self.prefix = prefix
        self.frames: dict[bytes, bytes] = {{}}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "FrameDictTier":
        parsed = parse_tier_url(url)
        opts = merge_options(parsed, options, {{"name"}})
        return cls(prefix=parsed.netloc, name=opts.get("name"))

    @property
    def capacity(self) -> int | None:
        return None

    @property
    def used(self) -> int:
        return sum(len(f) for f in self.frames.values())

    async def _get(self, key: bytes) -> Block | None:
        frame = self.frames.get(key)
        return None if frame is None else decode_frame(frame)

    async def _put(self, key: bytes, block: Block) -> None:
        self.frames[key] = encode_frame(block).to_bytes()

    async def _delete(self, key: bytes) -> bool:
        return self.frames.pop(key, None) is not None

    async def _contains(self, key: bytes) -> bool:
        return key in self.frames
'''


def write_plugin(root: Path, module: str, scheme: str, *, entry_point: bool) -> None:
    (root / f"{module}.py").write_text(PLUGIN_SOURCE.format(scheme=scheme), encoding="utf-8")
    if entry_point:
        dist = root / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n", encoding="utf-8")
        (dist / "entry_points.txt").write_text(
            f"[{ENTRY_POINT_GROUP}]\n{scheme} = {module}:FrameDictTier\n", encoding="utf-8")


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test do not leak into other tests."""
    monkeypatch.setattr(registry, "_registered", {})


def test_entry_point_group_name() -> None:
    assert ENTRY_POINT_GROUP == "kvtier.tiers"


def test_dram_resolves_and_builds() -> None:
    assert tier_class("dram") is DRAMTier
    assert tier_class("DRAM") is DRAMTier
    tier = tier_from_url("dram://?capacity=1MiB&name=top")
    assert isinstance(tier, DRAMTier) and tier.capacity == 1 << 20 and tier.name == "top"
    assert tier_from_url("dram://", capacity="2KiB").capacity == 2048


def test_known_schemes() -> None:
    schemes = known_schemes()
    assert schemes == sorted(schemes)
    for scheme in ("dram", "hbm", "lmdb", "peers", "peers+dns", "file", "memory", "s3"):
        assert scheme in schemes


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(UnknownSchemeError, match="'nosuch'") as info:
        tier_from_url("nosuch://x?capacity=1GiB")
    message = str(info.value)
    for scheme in ("dram", "hbm", "lmdb", "peers", "peers+dns", "fsspec"):
        assert scheme in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownSchemeError):
        tier_class("")


def test_fsspec_protocols_resolve_to_the_fsspec_tier() -> None:
    for scheme in ("file", "memory"):
        try:
            cls = tier_class(scheme)
        except ConfigError as exc:  # the fsspec tier module may not have landed yet
            assert "kvtier.tiers.fsspec:FsspecTier" in str(exc)
        else:
            assert (cls.__module__, cls.__name__) == ("kvtier.tiers.fsspec", "FsspecTier")


def test_register_class(isolated: None) -> None:
    class Dram2(DRAMTier):
        scheme = "dram2"

    register_tier("dram2", Dram2)
    assert tier_class("dram2") is Dram2
    assert "dram2" in known_schemes()
    assert isinstance(tier_from_url("dram2://?capacity=1KiB"), Dram2)
    # A registration overrides a built-in of the same scheme.
    register_tier("dram", Dram2)
    assert tier_class("dram") is Dram2


def test_register_lazy_path(isolated: None, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    write_plugin(tmp_path, "kvtier_lazy_plugin", "lazy", entry_point=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    register_tier("lazy", "kvtier_lazy_plugin:FrameDictTier")
    assert "kvtier_lazy_plugin" not in sys.modules  # nothing imported until first use
    try:
        cls = tier_class("lazy")
        assert cls.__name__ == "FrameDictTier" and issubclass(cls, Tier)
        assert "kvtier_lazy_plugin" in sys.modules
    finally:
        sys.modules.pop("kvtier_lazy_plugin", None)


@pytest.mark.parametrize(("target", "match"), [
    ("kvtier_no_such_module:Tier", "cannot load kvtier_no_such_module:Tier"),
    ("kvtier.tiers.dram:NoSuchTier", "cannot load"),
    ("kvtier.codec:encode_frame", "not a Tier subclass"),
    ("kvtier.errors:ConfigError", "not a Tier subclass"),
])
def test_register_bad_lazy_path(isolated: None, target: str, match: str) -> None:
    register_tier("broken", target)
    with pytest.raises(ConfigError, match=f"scheme 'broken': .*{match}"):
        tier_class("broken")


@pytest.mark.parametrize("scheme", ["", "DRAM", "Lmdb", None, 5])
def test_register_bad_scheme(isolated: None, scheme: object) -> None:
    with pytest.raises(ValueError, match="scheme"):
        register_tier(scheme, DRAMTier)  # type: ignore[arg-type]
    assert registry._registered == {}


@pytest.mark.parametrize(("target", "exc"), [
    (5, TypeError), (None, TypeError), (object, TypeError), (DRAMTier(), TypeError),
    ("kvtier.tiers.dram", ValueError), (":DRAMTier", ValueError),
    ("kvtier.tiers.dram:", ValueError),
])
def test_register_bad_target(isolated: None, target: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="target"):
        register_tier("x", target)  # type: ignore[arg-type]
    assert registry._registered == {}


def test_tier_class_needs_a_str() -> None:
    with pytest.raises(TypeError, match="scheme"):
        tier_class(b"dram")  # type: ignore[arg-type]


async def test_third_party_tier_via_entry_point(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    write_plugin(tmp_path, "kvtier_ep_plugin", "framedict", entry_point=True)
    assert "framedict" not in known_schemes()
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "framedict" in known_schemes()
        tier = tier_from_url("framedict://shard-a?name=plugin")
        assert type(tier).__module__ == "kvtier_ep_plugin" and tier.name == "plugin"
        block = np.arange(64, dtype=np.float16).reshape(8, 8)
        await tier.put(b"k", block)
        got = await tier.get(b"k")
        assert got is not None and got.tobytes() == block.tobytes() and got.shape == (8, 8)
        assert await tier.contains(b"k") and tier.used > block.nbytes
        with pytest.raises(ConfigError, match="unknown option"):
            tier_from_url("framedict://?capacity=1")
    finally:
        sys.modules.pop("kvtier_ep_plugin", None)


def test_entry_point_seen_by_a_fresh_process(tmp_path: Path) -> None:
    """An installed plugin needs no registration code: a new interpreter finds it."""
    write_plugin(tmp_path, "kvtier_proc_plugin", "procdict", entry_point=True)
    code = textwrap.dedent("""
        from kvtier.tiers.registry import tier_from_url
        tier = tier_from_url("procdict://")
        print(type(tier).__module__, type(tier).__name__, tier.scheme)
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=60,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["kvtier_proc_plugin", "FrameDictTier", "procdict"]
