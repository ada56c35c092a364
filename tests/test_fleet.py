"""A shared file:// directory bounded as a fleet: use logs, the gc lease, fleet_capacity, and
nodes whose counted blocks the gc deleted. Real tmp dirs; tier objects share one directory as
nodes on one mount would."""
# These tests set file times and inspect the directory from inside async tests on purpose.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.events import BlockRemoved
from kvtier.misses import MissReason
from kvtier.store import TieredStore
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.fleet_gc import FleetCollector, collect_local
from kvtier.tiers.fleet_lease import LEASE_DIR, GcLease
from kvtier.tiers.fleet_uses import SUMMARY_NAME, USE_DIR, UseRecorder, read_uses
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.registry import tier_from_url
from tests.helpers.tmpfs import mounted_tmpfs

BLOCK = 4096
OLD = 1_000_000  # a long time ago: blocks "written" at OLD + i


def _blocks(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.rglob("*.kvb")}


def _age(tier: FsspecTier, keys: range) -> None:
    """Make the blocks of ``keys`` look written at OLD + i and never read since (what a
    noatime mount shows after any number of reads)."""
    for i in keys:
        os.utime(tier.path_of(key_of(i)), (OLD + i, OLD + i))


async def _three_nodes(url: str) -> list[FsspecTier]:
    nodes = [FsspecTier(url) for _ in range(3)]
    for i in range(12):
        await nodes[i % 3].put(key_of(i), sample_block(i, nbytes=BLOCK))
    _age(nodes[0], range(12))
    return nodes


async def _close(*tiers: FsspecTier) -> None:
    for tier in tiers:
        await tier.aclose()


# ------------------------------------------------------------------------------- use logs
async def test_gc_keeps_blocks_any_node_read(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 22 item 9: gc ranked by atime/mtime, which reads never change on noatime (or
    # relatime) mounts, so it deleted the blocks nodes were reading.
    url = f"file://{tmp_path}/shared"
    nodes = await _three_nodes(url)
    frame = Path(nodes[0].path_of(key_of(0))).stat().st_size
    hot = [0, 1, 5]  # the oldest blocks, read now by different nodes
    for node, i in zip(nodes, hot, strict=True):
        assert await node.get(key_of(i)) is not None
    for node in nodes:
        assert node.fleet is not None and node.fleet.uses is not None
        await node.fleet.uses.flush()
    _age(nodes[0], range(12))  # the reads left no trace in the inode times
    assert main(["gc", url, "--capacity", str(6 * frame)]) == 0
    assert "deleted 6 files" in capsys.readouterr().out
    kept = {i for i in range(12) if Path(nodes[0].path_of(key_of(i))).exists()}
    assert kept == {0, 1, 5, 9, 10, 11}  # the read ones, then the most recently written
    assert sum(_blocks(tmp_path / "shared").values()) <= 6 * frame
    await _close(*nodes)


async def test_use_log_coalesces_rotates_and_folds(tmp_path: Path) -> None:
    now = [5000.0]
    uses = UseRecorder(str(tmp_path), interval=3600, resolution=60, segment_bytes=10,
                       clock=lambda: now[0])
    for _ in range(100):
        uses.note("aa")
    uses.note("bb")
    await uses.flush()
    now[0] += 30
    uses.note("aa")  # logged 30 s ago: not again
    await uses.flush()
    assert uses.lines == 2
    now[0] += 60
    uses.note("aa")
    await uses.flush()
    await uses.aclose()
    segments = sorted((tmp_path / USE_DIR).iterdir())
    assert len(segments) == 2  # the first passed segment_bytes: a new one began
    last, read = read_uses(str(tmp_path))
    assert last == {"aa": 5090.0, "bb": 5000.0} and len(read) == 2
    uses.note("cc")  # after aclose: nothing more is written
    await asyncio.sleep(0)
    assert uses.lines == 3
    (tmp_path / "aa.kvb").write_bytes(b"x")
    collect_local(str(tmp_path), 1 << 20, None, use_horizon=1e10)  # still open: no fold
    assert not (tmp_path / USE_DIR / SUMMARY_NAME).exists()
    for seg in segments:  # closed long ago: the gc folds them into the summary
        os.utime(seg, (OLD, OLD))
    dead_tmp = tmp_path / USE_DIR / f".{SUMMARY_NAME}.{'0' * 32}.tmp"  # a gc died here
    dead_tmp.write_text("1 aa\n")
    os.utime(dead_tmp, (OLD, OLD))
    result = collect_local(str(tmp_path), 1 << 20, None, use_horizon=1e10)
    assert result.deleted == [] and not any(s.exists() for s in segments)
    assert not dead_tmp.exists()
    assert (tmp_path / USE_DIR / SUMMARY_NAME).read_text() == "5090 aa\n"  # bb is gone


async def test_use_log_recovers_when_its_folder_is_removed(tmp_path: Path) -> None:
    uses = UseRecorder(str(tmp_path), interval=3600)
    uses.note("aa")
    await uses.flush()
    shutil.rmtree(tmp_path / USE_DIR)  # an operator cleaned up
    uses.note("bb")
    await uses.flush()
    assert uses.errors == 1 and uses.enabled  # not read-only: it keeps logging
    uses.note("cc")
    await uses.aclose()
    assert set(read_uses(str(tmp_path))[0]) == {"cc"}


async def test_use_log_background_write_and_torn_line(tmp_path: Path) -> None:
    tier = tier_from_url(f"file://{tmp_path}/kv")
    assert isinstance(tier, FsspecTier) and tier.fleet is not None
    await tier.put(key_of(1), sample_block(1))
    await tier.get(key_of(1))
    await tier.aclose()  # writes what is pending
    (segment,) = (tmp_path / "kv" / USE_DIR).iterdir()
    assert segment.read_text().split()[1] == key_of(1).hex()
    with segment.open("a") as fh:
        fh.write("12345 deadbe")  # a writer died mid-line
    last, _ = read_uses(str(tmp_path / "kv"))
    assert set(last) == {key_of(1).hex()}
    off = tier_from_url(f"file://{tmp_path}/off?use_log=0")
    await off.put(key_of(2), sample_block(2))
    await off.get(key_of(2))
    await off.aclose()
    assert not (tmp_path / "off" / USE_DIR).exists()
    assert off.stats()["use_log"] is False


# -------------------------------------------------------------------- a node's accounting
async def test_block_deleted_behind_a_node_is_a_miss_and_uncounted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Bug: a node kept counting (and claiming) blocks the gc or another node deleted: its
    # `used` stayed high for good and contains() said yes to a block it could not serve.
    url = f"file://{tmp_path}/shared"
    nodes = await _three_nodes(url)
    owner = nodes[0]  # wrote blocks 0, 3, 6, 9
    before = owner.used
    frame = Path(owner.path_of(key_of(0))).stat().st_size
    assert main(["gc", url, "--capacity", str(6 * frame)]) == 0
    capsys.readouterr()
    assert await owner.get(key_of(0)) is None  # deleted by the gc: a miss, no error
    assert owner.used == before - frame
    assert not await owner.contains(key_of(0))
    assert owner.stats()["vanished"] == 1 and owner.stats()["io_errors"] == 0
    got = await owner.get(key_of(9))  # kept: served, intact
    assert got is not None and got.tobytes() == sample_block(9, nbytes=BLOCK).tobytes()
    await owner.put(key_of(0), sample_block(0, nbytes=BLOCK))  # written again: counted again
    assert owner.used == before
    await _close(*nodes)


async def test_store_over_a_node_explains_a_block_the_gc_deleted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/shared"
    node = FsspecTier(url, name="weka")
    gc_node = FsspecTier.from_url(f"{url}?fleet_capacity=1GiB&gc_interval=3600")
    async with TieredStore([node], node="n1") as store, \
            TieredStore([gc_node], node="n2") as gc_store:
        for i in range(6):
            await (gc_store if i < 2 else store).put(key_of(i), sample_block(i, nbytes=BLOCK))
        _age(node, range(6))
        frame = Path(node.path_of(key_of(0))).stat().st_size
        seen, gc_seen = store.events(), gc_store.events()
        assert gc_node.fleet is not None and gc_node.fleet.collector is not None
        gc_node.fleet.collector.capacity = 3 * frame
        assert await gc_node.fleet.collector.collect() is not None  # deletes blocks 0, 1, 2
        removed = [e for e in gc_seen.drain_nowait() if isinstance(e, BlockRemoved)]
        assert [e.keys for e in removed] == [(key_of(0), key_of(1))]  # known at once
        assert gc_node.used == 0
        [gone] = await gc_store.explain([key_of(1)])
        assert "deleted by this node's fleet gc" in str(gone)
        assert await store.get(key_of(2)) is None  # the other node notices when it reads
        [gone] = await store.explain([key_of(2)])
        assert gone.reason is MissReason.EVICTED and "fleet gc" in str(gone)
        assert store.stats()["tiers"][0]["used"] == 3 * frame
        assert [(e.tier, e.keys) for e in seen.drain_nowait()
                if isinstance(e, BlockRemoved)] == [("weka", (key_of(2),))]


# ------------------------------------------------------------------------------ the lease
def test_lease_one_holder_release_and_expiry(tmp_path: Path) -> None:
    a, b = GcLease(str(tmp_path), "node-a", ttl=60), GcLease(str(tmp_path), "node-b", ttl=60)
    assert a.acquire() and not b.acquire()
    assert b.last_seen is not None and b.last_seen.holder == "node-a"
    assert a.refresh()
    a.release()
    assert b.acquire() and not a.acquire()
    assert a.takeovers == 0  # b's was released, not abandoned
    # b crashes: its lease is never refreshed again (nor a contender's temp file removed)
    os.utime(b.path, (OLD, OLD))
    dead_tmp = tmp_path / LEASE_DIR / f".{'0' * 32}.tmp"
    dead_tmp.write_text("x")
    os.utime(dead_tmp, (OLD, OLD))
    assert a.acquire() and a.takeovers == 1 and not dead_tmp.exists()
    assert not b.refresh() and not b.held  # b, back, finds it lost
    b.release()  # not b's any more: a keeps it
    assert a.refresh()
    a.release()
    assert [p.name for p in (tmp_path / LEASE_DIR).iterdir()] == ["lease.3"]  # no temp files


@pytest.mark.parametrize("expired", [False, True])
def test_lease_contenders_racing_get_one_holder(tmp_path: Path, expired: bool) -> None:
    if expired:  # a crashed holder's lease, which all of them try to take over at once
        crashed = GcLease(str(tmp_path), "crashed", ttl=60)
        assert crashed.acquire()
        os.utime(crashed.path, (OLD, OLD))
    for _ in range(20):
        leases = [GcLease(str(tmp_path), f"node-{i}", ttl=60) for i in range(8)]
        start = threading.Barrier(len(leases))

        def contend(lease: GcLease, start: threading.Barrier = start) -> bool:
            start.wait()
            return lease.acquire()

        with ThreadPoolExecutor(len(leases)) as pool:
            won = [lease for lease, got in zip(leases, pool.map(contend, leases), strict=True)
                   if got]
        assert len(won) == 1 and won[0].refresh()
        assert Path(won[0].path).read_text().split()[1] == won[0].holder
        assert not any(lease.held for lease in leases if lease is not won[0])
        if expired:
            os.utime(won[0].path, (OLD, OLD))  # the winner crashes too
        else:
            won[0].release()


async def test_two_gcs_never_run_at_once(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/shared"
    nodes = await _three_nodes(url)
    frame = Path(nodes[0].path_of(key_of(0))).stat().st_size
    other = GcLease(str(tmp_path / "shared"), "node-z")
    assert other.acquire()  # a gc in progress elsewhere
    assert main(["gc", url, "--capacity", str(frame)]) == 0
    out = capsys.readouterr().out
    assert "skipped, a gc is running: node-z" in out
    collector = FleetCollector(str(tmp_path / "shared"), frame, 60, "node-y", lambda _: None)
    assert await collector.collect() is None and collector.skipped == 1
    assert len(_blocks(tmp_path / "shared")) == 12  # neither deleted anything
    other.release()
    result = await collector.collect()
    assert result is not None and len(_blocks(tmp_path / "shared")) == 1
    assert GcLease(str(tmp_path / "shared"), "next").acquire()  # released after the pass
    await _close(*nodes)


async def test_gc_that_lost_its_lease_stops(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"
    nodes = await _three_nodes(url)
    root = str(tmp_path / "shared")
    slow = GcLease(root, "slow", ttl=60)
    assert slow.acquire()
    os.utime(slow.path, (OLD, OLD))  # it stalled past its ttl...
    assert GcLease(root, "fresh", ttl=60).acquire()  # ...and was taken over
    result = collect_local(root, 0, slow)
    assert result.lease_lost and result.deleted == []
    assert len(_blocks(Path(root))) == 12
    await _close(*nodes)


# ------------------------------------------------------------------ fleet_capacity option
async def test_fleet_capacity_runs_in_background_and_bounds_the_directory(
        tmp_path: Path) -> None:
    root = tmp_path / "shared"
    url = f"file://{root}"
    nodes = await _three_nodes(url)
    frame = Path(nodes[0].path_of(key_of(0))).stat().st_size
    assert await nodes[1].get(key_of(1)) is not None
    await nodes[1].aclose()  # writes its use log: block 1 stays
    gc_node = tier_from_url(f"{url}?fleet_capacity={5 * frame}&gc_interval=0.05")
    assert isinstance(gc_node, FsspecTier)
    for i in range(12, 15):
        await gc_node.put(key_of(i), sample_block(i, nbytes=BLOCK))
    await gc_node.open()  # the write probe, then the gc starts
    for _ in range(400):
        if gc_node.stats()["gc_runs"] >= 2:
            break
        await asyncio.sleep(0.02)
    stats = gc_node.stats()
    assert stats["gc_runs"] >= 2 and stats["fleet_capacity"] == 5 * frame
    blocks = _blocks(root)
    assert sum(blocks.values()) <= 5 * frame
    assert key_of(1).hex() + ".kvb" in blocks and key_of(14).hex() + ".kvb" in blocks
    assert gc_node.used == 3 * frame  # its own 12..14 survived
    await gc_node.aclose()
    runs = gc_node.stats()["gc_runs"]
    await asyncio.sleep(0.15)
    assert gc_node.stats()["gc_runs"] == runs  # no pass after aclose
    await _close(nodes[0], nodes[2])


async def test_gc_node_forgets_what_it_deleted(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"
    node = tier_from_url(f"{url}?fleet_capacity=1MiB&gc_interval=3600")
    assert isinstance(node, FsspecTier) and node.fleet is not None
    for i in range(4):
        await node.put(key_of(i), sample_block(i, nbytes=BLOCK))
    _age(node, range(4))
    frame = Path(node.path_of(key_of(0))).stat().st_size
    collector = node.fleet.collector
    assert collector is not None
    collector.capacity = 2 * frame
    result = await collector.collect()
    assert result is not None and len(result.deleted) == 2
    assert node.used == 2 * frame and node.stats()["vanished"] == 0  # known, not noticed
    await node.aclose()


@pytest.mark.parametrize("url", [
    "file:///tmp/kv?fleet_capacity=lots", "file:///tmp/kv?fleet_capacity=0",
    "file:///tmp/kv?gc_interval=0", "file:///tmp/kv?gc_interval=soon",
    "file:///tmp/kv?use_log=maybe", "memory://kv?fleet_capacity=1GiB",
])
def test_bad_fleet_options(url: str) -> None:
    with pytest.raises(ConfigError, match=r"fleet_capacity|gc_interval|use_log"):
        tier_from_url(url)


def test_gc_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", f"file://{tmp_path}/typo", "--capacity", "1GiB"]) == 2
    assert "no directory" in capsys.readouterr().out
    assert main(["gc", f"file://{tmp_path}", "--capacity", "1GiB", "--lease-ttl", "0"]) == 2
    assert "--lease-ttl" in capsys.readouterr().out
    assert main(["gc", f"file://{tmp_path}", "--capacity", "1GiB", "--use-horizon", "-1"]) == 2
    assert "--use-horizon" in capsys.readouterr().out


# ------------------------------------------------------------------- a read-only reader
@contextmanager
def _read_only_view(src: Path, mnt: Path) -> Iterator[Path]:
    """``src`` bind-mounted read-only at ``mnt`` (root only; skips elsewhere)."""
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    proc = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.strip()}")
    try:
        proc = subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot make a bind mount read-only here: {proc.stderr.strip()}")
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_read_only_reader_among_three_nodes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/shared"
    nodes = await _three_nodes(url)
    frame = Path(nodes[0].path_of(key_of(0))).stat().st_size
    with _read_only_view(tmp_path / "shared", tmp_path / "ro") as ro:
        reader = FsspecTier(f"file://{ro}")
        with caplog.at_level(logging.WARNING, "kvtier.tiers.fsspec"):
            for i in (0, 1):
                assert await reader.get(key_of(i)) is not None
            assert reader.fleet is not None and reader.fleet.uses is not None
            await reader.fleet.uses.flush()
            await reader.fleet.uses.flush()
        assert [r.getMessage() for r in caplog.records if "use log" in r.getMessage()] \
            and reader.stats()["use_log"] is False  # said once, then stopped logging
        assert await nodes[2].get(key_of(2)) is not None  # a writer's read counts
        await nodes[2].fleet.uses.flush()  # type: ignore[union-attr]
        _age(nodes[0], range(12))
        assert main(["gc", url, "--capacity", str(4 * frame)]) == 0
        assert "deleted 8 files" in capsys.readouterr().out
        assert await reader.get(key_of(2)) is not None  # kept: read by node 2
        assert await reader.get(key_of(0)) is None  # the reader's reads could not count
        assert reader.stats()["io_errors"] == 0
        await reader.aclose()
    await _close(*nodes)


def test_every_fleet_option_is_documented() -> None:
    from kvtier.tiers.fleet import FLEET_OPTIONS

    docs = Path(__file__).resolve().parents[1] / "docs"
    urls, persistent = (docs / "tier-urls.md").read_text(), \
        (docs / "tiers-persistent.md").read_text()
    for option in FLEET_OPTIONS:
        assert f"`{option}`" in urls and option in persistent, option
    for flag in ("--use-atime", "--lease-ttl", "--tmp-age", "--dry-run"):
        assert flag in persistent, flag


@pytest.mark.parametrize(("horizon_days", "kept"), [(7, "b"), (10, "a")])
def test_use_horizon_forgets_old_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       horizon_days: int, kept: str) -> None:
    now = time.time()
    day = 86400
    for name, written in (("aa", now - 30 * day), ("bb", now - 20 * day)):
        path = tmp_path / f"{name}.kvb"
        path.write_bytes(b"x" * 100)
        os.utime(path, (written, written))
    (tmp_path / USE_DIR).mkdir()
    (tmp_path / USE_DIR / "node.1.log").write_text(f"{now - 8 * day:.0f} aa\n")  # read 8 d ago
    assert main(["gc", f"file://{tmp_path}", "--capacity", "100",
                 "--use-horizon", str(horizon_days * day)]) == 0
    assert "deleted 1 files" in capsys.readouterr().out
    assert [p.name for p in tmp_path.glob("*.kvb")] == [f"{kept * 2}.kvb"]


async def test_use_log_on_a_full_mount_keeps_trying_and_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with mounted_tmpfs(tmp_path / "mnt", "1m") as mnt:
        uses = UseRecorder(str(mnt), interval=3600, resolution=0, segment_bytes=1)
        uses.note("aa")
        await uses.flush()  # each write starts a segment (a new page); the mount fills up
        with contextlib.suppress(OSError), (mnt / "filler").open("wb", buffering=0) as fh:
            while True:
                fh.write(b"\0" * 65536)
        with caplog.at_level(logging.WARNING, "kvtier.tiers.fsspec"):
            for name in ("bb", "cc", "dd"):
                uses.note(name)
                await uses.flush()
        assert uses.errors == 3 and uses.enabled  # not permanent: it keeps trying
        assert len([r for r in caplog.records if "use log" in r.getMessage()]) == 1
        (mnt / "filler").unlink()
        uses.note("ee")
        await uses.aclose()
        assert set(read_uses(str(mnt))[0]) == {"aa", "ee"}
