"""Read-only readers of a ``file://`` tier: a location that refuses the write probe for
permission (a read-only mount, a 0555 directory of another owner) but can be read opens
read-only (reads serve, writes and deletes are refused, counted and warned about at most
once per interval, ``stats()["read_only"]``); ``probe=require`` makes it an error; a
location that cannot be read either is a ``ConfigError``; ``kvtier explain`` writes nothing.

As root, permission bits do not stop writes: a tmpfs remounted read-only refuses them
(``EROFS``), and a 0555 directory is checked from a child that dropped to ``nobody``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import open_store
from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.fsspec_readonly import ProbeMode, is_read_only_error, parse_probe
from tests.helpers.peer_helpers import REPO
from tests.helpers.tmpfs import mounted_tmpfs

BLOCKS = 3


def _remount(mnt: Path, mode: str) -> None:
    proc = subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot remount a tmpfs {mode}: {proc.stderr.strip()}")


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """``kv/`` holding ``BLOCKS`` blocks on a location this process cannot write: a tmpfs
    remounted read-only (root), or a 0555 directory (anyone else)."""
    if os.geteuid() != 0:
        kv = tmp_path / "kv"
        _write_blocks(kv)
        kv.chmod(0o555)
        for sub in kv.rglob("*"):
            sub.chmod(0o555 if sub.is_dir() else 0o444)
        try:
            yield kv
        finally:
            for sub in [kv, *kv.rglob("*")]:
                sub.chmod(0o755)
        return
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        _write_blocks(mnt / "kv")
        _remount(mnt, "ro")
        try:
            yield mnt / "kv"
        finally:
            _remount(mnt, "rw")


def _write_blocks(kv: Path) -> None:
    async def put() -> None:
        async with open_store([f"file://{kv}"]) as store:
            await store.put_many([(key_of(i), sample_block(i)) for i in range(BLOCKS)])

    asyncio.run(put())


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_probe_modes_parse() -> None:
    assert parse_probe("1") is parse_probe(True) is parse_probe("auto") is ProbeMode.AUTO
    assert parse_probe("0") is parse_probe(False) is ProbeMode.OFF
    assert parse_probe("require") is ProbeMode.REQUIRE
    with pytest.raises(ConfigError, match="probe: expected auto, require or 0"):
        parse_probe("maybe")
    assert is_read_only_error(PermissionError(13, "denied"))
    assert is_read_only_error(OSError(30, "Read-only file system"))
    assert not is_read_only_error(FileNotFoundError(2, "gone"))


async def test_unwritable_readable_location_opens_read_only(
        read_only_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = _files(read_only_dir)
    caplog.set_level(logging.WARNING, "kvtier.tiers.fsspec")
    async with open_store(["dram://?capacity=1MiB", f"file://{read_only_dir}"]) as store:
        got = await store.get_many([key_of(i) for i in range(BLOCKS)])
        assert all(g is not None and np.array_equal(g, sample_block(i))
                   for i, g in enumerate(got))
        file_tier = store.stats()["tiers"][1]
        assert file_tier["read_only"] is True and "write probe failed" in \
            file_tier["read_only_reason"]
        tier = store.tiers[1]
        for i in range(10):
            await tier.put(key_of(100 + i), sample_block(i))
        assert not await tier.delete(key_of(0))
        stats = store.stats()["tiers"][1]
        assert stats["refused_writes"] == 10 and stats["refused_deletes"] == 1
        assert await tier.contains(key_of(0))
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    # One line as the first refusal happens, one summary per interval for the rest (put
    # and delete are separate kinds): never one line per block.
    assert 2 <= len(refused) <= 4, refused
    assert any("opened read-only" in r.getMessage() for r in caplog.records)
    assert _files(read_only_dir) == before


async def test_probe_require_refuses_a_read_only_location(read_only_dir: Path) -> None:
    with pytest.raises(ConfigError, match="write probe failed"):
        await open_store([f"file://{read_only_dir}?probe=require"])


async def test_unreadable_location_is_still_a_config_error(read_only_dir: Path) -> None:
    missing = read_only_dir / "never-made"
    with pytest.raises(ConfigError, match="cannot be read either"):
        await open_store([f"file://{missing}"])


def test_kvtier_explain_on_a_read_only_location(read_only_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    before = _files(read_only_dir)
    code = main(["explain", f"file://{read_only_dir}", "--json",
                 "--key", key_of(0).hex(), "--key", key_of(99).hex()])
    out = capsys.readouterr().out
    assert code == 0, out
    found = json.loads(out)
    assert found[0]["hit_tier"] == 0 and found[1]["reason"] == "not_stored"
    assert _files(read_only_dir) == before


def test_kvtier_explain_writes_nothing(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    kv = tmp_path / "kv"
    _write_blocks(kv)
    before = _files(kv)
    assert main(["explain", f"file://{kv}", "--key", key_of(0).hex()]) == 0
    assert "HIT in tier 0" in capsys.readouterr().out
    assert _files(kv) == before  # no probe object, no use log


# One round on a scratch directory first: every module the run needs is imported before
# dropping privileges (the interpreter's own files may not be readable by nobody).
_AS_NOBODY = """
import asyncio, os, sys
from kvtier import open_store
from kvtier.testing.conformance import key_of, sample_block
async def run(path):
    async with open_store(["dram://?capacity=1MiB", f"file://{path}"]) as store:
        got = await store.get(key_of(0))
        await store.tiers[1].put(key_of(50), sample_block(50))
        s = store.stats()["tiers"][1]
        return got is not None, s.get("read_only"), s.get("refused_writes")
asyncio.run(run(sys.argv[2]))
os.setgid(65534); os.setuid(65534)
print(*asyncio.run(run(sys.argv[1])))
"""


@pytest.mark.slow
def test_0555_directory_of_another_owner(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the 0555 case runs as non-root in the read_only_dir fixture")
    base = Path("/tmp") / f"kvtier-ro-{os.getpid()}"  # tmp_path's parents are 0700
    kv = base / "kv"
    base.mkdir(mode=0o755)
    try:
        _write_blocks(kv)
        for sub in [kv, *kv.rglob("*")]:
            sub.chmod(0o555 if sub.is_dir() else 0o444)
        proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(kv), str(tmp_path / "w")],
                              cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120, check=False)
        if "Operation not permitted" in proc.stderr and "setuid" in proc.stderr:
            pytest.skip("cannot drop privileges here")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["True", "True", "1"], proc.stdout + proc.stderr
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
