"""``kvtier serve``'s resource-guard flags reach its PeerServer: ``--max-connections``,
``--idle-timeout``, ``--max-inflight`` and ``--body-timeout`` on a real server process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.cli import main
from tests.helpers.peer_helpers import TOKEN, ServeProcess, token_file

_AUTH = f"Authorization: Bearer {TOKEN}\r\n"


def _put_head(key: bytes, length: int) -> bytes:
    return (f"PUT /v1/blocks/{key.hex()} HTTP/1.1\r\nHost: x\r\n{_AUTH}"
            f"Content-Length: {length}\r\n\r\n").encode()


async def _open(member: str, data: bytes = b"") -> tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]:
    host, port = member.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def _served(member: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection the server serves: one it refuses at the cap answers at once (the cap
    may still count a connection the server has just closed), so retry those."""
    for _ in range(50):
        reader, writer = await _open(member)
        try:
            refused = await asyncio.wait_for(reader.read(), 0.3)
        except TimeoutError:
            return reader, writer
        writer.close()
        assert b"too many connections" in refused, refused
    raise AssertionError("no connection served below the cap")


@pytest.mark.slow
async def test_guard_flags_reach_the_server(tmp_path: Path) -> None:
    # Defaults are 15 s idle, 10 s body, 4096 connections, 1 GiB in flight: each step below
    # would pass or hang differently under them.
    proc = ServeProcess(["--tier", "dram://", "--max-block-bytes", "1MiB", "--max-body", "2MiB",
                         "--max-inflight", "2MiB", "--max-connections", "2",
                         "--idle-timeout", "1", "--body-timeout", "3",
                         # The held body must stall on --body-timeout, not the rate floor.
                         "--min-body-rate", "0"], token_file(tmp_path))
    member = await asyncio.to_thread(proc.start)
    writers: list[asyncio.StreamWriter] = []
    try:
        held_r, held_w = await _open(member, _put_head(b"\x01", 1 << 20) + b"x" * 100)
        idle_r, idle_w = await _open(member)
        writers += [held_w, idle_w]
        # A third connection is past --max-connections 2.
        third_r, third_w = await _open(member)
        writers.append(third_w)
        assert (await asyncio.wait_for(third_r.read(), 20)).startswith(b"HTTP/1.1 503")
        # The idle connection is closed after --idle-timeout 1 s, well before 15 s.
        assert await asyncio.wait_for(idle_r.read(), 10) == b""
        # The held body reserved 1 MiB of --max-inflight 2 MiB: a second such body is busy.
        busy_r, busy_w = await _served(member)
        writers.append(busy_w)
        # Head only: body bytes the server never reads would make its close a reset.
        busy_w.write(_put_head(b"\x02", (1 << 20) + 8))
        answer = await asyncio.wait_for(busy_r.read(), 20)  # closed after lingering 1 s
        assert answer.startswith(b"HTTP/1.1 503") and b"server busy" in answer, answer
        # The held body stalls: 408 on --body-timeout 3 s, not the default 10 s (the answer
        # names the timeout it applied; a wall-clock bound would fail on a loaded box).
        answer = await asyncio.wait_for(held_r.read(), 20)
        assert answer.startswith(b"HTTP/1.1 408") and b"no body bytes for 3.0 s" in answer, \
            answer
    finally:
        for writer in writers:
            writer.close()
        await asyncio.to_thread(proc.stop)


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-inflight", "1MiB"], "max_inflight_bytes: expected >= max_body_bytes"),
    (["--max-inflight", "lots"], "--max-inflight"),
    (["--repair-reserve", "1GiB"], "repair_reserve_bytes: expected 0 to max_inflight_bytes"),
    (["--body-timeout", "0"], "body_timeout: expected > 0 seconds"),
    (["--max-connections", "0"], "max_connections: expected >= 1"),
])
def test_bad_guard_flags_exit_2_with_a_clear_error(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--listen", "127.0.0.1:0", "--tier", "dram://", "--insecure-no-auth"]
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().out
