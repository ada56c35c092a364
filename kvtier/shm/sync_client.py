"""A synchronous client of the host daemon, for threads that run no event loop.

An engine worker (the vLLM connector's) calls the daemon from its own thread and its save
thread: no loop thread of its own, no hop between threads per call. HTTP/1.1 through the
standard library's ``http.client`` over the daemon's Unix socket (the same messages as
:mod:`kvtier.shm.client`), one keep-alive connection per calling thread.
"""

from __future__ import annotations

import http.client
import mmap
import socket
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import ProtocolError, TierError
from kvtier.shm import protocol as p
from kvtier.shm.client import map_announced
from kvtier.shm.files import socket_path
from kvtier.shm.index import IndexReader, open_announced

__all__ = ["SyncLocalClient"]


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("kvtier", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class SyncLocalClient:
    """The daemon called ``name``, from any thread.

    Parameters
    ----------
    name
        The daemon's ``--shm`` name.
    timeout
        Seconds one call may take (a retry on a fresh connection included).

    Concurrency: :meth:`call` may run on several threads at once (each has its own
    connection); :meth:`ensure` serialises re-mapping under a lock.
    """

    def __init__(self, name: str, *, timeout: float) -> None:
        self.name = name
        self.path = str(socket_path(name))
        self.timeout = timeout
        self.info: dict[str, Any] | None = None
        # (instance, its arena, its lease ttl), replaced as one (see arena()): a thread
        # reading slots of one instance never takes another instance's arena, which another
        # thread mapped meanwhile.
        self._mapped: tuple[str, npt.NDArray[np.uint8], float] | None = None
        self._map: mmap.mmap | None = None
        #: The daemon's shared presence index (``None``: not mapped, ask the socket).
        self.index: IndexReader | None = None
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def instance(self) -> str | None:
        """The arena instance mapped (``None`` before the first :meth:`ensure`)."""
        return None if self.info is None else str(self.info["instance"])

    def call(self, path: str, msg: dict[str, Any] | None = None, *,
             timeout: float | None = None) -> dict[str, Any]:
        """One request (``GET`` without ``msg``); the answer, within ``timeout`` seconds
        (default and at most: the client's).

        Raises
        ------
        TierError
            If the daemon is absent, refused, answered an error or missed the deadline.
        """
        limit = self.timeout if timeout is None else min(timeout, self.timeout)
        deadline = time.monotonic() + limit
        if msg is not None:
            msg["deadline"] = deadline
        body = None if msg is None else p.dump(msg)
        for attempt in (0, 1):
            conn: _UnixConnection | None = getattr(self._local, "conn", None)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if conn is None:
                conn = self._local.conn = _UnixConnection(self.path, left)
            elif conn.sock is not None:
                conn.sock.settimeout(left)
            try:
                if body is None:
                    conn.request("GET", path)
                else:
                    conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except TimeoutError:
                self._drop()
                break
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                if attempt:
                    raise TierError(f"local://{self.name}: daemon unreachable at "
                                    f"{self.path}: {exc}") from None
                continue
            if resp.status != 200:
                raise TierError(f"local://{self.name}: {path} answered {resp.status}: "
                                f"{data[:200].decode(errors='replace')}")
            try:
                return p.load(data)
            except ProtocolError as exc:
                raise TierError(f"local://{self.name}: {exc}") from None
        raise TierError(f"local://{self.name}: no answer to {path} within {limit} s")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def ensure(self, instance: object = None) -> bool:
        """Map the daemon's arena if ``instance`` (``None``: whatever it runs now) is not the
        one mapped; whether slots of ``instance`` can now be read.

        Raises
        ------
        TierError
            If the daemon does not answer or its arena cannot be mapped.
        """
        if instance is not None and instance == self.instance:
            return True
        with self._lock:
            if instance is None or instance != self.instance:
                info = self.call("/v1/info")
                if info.get("instance") != self.instance:
                    self._map, buffer = map_announced(self.name, info)
                    self.index = open_announced(info)
                    self.info = info
                    ttl = info.get("lease_ttl")
                    self._mapped = (str(info["instance"]), buffer,
                                    float(ttl) if isinstance(ttl, int | float) else 0.0)
        return instance is None or instance == self.instance

    def arena(self, instance: object) -> tuple[npt.NDArray[np.uint8], float] | None:
        """The arena of ``instance`` and its lease time bound (seconds), if it is the one
        mapped (:meth:`ensure` first); ``None`` otherwise."""
        mapped = self._mapped
        if mapped is None or mapped[0] != instance:
            return None
        return mapped[1], mapped[2]

    def present_many(self, keys: list[bytes]) -> list[bool] | None:
        """Which ``keys`` the daemon's index holds, with no call on the socket (one when
        nothing is mapped yet or the index file was unlinked: the daemon restarted);
        ``None`` if the daemon announced no index.

        Raises
        ------
        TierError
            If a remap is needed and the daemon does not answer.
        """
        index = self.index
        if self.info is None or (index is not None and index.stale()):
            self.ensure()
            index = self.index
        return None if index is None else index.present_many(keys)

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        self._drop()
