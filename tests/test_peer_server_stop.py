"""A stopped PeerServer answers nothing more: a connection accepted while it stops (the
kernel's backlog, or a protocol made before the listener closed and connected after) is
closed, never left serving from a closed segment. A client's pooled keep-alive connection to
such a server otherwise kept reaching the stopped server after a new one took its port: its
health answers carried the old uptime, so the restart was never noticed, and its requests got
503 ``tier 'dram' is closed``."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvtier.peer.server import PeerServer
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN


async def _answer(sock: socket.socket) -> bytes:
    """Send a health request over ``sock``; what comes back before it closes (b"": none)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    try:
        await loop.sock_sendall(sock, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n"
                                      b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
    except OSError:
        return b""
    try:
        async with asyncio.timeout(5):
            return await loop.sock_recv(sock, 4096)
    except (OSError, TimeoutError):
        return b""


@pytest.mark.parametrize("data_plane", [True, False])
async def test_a_connection_made_while_the_server_stops_is_closed(data_plane: bool) -> None:
    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True, data_plane=data_plane)
    await server.start()
    loop = asyncio.get_running_loop()
    # A connection being served holds stop() in its grace wait: the window in which an
    # accepted connection's protocol can still be made.
    held, peer = socket.socketpair()
    await loop.connect_accepted_socket(server._protocol, held)
    stopping = asyncio.ensure_future(server.stop())
    await asyncio.sleep(0)  # stop() has closed the listener and waits on the connections
    late, late_peer = socket.socketpair()
    await loop.connect_accepted_socket(server._protocol, late)  # accepted before the close
    await stopping
    try:
        answer = await _answer(late_peer)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), \
            f"a stopped server still answers: {answer[:40]!r}"
    finally:
        for s in (peer, late_peer):
            s.close()
