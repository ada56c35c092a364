"""Pool membership: who the peers are (static list or DNS), which of them answer, and the ring.

A member that fails a request is taken out of the read and write paths at once; the health
loop probes every member each ``health_interval`` seconds and brings back those that answer.
With DNS membership the name is re-resolved every ``dns_interval`` seconds (A and AAAA, as for
a Kubernetes headless service) and the ring is rebuilt when the address set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.errors import ConfigError, KVTierError
from kvtier.peer.client import PeerClient
from kvtier.peer.ring import HashRing

__all__ = ["Membership", "member_id", "split_member"]

log = logging.getLogger("kvtier.peer.membership")


def split_member(member: str, name: str = "members", *, allow_zero: bool = False
                 ) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` into host and port (port 0 only if allowed)."""
    host, sep, port = member.rpartition(":")
    low = 0 if allow_zero else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) < 65536:
        raise ConfigError(f"{name}: expected host:port, got {member!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{name}: IPv6 addresses need brackets ([::1]:7070), got {member!r}")
    return host, int(port)


def member_id(host: str, port: int) -> str:
    """The member id of an address: ``host:port``, IPv6 in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Membership:
    """Members, their health, their clients and the ring over them.

    Parameters
    ----------
    members
        Static member ids, or ``None`` with ``dns`` set.
    dns
        ``(name, port)`` to resolve into members, re-resolved every ``dns_interval``.
    client_factory
        Builds the :class:`PeerClient` of a member.
    vnodes, replicas
        Ring settings.
    self_id
        This node's member id when its segment is used directly (never probed over HTTP).
    health_interval
        Seconds between health probes of every member.
    dns_interval
        Seconds between DNS re-resolutions.
    """

    def __init__(self, members: Iterable[str] | None, *, dns: tuple[str, int] | None,
                 client_factory: Callable[[str], PeerClient], vnodes: int, replicas: int,
                 self_id: str | None, health_interval: float, dns_interval: float) -> None:
        if (members is None) == (dns is None):
            raise ConfigError("members: give either a static member list or a DNS name")
        self._static = None if members is None else sorted(set(members))
        for m in self._static or ():
            split_member(m)
        if self._static is not None and not self._static:
            raise ConfigError("members: the peer list is empty")
        self._dns = dns
        self._factory = client_factory
        self.self_id = self_id
        self.health_interval = health_interval
        self.dns_interval = dns_interval
        self.ring = HashRing(self._static or [], vnodes=vnodes, replicas=replicas)
        # The key a block's owners are hashed by: its own key, or its chain's under chain
        # placement (set by the tier, see kvtier.peer.chains).
        self.placement_key: Callable[[bytes], bytes] = _own_key
        self.clients: dict[str, PeerClient] = {}
        self._dead: set[str] = set()
        self.health: dict[str, dict[str, Any]] = {}
        self.failures = 0
        self.recoveries = 0
        # (monotonic time, member) of every failure, recovery, join and leave this process saw:
        # the read path walks further while members have recently changed.
        self._changes: dict[str, float] = {}
        self.change_count = 0  # every change ever seen (anti-entropy skips quiet periods)
        self._task: asyncio.Task[None] | None = None
        self._since = time.monotonic()

    # ----------------------------------------------------------------- state
    @property
    def members(self) -> tuple[str, ...]:
        """Current member ids, sorted."""
        return self.ring.members

    def alive(self, member: str) -> bool:
        """Whether ``member`` is in the read/write path."""
        return member not in self._dead

    @property
    def dead(self) -> frozenset[str]:
        """Members currently out of the path."""
        return frozenset(self._dead)

    def mark_dead(self, member: str, reason: object) -> None:
        """Take ``member`` out of the path until a health probe succeeds."""
        if member == self.self_id or member in self._dead:
            return
        self._dead.add(member)
        self.failures += 1
        self._note_change(member)
        log.warning("peer %s marked down: %s", member, reason)

    def _mark_alive(self, member: str) -> None:
        if member in self._dead:
            self._dead.discard(member)
            self.recoveries += 1
            self._note_change(member)
            log.info("peer %s is back", member)

    def _note_change(self, member: str, at: float | None = None) -> None:
        self._changes[member] = time.monotonic() if at is None else at
        self.change_count += 1

    def recent_changes(self, window: float) -> int:
        """How many members failed, came back, restarted, joined or left in the last
        ``window`` seconds."""
        return len(self.recently_changed(window))

    def recently_changed(self, window: float) -> set[str]:
        """The members that failed, came back, restarted, joined or left in the last
        ``window`` seconds."""
        since = time.monotonic() - window
        return {m for m, at in self._changes.items() if at >= since}

    def order(self, key: bytes) -> list[str]:
        """Every member in ring order for ``key``'s placement key (primary first)."""
        return self.ring.owners(self.placement_key(key), len(self.ring))

    def owners_of(self, placement_key: bytes, n: int) -> list[str]:
        """The first ``n`` live members in ring order of a placement key (a block's own key,
        or its chain's: see :mod:`kvtier.peer.chains`)."""
        return [m for m in self.ring.owners(placement_key, len(self.ring))
                if m not in self._dead][:n]

    def live_owners(self, key: bytes, n: int) -> list[str]:
        """The first ``n`` live members in ring order (dead owners are skipped)."""
        return self.owners_of(self.placement_key(key), n)

    def client(self, member: str) -> PeerClient:
        """The client of ``member`` (created on first use)."""
        found = self.clients.get(member)
        if found is None:
            found = self.clients[member] = self._factory(member)
        return found

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Resolve DNS once (if used) and start the background health/DNS loop."""
        if self._task is not None:
            return
        if self._dns is not None:
            await self.refresh_dns()
        self._task = asyncio.create_task(self._loop(), name="kvtier-peer-membership")

    async def close(self) -> None:
        """Stop the loop and close every client."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        clients, self.clients = self.clients, {}
        await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_dns = loop.time() + self.dns_interval
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                if self._dns is not None and loop.time() >= next_dns:
                    next_dns = loop.time() + self.dns_interval
                    await self.refresh_dns()
                await self.check_health()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("peer membership loop failed; retrying")

    async def check_health(self) -> None:
        """Probe every member once; dead ones that answer come back, silent ones go."""
        members = [m for m in self.members if m != self.self_id]

        async def probe(member: str) -> None:
            client = self.client(member)
            try:
                doc = await client.health(limit_s=max(client.timeout, 1.0))
            except KVTierError as exc:
                self.mark_dead(member, exc)
                return
            before = self.health.get(member)
            self.health[member] = doc
            known_for = time.monotonic() - self._since if before is None else _uptime(before)
            if _uptime(doc) < known_for:
                # (Re)started since this process last saw it, maybe empty: reads ask it first.
                self._note_change(member)
                log.info("peer %s restarted", member)
            self._mark_alive(member)

        await asyncio.gather(*(probe(m) for m in members))

    async def refresh_dns(self) -> None:
        """Re-resolve the DNS name; rebuild the ring if the address set changed."""
        assert self._dns is not None
        host, port = self._dns
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout=5.0)
        except (OSError, TimeoutError) as exc:
            # Keep the last known members: a DNS hiccup must not empty the pool.
            log.warning("peers+dns: cannot resolve %s: %s", host, exc)
            return
        found = {member_id(str(info[4][0]), port) for info in infos}
        if self.self_id is not None:
            found.add(self.self_id)
        if set(self.members) == found:
            return
        log.info("peers+dns: %s -> %s", host, sorted(found))
        gone = set(self.members) - found
        now = time.monotonic()
        for member in gone | (found - set(self.members)):
            self._note_change(member, now)
        # Thousands of vnodes per member: build the new ring off the event loop.
        self.ring = await asyncio.to_thread(self.ring.with_members, found)
        for member in gone:
            self._dead.discard(member)
            self.health.pop(member, None)
            client = self.clients.pop(member, None)
            if client is not None:
                await client.close()


def _own_key(key: bytes) -> bytes:
    return key


def _uptime(doc: dict[str, Any]) -> float:
    value = doc.get("uptime_s")
    return float(value) if isinstance(value, int | float) else 0.0
