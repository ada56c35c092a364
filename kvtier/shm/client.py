"""The engine's side of ``local://NAME``: the daemon's control socket and its mapped arena.

One aiohttp session over the daemon's Unix socket, and one shared mapping of the arena the
daemon announces at ``/v1/info``. Every call has a deadline (``timeout`` seconds), sent
along so a daemon that was stopped and resumes lends nothing to a request its engine gave
up on. A connection that fails is retried once at once (a keep-alive connection to a
daemon that restarted fails on first use), then the call fails with
:class:`~kvtier.errors.TierError`.

Concurrency: one event loop; :attr:`buffer` may be read and written by any thread while the
client is open (it is the arena's memory; leases decide which slots are whose).
"""

from __future__ import annotations

import asyncio
import mmap
import threading
import time
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from kvtier.errors import TierError
from kvtier.shm import protocol as p
from kvtier.shm.files import map_arena, socket_path
from kvtier.shm.index import IndexReader, open_announced
from kvtier.tiers.dram_arena import populate

__all__ = ["LocalClient", "map_announced"]


def _map_in(buffer: npt.NDArray[np.uint8], chunk: int = 2 << 20) -> None:
    # Small chunks: each madvise holds this process's mmap lock, which a malloc that maps or
    # unmaps memory then waits for (64 MiB chunks made the first control calls 25 ms).
    for start in range(0, buffer.nbytes, chunk):
        if not populate(buffer[start:start + chunk]):
            return


def map_announced(name: str, info: dict[str, Any]) -> tuple[mmap.mmap, npt.NDArray[np.uint8]]:
    """Map the arena a daemon's ``/v1/info`` announced; the mapping and its ``uint8`` view.

    This process's page tables for it are filled in the background: a first hit of 256 MiB
    otherwise pays 65,536 page faults, about as long as its copy.

    Raises
    ------
    TierError
        If the arena cannot be mapped.
    """
    try:
        mapping = map_arena(str(info["path"]), int(info["nbytes"]))
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise TierError(f"local://{name}: cannot map the daemon's arena: {exc}") from None
    buffer = np.frombuffer(mapping, np.uint8)
    threading.Thread(target=_map_in, args=(buffer,), name="kvtier-local-map-in",
                     daemon=True).start()
    return mapping, buffer


class LocalClient:
    """Talk to the daemon called ``name``.

    Parameters
    ----------
    name
        The daemon's ``--shm`` name.
    timeout
        Seconds one call may take, a retry included.
    """

    def __init__(self, name: str, *, timeout: float) -> None:
        self.name = name
        self.path = socket_path(name)
        self.timeout = timeout
        self.info: dict[str, Any] | None = None
        self.used = 0
        #: The mapped arena as one ``uint8`` array (``None`` before :meth:`attach`).
        self.buffer: npt.NDArray[np.uint8] | None = None
        self._map: mmap.mmap | None = None
        #: The daemon's shared presence index (``None``: not mapped, ask the socket).
        self.index: IndexReader | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def instance(self) -> str | None:
        """The arena instance this client maps (a restarted daemon has a new one)."""
        return None if self.info is None else str(self.info["instance"])

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(self.path), limit=64),
                skip_auto_headers=("User-Agent",))
        return self._session

    async def call(self, path: str, msg: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request (``GET`` without ``msg``); the answer.

        Raises
        ------
        TierError
            If the daemon is absent, refused, answered an error or missed the deadline.
        """
        deadline = time.monotonic() + self.timeout
        if msg is not None:
            msg["deadline"] = deadline
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    return await self._once(path, msg)
            except TimeoutError:
                raise TierError(f"local://{self.name}: no answer to {path} within "
                                f"{self.timeout} s") from None
            except (aiohttp.ClientConnectionError, OSError) as exc:
                self.info = None  # it may come back as a new instance
                if attempt or time.monotonic() >= deadline:
                    raise TierError(f"local://{self.name}: daemon unreachable at "
                                    f"{self.path}: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(self, path: str, msg: dict[str, Any] | None) -> dict[str, Any]:
        url = f"http://kvtier{path}"
        session = self._client()
        request = session.get(url) if msg is None else session.post(
            url, data=p.dump(msg), headers={"Content-Type": "application/json"})
        async with request as resp:
            body = await resp.read()
            if resp.status != 200:
                raise TierError(f"local://{self.name}: {path} answered {resp.status}: "
                                f"{body[:200].decode(errors='replace')}")
        answer = p.load(body)
        used = answer.get("used")
        if isinstance(used, int):
            self.used = used
        return answer

    async def attach(self) -> None:
        """Map the daemon's current arena (again, when it restarted).

        Raises
        ------
        TierError
            If the daemon does not answer or its arena cannot be mapped.
        """
        info = await self.call("/v1/info")
        if self.info is not None and info["instance"] == self.info["instance"]:
            return
        # The old mapping (a dead daemon's arena) stays alive while views of it exist.
        self._map, self.buffer = map_announced(self.name, info)
        self.index = open_announced(info)
        self.info = info

    async def present_many(self, keys: list[bytes]) -> list[bool] | None:
        """Which ``keys`` the daemon's index holds, with no call on the socket (one when the
        index file was unlinked: the daemon restarted, so its new one is mapped first);
        ``None`` if the daemon announced no index.

        Raises
        ------
        TierError
            If the index is stale and the daemon does not answer.
        """
        if self.info is None or (self.index is not None and self.index.stale()):
            self.info = None  # remap whatever the daemon runs now
            await self.attach()
        return None if self.index is None else self.index.present_many(keys)

    async def ensure(self, instance: object) -> bool:
        """Whether slots of arena ``instance`` can be read: it is mapped, or is once the
        client re-attached (the daemon restarted)."""
        if instance != self.instance:
            await self.attach()
        return instance == self.instance

    async def aclose(self) -> None:
        """Close the session; the mapping goes once no view of it is left."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.buffer = None
        self._map = None
        self.index = None
