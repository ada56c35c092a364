"""A real S3-compatible server for tests: moto in server mode on 127.0.0.1, random port."""

from __future__ import annotations

import os
import urllib.request
import uuid
from collections.abc import Iterator

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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """Start ``moto.server.ThreadedMotoServer`` on loopback port 0 for the session."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Endpoint(f"http://{host}:{port}")
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
