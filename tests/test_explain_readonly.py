"""``kvtier explain`` never writes (issue 31): for every tier scheme that has files
(``lmdb://``, ``file://``, and a chain of them under ``dram://``) the directory is byte for
byte the same afterwards, including a path that does not exist (nothing is created), a
``file://`` URL that asks for a fleet gc and a use log, and an ``lmdb://`` directory that a
running process owns (explain reads beside it instead of failing on its lock)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.testing.conformance import key_of
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.peer_helpers import REPO

BLOCK = np.arange(1024, dtype=np.uint16)


def listing(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``root``: size, mtime and content digest (directories: 0, mtime,
    "")."""
    out: dict[str, tuple[int, int, str]] = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, digest)
    return out


def write_lmdb(path: Path) -> None:
    async def fill() -> None:
        tier = LMDBTier(path, watch=0)
        await tier.open()
        await tier.put_many([(key_of(i), BLOCK) for i in range(3)])
        await tier.aclose()
    asyncio.run(fill())


def write_files(path: Path) -> None:
    async def fill() -> None:
        tier = FsspecTier(f"file://{path}", use_log=False, watch=0)
        await tier.open()
        await tier.put_many([(key_of(i), BLOCK) for i in range(3)])
        await tier.aclose()
    asyncio.run(fill())


def explain(urls: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["explain", *urls, "--json", "--key", key_of(0).hex(),
                 "--key", key_of(99).hex()])
    return code, capsys.readouterr().out


def test_a_missing_lmdb_path_is_an_error_and_nothing_is_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = listing(tmp_path)
    code, out = explain([f"lmdb://{tmp_path}/nope"], capsys)
    assert code == 1 and "no LMDB environment" in out, out
    assert listing(tmp_path) == before


@pytest.mark.parametrize("scheme", ["lmdb", "file", "chain"])
def test_explain_changes_no_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 scheme: str) -> None:
    urls = {
        "lmdb": [f"lmdb://{tmp_path}/db"],
        # A URL that would start a gc of the whole directory down to 1 byte, a use log and
        # a watch, were explain to open it as a serving tier does.
        "file": [f"file://{tmp_path}/files?fleet_capacity=1&gc_interval=0.01&use_log=1"],
        "chain": ["dram://?capacity=1MiB", f"lmdb://{tmp_path}/db?capacity=1MiB",
                  f"file://{tmp_path}/files"],
    }[scheme]
    if scheme != "file":
        write_lmdb(tmp_path / "db")
    if scheme != "lmdb":
        write_files(tmp_path / "files")
    before = listing(tmp_path)
    code, out = explain(urls, capsys)
    assert code == 0, out
    found = json.loads(out)
    assert found[0]["hit_tier"] == (1 if scheme == "chain" else 0), found
    assert found[1]["reason"] == "not_stored", found
    assert listing(tmp_path) == before


@pytest.mark.slow
def test_explain_reads_beside_the_process_that_owns_the_lmdb_directory(
        tmp_path: Path) -> None:
    async def run() -> subprocess.CompletedProcess[str]:
        owner = LMDBTier(tmp_path / "db", watch=0)
        await owner.open()
        try:
            await owner.put_many([(key_of(i), BLOCK) for i in range(3)])
            data = listing(tmp_path / "db")["data.mdb"]
            done = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "kvtier.cli", "explain",
                                 f"lmdb://{tmp_path}/db", "--json",
                                 "--key", key_of(0).hex(), "--key", key_of(99).hex()],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                text=True, timeout=120)
            assert listing(tmp_path / "db")["data.mdb"] == data  # the data is not written
            assert await owner.contains(key_of(0))  # and the owner goes on
            return done
        finally:
            await owner.aclose()

    done = asyncio.run(run())
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert found[0]["hit_tier"] == 0 and found[1]["reason"] == "not_stored"
