"""Pool membership: who the peers are (static list or DNS), which of them answer, and the ring.

Which members are in the read and write paths is decided by a
:class:`~kvtier.peer.health.FailureDetector` fed by every request and by the health loop,
which probes every member each ``health_interval`` seconds (with the request timeout: a probe
is judged like a real request). Each probe's ``uptime_s`` dates the member's start in this
process's clock, so a restart is seen even when the new uptime exceeds the last reading, and
a member started well after the rest of the pool counts as recently changed for a client that
opened after its restart. With DNS membership the name is re-resolved every
``dns_interval`` seconds (A and AAAA, as for a Kubernetes headless service) and the ring is
rebuilt when the address set changes; the change is counted (anti-entropy's cue) only once
the new ring is in place. A server's own member (``self_id``) is in its ring until DNS has
named it and then stops naming it: it left, as everyone else's ring says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.errors import ConfigError, KVTierError, PeerStatusError
from kvtier.peer.client import PeerClient, PeerTimeoutError
from kvtier.peer.health import FailureDetector, StartEstimate
from kvtier.peer.ring import HashRing

__all__ = ["Membership", "member_id", "split_member"]

log = logging.getLogger("kvtier.peer.membership")

# Seconds by which a member's start estimate must move later to count as a restart (server
# rounding of uptime_s, clock-rate differences between two probes).
_START_SLACK = 0.01
_PREVIOUS_RINGS = 4  # rings kept to tell which keys a recent join or leave moved


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
    fail_after, rejoin_after
        See :class:`~kvtier.peer.health.FailureDetector`.
    """

    def __init__(self, members: Iterable[str] | None, *, dns: tuple[str, int] | None,
                 client_factory: Callable[[str], PeerClient], vnodes: int, replicas: int,
                 self_id: str | None, health_interval: float, dns_interval: float,
                 fail_after: int = 3, rejoin_after: int = 2) -> None:
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
        self.clients: dict[str, PeerClient] = {}
        self.detector = FailureDetector(fail_after=fail_after, rejoin_after=rejoin_after)
        self.health: dict[str, dict[str, Any]] = {}
        self.failures = 0
        self.recoveries = 0
        # (monotonic time, member) of every failure, recovery, join and leave this process saw:
        # the read path walks further while members have recently changed.
        self._changes: dict[str, float] = {}
        self.change_count = 0  # every change ever seen (anti-entropy skips quiet periods)
        # The last rings before a membership change, each with when it was replaced: a key
        # whose owners differ from those of one of them is checked on every current owner.
        self._previous: deque[tuple[HashRing, float]] = deque(maxlen=_PREVIOUS_RINGS)
        self._dated: set[str] = set()  # members whose first start estimate was judged
        self._listed_self = False  # whether DNS ever named self_id (see refresh_dns)
        #: Called with a member that rejoined the path, or answered again after failures
        #: while in it (hinted handoff).
        self.on_rejoin: Callable[[str], None] | None = None
        #: Called with the members that left the ring (hints move to the new owners).
        self.on_leave: Callable[[set[str]], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._since = time.monotonic()

    # ----------------------------------------------------------------- state
    @property
    def members(self) -> tuple[str, ...]:
        """Current member ids, sorted."""
        return self.ring.members

    def alive(self, member: str) -> bool:
        """Whether ``member`` is in the read/write path."""
        return not self.detector[member].down

    def reachable(self, member: str) -> bool:
        """Whether ``member`` answered its last health probe (a member out of the path but
        reachable is still asked when no other owner is left)."""
        return self.detector[member].reachable

    def may_hold(self, member: str) -> bool:
        """Whether a read should still ask ``member`` when no other owner is left: it
        answered its last health probe, or its last failure was a timeout (frozen, busy or
        back already; asking costs at most the request timeout), not a refusal."""
        state = self.detector[member]
        return state.reachable or state.timed_out

    @property
    def dead(self) -> frozenset[str]:
        """Members currently out of the path."""
        return frozenset(m for m in self.members if not self.alive(m))

    def mark_dead(self, member: str, reason: object) -> None:
        """Take ``member`` out of the path at once (a hard signal: connection refused, a
        wrong health answer) until ``rejoin_after`` health probes succeed."""
        if member != self.self_id and self.detector.take_down(member, reason):
            self._went_down(member, reason)

    def report_failure(self, member: str, reason: BaseException, started: float,
                       elapsed: float, *, hard: bool) -> None:
        """Count a failed request to ``member`` (see :class:`FailureDetector`)."""
        if member != self.self_id and self.detector.failure(member, started, elapsed,
                                                            hard=hard, error=reason):
            self._went_down(member, reason)

    def report_success(self, member: str, elapsed: float, keys: int) -> None:
        """Count an answered request of ``keys`` keys to ``member``."""
        if self.detector.success(member, elapsed, keys) and self.on_rejoin is not None:
            self.on_rejoin(member)  # it answers again: hand over what it missed meanwhile

    def _went_down(self, member: str, reason: object) -> None:
        self.failures += 1
        self._note_change(member)
        log.warning("peer %s marked down: %s", member, reason)

    def _mark_alive(self, member: str) -> None:
        if self.detector.bring_up(member):
            self._came_back(member)

    def _came_back(self, member: str) -> None:
        self.recoveries += 1
        self._note_change(member)
        log.info("peer %s is back", member)
        if self.on_rejoin is not None:
            self.on_rejoin(member)

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
        """Every member in ring order for ``key`` (primary first)."""
        return self.ring.owners(key, len(self.ring))

    def owners_of(self, key: bytes, n: int) -> list[str]:
        """The first ``n`` live members in ring order of ``key`` (dead owners are skipped)."""
        return [m for m in self.ring.owners(key, len(self.ring)) if self.alive(m)][:n]

    def live_owners(self, key: bytes, n: int) -> list[str]:
        """The first ``n`` live members in ring order (dead owners are skipped)."""
        return self.owners_of(key, n)

    def write_owners(self, key: bytes, n: int) -> list[str]:
        """The first ``n`` live members in ring order, then, while fewer than ``n`` are live,
        members out of the path that still answer health probes (never "no live peer"
        while members answer)."""
        order = self.order(key)
        owners = [m for m in order if self.alive(m)][:n]
        if len(owners) < n:
            owners += [m for m in order if not self.alive(m) and self.reachable(m)
                       ][:n - len(owners)]
        return owners

    def unsettled(self, key: bytes, replicas: int, window: float) -> bool:
        """Whether the ring moved ``key`` in the last ``window`` seconds (a member joined
        or left, and its owners differ from those of a ring before)."""
        return self.moved(key, replicas, window)

    def moved(self, key: bytes, replicas: int, window: float) -> bool:
        """Whether the ring moved the owners of ``key`` in the last ``window`` seconds (see
        :meth:`unsettled`)."""
        since = time.monotonic() - window
        owners = None
        for ring, until in self._previous:
            if until >= since:
                owners = set(self.ring.owners(key, replicas)) if owners is None else owners
                if set(ring.owners(key, replicas)) != owners:
                    return True
        return False

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

    async def check_health(self) -> dict[str, str]:
        """Probe every other member once; returns ``{member: "ok" | "refused" | "down"}``
        ("refused": it answered 401/403 to this pool's token)."""
        members = [m for m in self.members if m != self.self_id]
        answers = await asyncio.gather(*(self.probe(m) for m in members))
        self._date_first_starts()
        return dict(zip(members, answers, strict=True))

    async def probe(self, member: str) -> str:
        """One health probe of ``member``, within the request timeout (judged like a real
        request): a timeout counts toward suspicion, a wrong answer takes the member out,
        answers in a row bring it back."""
        client = self.client(member)
        sent = time.monotonic()
        try:
            doc = await client.health()
        except PeerTimeoutError as exc:
            self.report_failure(member, exc, sent, time.monotonic() - sent, hard=False)
            self.detector[member].reachable = False
            return "down"
        except KVTierError as exc:
            self.mark_dead(member, exc)
            refused = isinstance(exc, PeerStatusError) and exc.status in (401, 403)
            return "refused" if refused else "down"
        received = time.monotonic()
        self.health[member] = doc
        restarted = self._dated_start(
            member, StartEstimate.from_uptime(doc.get("uptime_s"), sent, received))
        # A member that restarted since it went down is not flapping: it rejoins at once.
        rejoined = self.detector.probe_answered(member)
        if rejoined or (restarted and self.detector.bring_up(member)):
            self._came_back(member)
        return "ok"

    def _dated_start(self, member: str, start: StartEstimate | None) -> bool:
        """Judge a probe's start estimate against the last one (a NaN or missing uptime
        tells nothing and is skipped); ``True`` if the member restarted since."""
        if start is None:
            return False
        state = self.detector[member]
        before = state.started
        state.started = start
        later_than = self._since if before is None else before.latest
        if start.earliest > later_than + _START_SLACK:
            # (Re)started since this process started or last probed it, maybe empty: reads
            # ask it first and read repair fills it.
            self._dated.add(member)
            self._note_change(member)
            log.info("peer %s restarted", member)
            return True
        return False

    def _date_first_starts(self) -> None:
        """A member first seen by this process that started more than ``health_interval``
        after the pool's oldest member (it restarted before this process opened) counts as
        changed at its start: a fresh client then asks it first too."""
        starts = {m: s for m in self.members
                  if (s := self.detector[m].started) is not None}
        if not starts:
            return
        oldest = min(s.latest for s in starts.values())
        for member, start in starts.items():
            if member in self._dated:
                continue
            self._dated.add(member)
            if start.earliest > oldest + self.health_interval:
                self._note_change(member, start.earliest)

    async def refresh_dns(self) -> None:
        """Re-resolve the DNS name; rebuild the ring if the address set changed.

        A node with ``self_id`` set counts itself in until DNS first names it; once named,
        a DNS answer without it means it left: its ring is then the other members alone,
        as everyone else's is."""
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
            if self.self_id in found:
                self._listed_self = True
            elif not self._listed_self:
                # Not listed yet (started before DNS names it, or DNS names it by another
                # address): it counts itself in, as it always did.
                found.add(self.self_id)
            # Listed once, now no more: it left the pool. Every other member and every
            # client drops it from its ring, so it does too: its anti-entropy then sees
            # itself own nothing and hands what it holds to the keys' owners, instead of
            # holding on to copies (and late writes) nobody reads from it any more.
        if set(self.members) == found:
            return
        log.info("peers+dns: %s -> %s", host, sorted(found))
        await self.apply_members(found)

    async def apply_members(self, found: set[str]) -> None:
        """Make ``found`` the member set (what DNS answered): rebuild the ring, note who
        joined and left, keep the previous ring for :meth:`unsettled`."""
        if set(self.members) == found:
            return
        # Thousands of vnodes per member: build the new ring off the event loop, and only
        # then count the change. Counted first, an anti-entropy pass woken by the count
        # ran on the old ring meanwhile (nothing had moved yet), and counted as the pass
        # for the change: the keys the change moved were never pushed to their new owners.
        ring = await asyncio.to_thread(self.ring.with_members, found)
        if set(self.members) == found:
            return  # another call made it meanwhile
        gone = set(self.members) - found
        now = time.monotonic()
        if self.ring.members:
            # Not the empty ring before DNS first answered: against it every key "moved",
            # so for change_window after start no stand-in would go and every key held
            # would be checked again as moved.
            self._previous.append((self.ring, now))
        joined = found - set(self.members)
        self.ring = ring
        for member in gone | joined:
            self._note_change(member, now)
        for member in gone:
            self.detector.forget(member)
            self._dated.discard(member)
            self.health.pop(member, None)
            client = self.clients.pop(member, None)
            if client is not None:
                await client.close()
        if gone and self.on_leave is not None:
            self.on_leave(gone)
