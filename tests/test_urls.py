"""Tier URL parsing and the option values URLs carry."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError, KVTierError
from kvtier.urls import (
    TierURL,
    merge_options,
    parse_bool,
    parse_number,
    parse_secret,
    parse_size,
    parse_tier_url,
)

KIB, MIB, GIB, TIB, PIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50


@pytest.mark.parametrize(("text", "expected"), [
    (0, 0), (4096, 4096), ("0", 0), ("4096", 4096), ("4096B", 4096), ("1b", 1),
    ("8GiB", 8 * GIB), ("8gib", 8 * GIB), ("8G", 8 * GIB), ("8g", 8 * GIB), ("8GB", 8 * 10**9),
    ("500MB", 500 * 10**6), ("500MiB", 500 * MIB), ("64K", 64 * KIB), ("64KiB", 64 * KIB),
    ("64kb", 64_000), ("2TiB", 2 * TIB), ("2TB", 2 * 10**12), ("1P", PIB), ("1PB", 10**15),
    ("1.5G", 3 * GIB // 2), ("1.5GiB", 3 * GIB // 2), ("0.5KB", 500), (" 8 GiB ", 8 * GIB),
    ("1024M", GIB), ("9" * 30, int("9" * 30)),
])
def test_parse_size_valid(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected
    assert type(parse_size(text)) is int


@pytest.mark.parametrize("value", [
    "8QB", "-1", -1, "abc", "1.5.2GiB", True, False, None, 1.5, "", " ", "GiB", "1e3",
    "1,000", "inf", "nan", "1 0GiB", "8 Gi B", "0x10", "8GiBs", ".5G", "5.G", "+5",
    "1" * 400 + ".5GiB", "9" * 5000, b"8GiB", [8],
])
def test_parse_size_invalid(value: object) -> None:
    with pytest.raises(ConfigError, match="my_option"):
        parse_size(value, "my_option")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity"):  # ConfigError is a ValueError too
        parse_size(value)  # type: ignore[arg-type]


def test_parse_size_unknown_unit_lists_known_units() -> None:
    with pytest.raises(ConfigError, match=r"unknown unit 'QB'.*GiB"):
        parse_size("8QB")


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("On", True), (" on ", True),
    (True, True), (1, True), ("0", False), ("false", False), ("No", False), ("off", False),
    (False, False), (0, False),
])
def test_parse_bool(value: str | bool | int, expected: bool) -> None:
    assert parse_bool(value, "flag") is expected


@pytest.mark.parametrize("value", ["maybe", "", "2", 2, -1, "truee", None, "y", "n"])
def test_parse_bool_invalid(value: object) -> None:
    with pytest.raises(ConfigError, match="verify"):
        parse_bool(value, "verify")  # type: ignore[arg-type]


def test_parse_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_secret("s3cr3t", "token") == "s3cr3t"
    monkeypatch.setenv("KVTIER_TEST_TOKEN", "from-env")
    assert parse_secret("env:KVTIER_TEST_TOKEN", "token") == "from-env"
    path = tmp_path / "token.txt"
    path.write_text("from-file\n", encoding="utf-8")
    assert parse_secret(f"file:{path}", "token") == "from-file"


def test_parse_secret_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TEST_ABSENT", raising=False)
    with pytest.raises(ConfigError, match=r"token: environment variable 'KVTIER_TEST_ABSENT'"):
        parse_secret("env:KVTIER_TEST_ABSENT", "token")
    with pytest.raises(ConfigError, match="token: cannot read secret file"):
        parse_secret(f"file:{tmp_path / 'absent'}", "token")
    with pytest.raises(ConfigError, match="token: cannot read secret file"):
        parse_secret(f"file:{tmp_path}", "token")  # a directory
    with pytest.raises(ConfigError, match="token"):
        parse_secret(None, "token")  # type: ignore[arg-type]


def test_parse_tier_url() -> None:
    url = "LMDB://user@host:1/a/b?capacity=1GiB&flag=&path=%2Ftmp%2Fx"
    parsed = parse_tier_url(url)
    assert parsed == TierURL(url=url, scheme="lmdb", netloc="user@host:1", path="/a/b",
                             params={"capacity": "1GiB", "flag": "", "path": "/tmp/x"})
    assert parse_tier_url("dram://") == TierURL("dram://", "dram", "", "", {})
    assert parse_tier_url("lmdb:///nvme/kv").path == "/nvme/kv"
    peers = parse_tier_url("peers://10.0.0.1:7070,10.0.0.2:7070?replicas=2")
    assert peers.netloc == "10.0.0.1:7070,10.0.0.2:7070" and peers.params == {"replicas": "2"}
    assert parse_tier_url("peers+dns://kv.svc:7070").scheme == "peers+dns"


@pytest.mark.parametrize(("url", "match"), [
    ("dram://?capacity=1GiB&capacity=2GiB", "'capacity' given twice"),
    ("dram", "no scheme"), ("/tmp/kv", "no scheme"), ("capacity=8GiB", "no scheme"),
    ("://x", "no scheme"), ("", "no scheme"), ("peers://[::1?x=1", "cannot parse"),
    (None, "expected str"), (b"dram://", "expected str"),
])
def test_parse_tier_url_invalid(url: object, match: str) -> None:
    with pytest.raises(ConfigError, match=f"url: .*{match}|url: {match}"):
        parse_tier_url(url)  # type: ignore[arg-type]


def test_merge_options() -> None:
    parsed = parse_tier_url("dram://?capacity=1GiB&name=a")
    merged = merge_options(parsed, {"capacity": 4096}, {"capacity", "name", "pin"})
    assert merged == {"capacity": 4096, "name": "a"}  # keywords win over the URL
    assert parsed.params == {"capacity": "1GiB", "name": "a"}  # parsed URL untouched


def test_merge_options_unknown() -> None:
    parsed = parse_tier_url("dram://?capacty=1GiB")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) bogus, capacty for dram://"
                                          r" \(allowed: capacity, name\)") as info:
        merge_options(parsed, {"bogus": 1}, {"capacity", "name"})
    assert isinstance(info.value, KVTierError)
    with pytest.raises(ConfigError, match="allowed: none"):
        merge_options(parse_tier_url("x://?a=1"), {}, set())


@pytest.mark.parametrize(("value", "cast", "low", "expected"), [
    ("3", int, 1, 3), (" 2 ", int, 0, 2), ("0.5", float, 0.001, 0.5), (7, int, 7, 7),
    ("inf", float, 0, float("inf")),
])
def test_parse_number_valid(value: object, cast: type, low: float, expected: float) -> None:
    assert parse_number(value, "opt", cast, low) == expected


@pytest.mark.parametrize(("value", "cast", "low", "message"), [
    ("x", int, 1, "expected an integer"), ("1.5", int, 1, "expected an integer"),
    ("soon", float, 0, "expected a number"), ("0", int, 1, "expected >= 1"),
    ("nan", float, 0, "expected >= 0"), ("-0.1", float, 0, "expected >= 0"),
])
def test_parse_number_invalid(value: object, cast: type, low: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_number(value, "opt", cast, low)
