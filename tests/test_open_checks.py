"""A tier that cannot work fails at open with a ConfigError naming what to change (issue 22,
items 1, 4, 6 and 8): the write probe of file:// and fsspec tiers, http(s):// refused unless
asked for, LMDB paths that cannot be a directory, LMDB opened at store open (stats show a
warm restart), capacity=0, store options, the rate-limited per-block warnings, and the
DRAM arena's background prefault. Real directories, real tiers."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError, TierFullError
from kvtier.store import TieredStore, open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.registry import known_schemes, tier_class, tier_from_url

# A directory no process can create, root included (sysfs refuses new entries).
UNWRITABLE = "/sys/kvtier-open-check"


def _unwritable() -> None:
    try:
        os.mkdir(UNWRITABLE)
    except OSError:
        return
    os.rmdir(UNWRITABLE)
    pytest.skip("needs a sysfs /sys that refuses new directories")


# ------------------------------------------------------------ item 1: write probe
async def test_unwritable_file_tier_fails_at_open_naming_the_path() -> None:
    _unwritable()
    with pytest.raises(ConfigError, match="write probe failed") as info:
        await open_store(["dram://?capacity=64KiB", f"file://{UNWRITABLE}"])
    message = str(info.value)
    assert UNWRITABLE in message and "path in the URL" in message


async def test_file_under_a_regular_file_fails_at_open(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(ConfigError, match="NotADirectoryError"):
        await open_store([f"file://{tmp_path}/plain/kv"])


async def test_writable_file_tier_opens_and_leaves_nothing_behind(tmp_path: Path) -> None:
    async with open_store([f"file://{tmp_path}/kv"]) as store:
        await store.put(key_of(1), sample_block(1))
    names = sorted(p.name for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert names == [key_of(1).hex() + ".kvb"]  # the probe object is gone


async def test_probe_0_opens_a_read_only_reader(tmp_path: Path) -> None:
    async with open_store([f"file://{tmp_path}/kv"]) as store:
        await store.put(key_of(1), sample_block(1))
    (tmp_path / "kv").chmod(0o555)
    try:
        async with open_store([f"file://{tmp_path}/kv?probe=0"]) as reader:
            got = await reader.get(key_of(1))
            assert got is not None and np.array_equal(got, sample_block(1))
    finally:
        (tmp_path / "kv").chmod(0o755)


async def test_memory_fs_probe_passes() -> None:
    async with open_store(["memory://kvtier-open-check"]) as store:
        await store.put(key_of(2), sample_block(2))
        assert await store.contains(key_of(2))


def test_http_is_refused_with_the_explicit_spelling_named() -> None:
    for url in ("http://127.0.0.1:7201", "https://example.invalid/kv"):
        with pytest.raises(ConfigError, match=r"peers://host:port.*fsspec\+http"):
            tier_from_url(url)
    assert "http" not in known_schemes() and "fsspec+http" in known_schemes()


def test_fsspec_prefix_asks_for_http_explicitly() -> None:
    assert tier_class("fsspec+https") is FsspecTier
    tier = tier_from_url("fsspec+http://127.0.0.1:9/kv?probe=0")
    assert isinstance(tier, FsspecTier)
    assert tier.protocol == "http" and tier.url == "http://127.0.0.1:9/kv"


async def test_explicit_http_tier_that_cannot_write_fails_at_open() -> None:
    # Nothing listens on port 9: whatever fsspec's HTTP filesystem says, it is no tier.
    with pytest.raises(ConfigError, match="write probe failed"):
        await open_store(["fsspec+http://127.0.0.1:9/kv?timeout=5"])


async def test_demotion_failures_are_one_line_and_a_summary(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lower = FsspecTier(f"file://{tmp_path}/plain/kv")  # a Tier object: no probe ran
    (tmp_path / "plain").write_bytes(b"x")
    store = TieredStore([DRAMTier(capacity=64 << 10), lower], close_flush=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.store"):
        for i in range(16):  # DRAM's budget
            await store.put(key_of(i), np.zeros(4096, np.uint8))
        for i in range(16, 40):  # each needs a demotion, which fails: the put is refused
            with pytest.raises(TierFullError):
                await store.put(key_of(i), np.zeros(4096, np.uint8))
        await store.aclose()
    lines = [r.getMessage() for r in caplog.records if "failed demote" in r.getMessage()]
    assert len(lines) == 2, lines  # the first failure, then one summary at close
    more = int(re.search(r"failed demote (\d+) more time\(s\)", lines[1]).group(1))  # type: ignore[union-attr]
    assert 1 + more >= 20  # every failed demotion is counted, none logged on its own line


# ------------------------------------------------------- item 6: bad lmdb paths
def test_lmdb_path_that_is_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"FileExistsError.*change the path"):
        tier_from_url(f"lmdb://{tmp_path}/plain")


def test_lmdb_path_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(ConfigError, match="as an LMDB directory"):
        tier_from_url(f"lmdb://{tmp_path}/plain/sub")


def test_lmdb_dangling_symlink(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "deeper")
    (tmp_path / "gone").write_bytes(b"")
    with pytest.raises(ConfigError, match="as an LMDB directory"):
        tier_from_url(f"lmdb://{tmp_path}/link")


def test_lmdb_unwritable_directory() -> None:
    _unwritable()
    with pytest.raises(ConfigError, match=f"'{UNWRITABLE}' as an LMDB directory"):
        tier_from_url(f"lmdb://{UNWRITABLE}")


def test_lmdb_lock_file_that_cannot_be_opened(tmp_path: Path) -> None:
    (tmp_path / "kvtier.lock").mkdir()  # kvtier.lock cannot be opened read-write
    with pytest.raises(ConfigError, match="IsADirectoryError"):
        LMDBTier(tmp_path)


@pytest.mark.parametrize("url", ["dram://?capacity=0", "dram://?capacity=0B"])
def test_zero_capacity_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="holds no block"):
        tier_from_url(url)


def test_zero_capacity_lmdb_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no block"):
        tier_from_url(f"lmdb://{tmp_path}/l?capacity=0")
    with pytest.raises(ConfigError, match="holds no block"):
        tier_from_url(f"file://{tmp_path}/f?capacity=0")


@pytest.mark.parametrize(("options", "name"), [
    ({"write_policy": "sometimes"}, "write_policy"),
    ({"promote": "never"}, "promote"),
    ({"promote_counter_size": 0}, "promote_counter_size"),
    ({"write_workers": 0}, "write_workers"),
    ({"node": ""}, "node"),
])
async def test_store_options_raise_config_error(options: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        await open_store(["dram://?capacity=1MiB"], **options)


# ---------------------------------------------- item 4: stats after a reopen
async def test_lmdb_stats_after_reopen_show_the_blocks(tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/l?capacity=16MiB"
    async with open_store([url]) as store:
        for i in range(5):
            await store.put(key_of(i), sample_block(i))
    async with open_store([url]) as store:
        lmdb_stats = store.stats()["tiers"][0]
        assert lmdb_stats["opened"] is True
        assert lmdb_stats["blocks"] == 5 and lmdb_stats["used"] > 0


def test_lmdb_not_opened_yet_says_so(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path)
    try:
        assert tier.stats()["opened"] is False
    finally:
        asyncio.run(tier.aclose())


# ------------------------------------------------- item 8: prefault by default
async def test_bounded_dram_prefaults_in_the_background_by_default() -> None:
    tier = tier_from_url("dram://?capacity=64MiB")
    try:
        stats = tier.stats()
        assert stats["prefault"] == "background"
        for _ in range(500):
            stats = tier.stats()
            if stats["prefaulted"]:
                break
            await asyncio.sleep(0.02)
        if stats["prefault_error"] is not None:
            pytest.skip(f"this kernel cannot prefault in the background: "
                        f"{stats['prefault_error']}")
        assert stats["prefaulted"] and stats["prefaulted_bytes"] > 0
        await tier.put(key_of(1), sample_block(1))
        got = await tier.get(key_of(1))
        assert got is not None and np.array_equal(got, sample_block(1))
    finally:
        await tier.aclose()


def test_prefault_opt_out_and_at_open() -> None:
    off = DRAMTier.from_url("dram://?capacity=1MiB&prefault=0")
    now = DRAMTier.from_url("dram://?capacity=1MiB&prefault=1")
    try:
        assert off.stats()["prefault"] == "off" and off.stats()["prefaulted_bytes"] == 0
        assert now.stats()["prefault"] == "open" and now.stats()["prefaulted"] is True
    finally:
        asyncio.run(off.aclose())
        asyncio.run(now.aclose())
    with pytest.raises(ConfigError, match="prefault"):
        DRAMTier.from_url("dram://?capacity=1MiB&prefault=sometimes")
    assert DRAMTier.from_url("dram://?prefault=0").arena is None  # unbounded: nothing to do
