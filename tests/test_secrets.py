"""Secrets in tier URLs never reach error messages, reprs, logs or command output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.errors import ConfigError, KVTierError, PeerError
from kvtier.store import open_store
from kvtier.tiers.registry import tier_from_url
from tests.helpers.peer_helpers import REPO

SECRET = "hunter2-literal-secret"

BAD_URLS = [
    f"peers://?token={SECRET}",                          # no peers
    f"peers://h1:7070/path?token={SECRET}",              # takes no path
    f"peers://h1:notaport?token={SECRET}",               # bad member
    f"peers://h1:7070?token={SECRET}&replicas=zero",     # bad number
    f"peers+dns://a:1,b:2?token={SECRET}",               # one name only
    f"peers://h1:7070?token={SECRET}&ack=most",          # bad choice
    f"peers://h1:7070?token={SECRET}&token={SECRET}",    # option given twice
    f"nosuch://host?token={SECRET}",                     # unknown scheme
    f"s3://user:{SECRET}@bucket/prefix?capacity=lots",   # password in user info
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_config_errors_never_show_a_literal_secret(url: str) -> None:
    with pytest.raises(ConfigError) as raised:
        tier_from_url(url)
    assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)


@pytest.mark.parametrize("url", BAD_URLS[:3])
async def test_open_store_errors_never_show_a_literal_secret(url: str) -> None:
    with pytest.raises(ConfigError) as raised:
        await open_store(["dram://", url])
    assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)


def test_every_kvtier_error_masks_token_values() -> None:
    for exc in (KVTierError(f"x ?token={SECRET}&a=1"), PeerError(f"Bearer {SECRET}"),
                ConfigError(f"url 'redis://u:{SECRET}@h:6379/0'")):
        assert SECRET not in str(exc) and SECRET not in repr(exc)
        assert "***" in str(exc)
    assert str(KVTierError("peer 10.0.0.1:7070: GET -> 404")) == "peer 10.0.0.1:7070: GET -> 404"


def test_kvtier_gc_never_echoes_a_secret() -> None:
    url = f"memory://kvtier-gc-secret?token={SECRET}"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "gc", url, "--capacity", "1GiB",
                           "--dry-run"], cwd=REPO, env={"PYTHONPATH": str(REPO),
                                                        "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert "would delete 0 files" in proc.stdout, proc.stdout + proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
