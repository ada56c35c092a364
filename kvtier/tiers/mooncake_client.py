"""One Mooncake Store client per process and configuration, shared by the tiers that use it,
with a staging area registered once for the zero-copy calls.

A ``MooncakeDistributedStore`` mounts a segment, starts a transfer engine and takes a second
or two to close, so tiers that name the same master and settings share one client, counted
by reference; the last :meth:`MooncakeClient.release` closes it. Every method here blocks:
tiers call them through a worker thread.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import TierError

try:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"mooncake:// needs the Mooncake Store client: pip install 'kvtier[mooncake]' "
        f"(and on Debian/Ubuntu: apt-get install -y libibverbs1 librdmacm1 libnuma1): {exc}"
    ) from exc

__all__ = ["MooncakeClient", "MooncakeSettings", "StagingArena"]

#: Return codes of the Mooncake client that mean "no such object" (not an error).
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600


@dataclass(frozen=True)
class MooncakeSettings:
    """What identifies a client: tiers with equal settings share one."""

    master: str
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    devices: str = ""
    segment: int = 0
    local_buffer: int = 64 << 20
    staging: int = 64 << 20
    local_host: str = ""

    def host(self) -> str:
        if self.local_host:
            return self.local_host
        return os.environ.get("MC_TCP_BIND_ADDRESS") or socket.gethostbyname(socket.gethostname())


class StagingArena:
    """First-fit allocator over one registered ``uint8`` area (thread-safe).

    ``alloc`` returns ``None`` when no free run is large enough; callers fall back to the
    copying calls. Offsets are 64-byte aligned.
    """

    _ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.buffer: npt.NDArray[np.uint8] = np.zeros(nbytes, dtype=np.uint8)
        self.base = int(self.buffer.ctypes.data)
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // self._ALIGN) * self._ALIGN
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (start + size, length - size)
                    return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // self._ALIGN) * self._ALIGN
        with self._lock:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        """Bytes not lent out (in runs of any size)."""
        with self._lock:
            return sum(length for _, length in self._free)

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        return self.buffer[offset:offset + nbytes]


class MooncakeClient:
    """A set-up ``MooncakeDistributedStore`` plus its registered staging arena."""

    _shared: dict[MooncakeSettings, MooncakeClient] = {}
    _shared_lock = threading.Lock()

    def __init__(self, settings: MooncakeSettings, probe_timeout: float = 2.0) -> None:
        self.settings = settings
        # setup() holds the GIL while it retries a dead master (90 s here), freezing every
        # thread and the event loop: refuse quickly when nothing listens there.
        host, _, port = settings.master.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), probe_timeout).close()
        except OSError as exc:
            raise TierError(f"mooncake: master {settings.master} unreachable: {exc}") from exc
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(settings.host(), settings.metadata, settings.segment,
                              settings.local_buffer, settings.protocol, settings.devices,
                              settings.master)
        if rc != 0:
            raise TierError(f"mooncake: setup against master {settings.master} failed "
                            f"(rc={rc}); is mooncake_master running there?")
        self.staging = StagingArena(settings.staging)
        if settings.staging:
            rc = self.store.register_buffer(self.staging.base, settings.staging)
            if rc != 0:
                self.store.close()
                raise TierError(f"mooncake: register_buffer of the staging area failed (rc={rc})")
        self.refs = 0

    @classmethod
    def acquire(cls, settings: MooncakeSettings, probe_timeout: float = 2.0) -> MooncakeClient:
        """The process's client for ``settings``, set up on first use (blocks)."""
        with cls._shared_lock:
            client = cls._shared.get(settings)
            if client is None:
                client = cls._shared[settings] = cls(settings, probe_timeout)
            client.refs += 1
            return client

    def release(self) -> None:
        """Drop one reference; the last one unregisters the staging area and closes (blocks)."""
        with self._shared_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            del self._shared[self.settings]
        if self.settings.staging:
            self.store.unregister_buffer(self.staging.base)
        self.store.close()

    @staticmethod
    def replicate_config(replicas: int) -> Any:
        config = ReplicateConfig()
        config.replica_num = replicas
        return config
