"""A real S3-compatible server for tests: moto in server mode on 127.0.0.1, random port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["S3Endpoint", "s3_endpoint"]


class S3Endpoint:
    """Where the moto server listens, and a helper to make fresh buckets."""

    def __init__(self, url: str) -> None:
        self.url = url

    def new_bucket(self) -> str:
        """Create an empty bucket with a unique name and return the name."""
        name = f"kvtier-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.url}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, response.status
        return name


def _start_moto(log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    # A child process rather than ThreadedMotoServer: the server then does not compete with
    # the tests' event loop for this process's GIL (3-4x faster S3 tests on 2 cores).
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(rb"Running on (http://127\.0\.0\.1:\d+)", log_path.read_bytes())
        if match:
            return proc, match.group(1).decode()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"moto server did not start: {log_path.read_text(errors='replace')}")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """Start a moto S3 server (``python -m moto.server``) on loopback port 0 for the session."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    proc, url = _start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield S3Endpoint(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
