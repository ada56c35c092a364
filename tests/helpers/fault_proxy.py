"""A TCP proxy in front of one peer that can pass, slow down or partition its traffic.

``mode`` is read for every chunk, so a fault starts (and heals) on open connections too:

- ``pass``: bytes go through;
- ``slow``: every chunk from the peer waits ``delay`` seconds first;
- ``partition``: nothing goes through in either direction (connections stay open, as
  behind a dropped route), until the mode changes.
"""

from __future__ import annotations

import asyncio
import contextlib


class FaultProxy:
    """Listens on 127.0.0.1 (port 0) and forwards to ``upstream`` (``host:port``)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self.mode = "pass"
        self.delay = 0.0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._healed = asyncio.Event()
        self._healed.set()

    @property
    def member(self) -> str:
        """The proxy's address, as a member id."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    def set(self, mode: str, delay: float = 0.0) -> None:
        """Change the fault (``pass``, ``slow`` with ``delay``, ``partition``)."""
        self.mode, self.delay = mode, delay
        if mode == "partition":
            self._healed.clear()
        else:
            self._healed.set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.member

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            except OSError:
                writer.close()
                return
            await asyncio.gather(self._pipe(reader, up_writer, slow=False),
                                 self._pipe(up_reader, writer, slow=True),
                                 return_exceptions=True)
            for w in (writer, up_writer):
                w.close()
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *,
                    slow: bool) -> None:
        try:
            while chunk := await src.read(1 << 16):
                await self._healed.wait()
                if slow and self.mode == "slow":
                    await asyncio.sleep(self.delay)
                dst.write(chunk)
                await dst.drain()
        finally:
            dst.close()
