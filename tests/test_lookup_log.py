"""The lookup hash log (store option ``lookup_log``): one JSON line per ``lookup_prefix``
with its keys, result and namespace, rotated by size; ``kvtier explain --log A --log B``
names the namespace fields in which two instances hashing the same prompts differ."""
# The tests read the log files directly from async code, on purpose.
# ruff: noqa: ASYNC240

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier import BlockingStore, KeyNamespace, open_store, prefix_keys
from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.keys import PrefixKeys
from kvtier.lookuplog import diff_logs, log_files, open_lookup_log, read_log
from kvtier.testing.conformance import sample_block

PROMPTS = [list(range(p * 1000, p * 1000 + 64)) for p in range(4)]
WRITER = KeyNamespace(model="llama-3.1-8b", dtype="bf16")


async def _instance(path: Path, name: str, ns: KeyNamespace, block: int,
                    put: bool) -> list[int]:
    """A store that (optionally) saves the prompts' blocks, then looks each prompt up."""
    async with open_store(["dram://?capacity=16MiB"], lookup_log=f"{path}?instance={name}",
                          node=name) as store:
        hits = []
        for tokens in PROMPTS:
            keys = prefix_keys(tokens, block, ns)
            if put:
                await store.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
            hits.append(await store.lookup_prefix(keys))
        return hits


def test_prefix_keys_is_a_list_that_remembers_its_namespace() -> None:
    keys = prefix_keys(list(range(40)), 16, WRITER)
    assert isinstance(keys, list) and isinstance(keys, PrefixKeys) and len(keys) == 2
    assert keys == list(keys) and type(keys[:1]) is list
    other = prefix_keys(list(range(40)), 8, KeyNamespace(model="other"))
    # The prompt digests ignore the namespace and the block size: 16 tokens are 16 tokens.
    assert keys.prefix_digests()[0] == other.prefix_digests()[1]
    assert keys.prefix_digests()[0] != other.prefix_digests()[0]


async def test_each_lookup_is_one_line_with_keys_result_and_namespace(tmp_path: Path) -> None:
    log = tmp_path / "a.jsonl"
    assert await _instance(log, "a", WRITER, 16, put=True) == [4, 4, 4, 4]
    lines = read_log([str(log)])
    assert len(lines) == 4
    first = lines[0]
    assert first["instance"] == "a" and first["hit"] == 4 and len(first["keys"]) == 4
    assert first["keys"][0] == prefix_keys(PROMPTS[0], 16, WRITER)[0].hex()
    assert first["namespace"]["model"] == "llama-3.1-8b" and first["block_tokens"] == 16
    assert len(first["prompt"]) == 4


@pytest.mark.parametrize(("reader", "block", "fields"), [
    (KeyNamespace(model="llama-3.1-8b", dtype="fp16"), 16, ["dtype"]),
    (KeyNamespace(model="llama-3.1-8b", dtype="bf16", salt="tenant-1"), 16, ["salt"]),
    (KeyNamespace(model="llama-3.1-8B", dtype="bf16", tp_size=2), 16, ["model", "tp_size"]),
    (WRITER, 32, ["block_tokens"]),
])
async def test_two_logs_name_the_fields_that_differ(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], reader: KeyNamespace, block: int,
        fields: list[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    await _instance(a, "engine-a", WRITER, 16, put=True)
    assert await _instance(b, "engine-b", reader, block, put=False) == [0, 0, 0, 0]
    found = diff_logs(read_log([str(a)]), read_log([str(b)]))
    assert found.shared > 0 and found.same == 0
    assert sorted(found.fields) == sorted(fields)
    assert main(["explain", "--log", str(a), "--log", str(b)]) == 0
    out = capsys.readouterr().out
    assert "engine-b hashes" in out and "differently from engine-a" in out
    for name in fields:
        assert f"{name} differs" in out
    assert "tenant-1" not in out  # the salt is logged as a digest only


async def test_same_namespace_hashes_alike(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    await _instance(a, "a", WRITER, 16, put=True)
    await _instance(b, "b", WRITER, 16, put=False)
    assert main(["explain", "--log", str(a), "--log", str(b)]) == 0
    out = capsys.readouterr().out
    assert "hash alike" in out and "the namespaces agree" in out
    assert main(["explain", "--log", str(a)]) == 0
    assert "a: 4 lookups, 4 found at least one block" in capsys.readouterr().out


async def test_log_rotates_and_rotated_files_are_read(tmp_path: Path) -> None:
    log = tmp_path / "r.jsonl"
    async with open_store(["dram://"], lookup_log=f"{log}?max_bytes=2KiB&backups=2") as store:
        for p in range(40):
            await store.lookup_prefix(prefix_keys(list(range(p, p + 64)), 16, WRITER))
    files = log_files(str(log))
    assert files == [f"{log}.2", f"{log}.1", str(log)]
    assert all(Path(f).stat().st_size <= 2048 + 1024 for f in files)
    assert 0 < len(read_log(files)) < 40  # the oldest rotated away


def test_blocking_store_and_plain_keys(tmp_path: Path) -> None:
    log = tmp_path / "s.jsonl"
    with BlockingStore(["dram://"], lookup_log=str(log)) as store:
        assert store.lookup_prefix(prefix_keys(PROMPTS[0], 16, WRITER)) == 0
        assert store.lookup_prefix([b"k" * 16]) == 0
    lines = [json.loads(t) for t in log.read_text().splitlines()]
    assert "namespace" in lines[0] and "namespace" not in lines[1]
    assert lines[1]["keys"] == [(b"k" * 16).hex()]


def test_bad_options_and_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="unknown option 'size'"):
        open_lookup_log(f"{tmp_path}/x?size=1")
    with pytest.raises(ConfigError, match="cannot open"):
        open_lookup_log(f"{tmp_path}/missing-dir/x.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["explain", "--log", str(bad)]) == 2
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().out
    assert main(["explain", "dram://", "--log", str(bad)]) == 2
