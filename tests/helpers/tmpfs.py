"""A real small tmpfs for full-disk and read-only tests (root only; the test skips elsewhere)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount syntax, e.g. ``4m``) at ``mnt``; skip the test where
    mounting is not permitted; unmount (lazily) afterwards."""
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(mnt: Path) -> None:
    """Take the last free byte of the file system at ``mnt`` (one file, ``filler``)."""
    with open(mnt / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
