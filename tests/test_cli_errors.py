"""Every bad input to the ``kvtier`` CLI is one line naming the file or option, exit 2, never
a traceback (issue 22, items 3 and 6). The commands run in-process through
:func:`kvtier.cli.main`, on real sockets, files and directories."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay.sim import POLICIES


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("cli-errors-token")
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _one_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_serve_port_in_use(capsys: pytest.CaptureFixture[str], token: Path,
                           busy_port: int) -> None:
    line = _one_line(capsys, "serve", "--listen", f"127.0.0.1:{busy_port}", "--tier",
                     "dram://?capacity=1MiB", "--token-file", str(token))
    assert line.startswith("kvtier serve: --listen:") and str(busy_port) in line
    assert "address already in use" in line


def test_serve_unwritable_lmdb_directory(capsys: pytest.CaptureFixture[str], token: Path,
                                         tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    line = _one_line(capsys, "serve", "--listen", "127.0.0.1:0", "--tier",
                     f"lmdb://{tmp_path}/plain/lmdb", "--token-file", str(token))
    assert "kvtier serve: path:" in line and f"{tmp_path}/plain/lmdb" in line


def test_serve_missing_tls_cert_names_the_file(capsys: pytest.CaptureFixture[str],
                                               token: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.pem"
    line = _one_line(capsys, "serve", "--listen", "127.0.0.1:0", "--tier",
                     "dram://?capacity=1MiB", "--token-file", str(token), "--tls-cert",
                     str(missing))
    assert "tls_cert" in line and str(missing) in line


@pytest.mark.timeout(60)  # without the probe the server would start and serve forever
def test_serve_unwritable_file_tier(capsys: pytest.CaptureFixture[str], token: Path,
                                    tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    line = _one_line(capsys, "serve", "--listen", "127.0.0.1:0", "--tier",
                     "dram://?capacity=1MiB", "--tier", f"file://{tmp_path}/plain/kv",
                     "--token-file", str(token))
    assert "write probe failed" in line


def test_replay_missing_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "trace.jsonl"
    line = _one_line(capsys, "replay", str(missing), "--no-progress")
    assert line.startswith("kvtier replay: TRACE:") and str(missing) in line


def test_replay_unwritable_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "out.json"
    line = _one_line(capsys, "replay", "builtin:agentic", "--limit", "5", "--no-progress",
                     "--json", str(target))
    assert "--json" in line and str(target) in line


def test_replay_help_lists_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ",".join(POLICIES) in text and "arc" in POLICIES


def test_gc_missing_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _one_line(capsys, "gc", f"file://{tmp_path}/typo/dir", "--capacity", "1GiB")
    assert "no directory" in line and f"{tmp_path}/typo/dir" in line


def test_gc_existing_empty_directory_is_fine(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    assert main(["gc", f"file://{tmp_path}", "--capacity", "1GiB"]) == 0
    assert "deleted 0 files" in capsys.readouterr().out


def test_bench_unwritable_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _one_line(capsys, "bench", "--dir", str(tmp_path), "--json",
                     str(tmp_path / "no" / "out.json"))
    assert "--json" in line
