"""``peers://`` and ``peers+dns://``: the pool of other hosts' segments as one tier.

A key's owners are its first ``replicas`` live members in ring order. ``get`` asks them
(suspected and slow ones last) and the first verified hit wins; a dead, slow or erroring peer
is a miss, never an exception or a hang, and counts toward taking it out of the path (see
:mod:`kvtier.peer.health`). ``put`` writes every owner concurrently, falling to the next live
member when one fails. Batch forms
send one request per owner, in parallel. When an owner is this node (``self=``) its segment
(``local=``) is used directly, without HTTP. Under ``placement=local`` copies go to the
client's home member first and reads go home, then to holders found in the holder directory
(:mod:`kvtier.peer.localreads`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, Self, TypeVar, cast

from kvtier.codec import EncodedFrame, decode_frame, encode_frame
from kvtier.codec import parse_compress as _compress_level
from kvtier.errors import ConfigError, CorruptBlockError, KVTierError, PeerError, PeerStatusError
from kvtier.misses import MissReason
from kvtier.peer import protocol as proto
from kvtier.peer.buffers import BodyBuffers
from kvtier.peer.client import DEFAULT_MIN_RATE, PeerClient, PeerUnreachableError, TimeBudget
from kvtier.peer.directory import Directory
from kvtier.peer.frames import Accept, decode_batch_from_peer, decode_from_peer
from kvtier.peer.handoff import Hints
from kvtier.peer.health import silent_owners
from kvtier.peer.localreads import LocalReads
from kvtier.peer.locate import LocalPrefix, locate_prefix
from kvtier.peer.membership import Membership, split_member
from kvtier.peer.ring import DEFAULT_VNODES
from kvtier.peer.server import Segment
from kvtier.peer.tls import client_context
from kvtier.peer.versions import HybridClock, stamped, write_stamp
from kvtier.tasks import TaskSet
from kvtier.tiers.base import Block, Tier
from kvtier.urls import (
    merge_options,
    parse_bool,
    parse_number,
    parse_secret,
    parse_size,
    parse_tier_url,
)

__all__ = ["PeerTier"]

log = logging.getLogger("kvtier.peer.tier")
PLACEMENTS = ("block", "local")
T = TypeVar("T")
_OPTIONS = {"replicas", "token", "self", "local", "timeout", "ack", "tls_ca", "tls_cert",
            "tls_key", "tls_server_name", "compress", "health_interval", "dns_interval",
            "vnodes", "pool", "name", "max_batch", "max_body", "min_copies", "read_walk",
            "change_window", "repair_bytes", "block_bytes", "min_rate", "fail_after",
            "rejoin_after", "hedge", "placement", "home", "recv_reserve"}
FAILED = object()  # a peer that did not answer (distinct from a clean miss, ``None``)
_VERIFIED_KEYS = 65536  # keys remembered as checked on every owner since the last change
_HANDOFF_BATCH = 64  # hinted keys checked and copied at once when their owner is back
_FULL = 507  # "Insufficient Storage": a member whose segment cannot make room; it is up


class PeerTier(Tier):
    """The peer pool as a tier.

    Parameters
    ----------
    members
        Static member ids (``host:port``), or ``None`` with ``dns``.
    dns
        ``(name, port)`` re-resolved every ``dns_interval`` seconds (``peers+dns://``).
    replicas
        Owners per key.
    token
        Bearer token of the pool (``None`` for servers run with ``--insecure-no-auth``).
    self_id
        This node's member id; with ``local`` its keys are served without HTTP.
    local
        This node's segment (the store or tier its ``PeerServer`` exposes).
    timeout
        Seconds allowed for one request to one peer that moves no bytes; a slower peer is a
        miss. A request's budget is ``timeout + bytes / min_rate``
        (:class:`~kvtier.peer.client.TimeBudget`).
    min_rate
        Bytes per second a member is assumed to move at least (default 64 MiB/s).
    fail_after, rejoin_after
        Failures in a row (a burst of concurrent ones counting once) that take a member out
        of the path, and health probes in a row that bring it back
        (:class:`~kvtier.peer.health.FailureDetector`).
    hedge
        Hedged single-key reads: a ``get`` its first owner has not answered after a high
        percentile of that owner's latency
        (:meth:`~kvtier.peer.health.FailureDetector.hedge_delay`) goes to the next owner too,
        and the first hit wins (the slower answer still feeds the latency figures).
    ack
        ``"all"``: ``put`` returns when every copy finished and raises unless ``min_copies``
        of them were stored, a hint standing in for one missing copy of an owner out of the
        path or under suspicion (see :mod:`kvtier.peer.handoff`; never for the only copy);
        ``"one"``: it returns
        after ``min_copies`` acknowledgements and the other copies complete in the
        background (:meth:`flush` waits for them).
    min_copies
        Copies a put needs to succeed (default: ``replicas`` for ``ack="all"``, 1 for
        ``"one"``; capped at the member count). Copies made are counted in :meth:`stats`.
    read_walk
        Members asked past ``replicas`` "not here" answers before a read is a miss.
    change_window
        Seconds during which a member that failed, came back, restarted, joined or left
        widens the read walk by one and is asked first.
    repair_bytes
        Most bytes of blocks held by read repairs (write-backs to owners that lacked a
        block) in flight at once; a repair past it is dropped and counted (the next read,
        or the anti-entropy pass, repairs that block).
    ssl_context
        Client TLS context (see :func:`kvtier.peer.tls.client_context`).
    tls_server_name
        Name every member's certificate must carry (default: the member's host); for
        ``peers+dns://``, whose members are IP addresses.
    compress_level
        zstd level for blocks sent by ``put`` (``None``: raw, zero-copy).
    health_interval, dns_interval
        Seconds between health probes and between DNS re-resolutions.
    vnodes
        Virtual nodes per member on the ring.
    pool_limit
        Connections per peer.
    limits
        The servers' limits, used to split batches.
    block_bytes
        The size every block of this pool has, when it has one (KV blocks of one model and
        block size do): a frame from a peer that declares another size is a miss, refused
        before it is decompressed (``None``: any size up to ``limits.max_block_bytes``).
    placement
        ``"block"``: every block on its own key's ring owners. ``"local"``: a block is
        stored on ``home`` (and ``replicas - 1`` more members of its ring order), every
        member registers what it holds in the holder directory, and reads go to home, then
        to a holder found there (:mod:`kvtier.peer.localreads`; the servers must run
        ``kvtier serve --pool`` with ``placement=local``). Every client and server of a pool
        must use the same one. Chain placement (``anchor:R``, ``chunk:N``, ``root:R``) was
        removed: a block's owner depended on what the process had seen of its chain, and
        it lost blocks; a URL naming it fails at open.
    home
        Under ``placement=local``, the member this client writes to and reads from first:
        the ``kvtier serve`` on its own host (default: ``self`` when given, else the first
        member listed).
    recv_reserve
        Bytes of answer buffers faulted in at :meth:`open` and kept for good, as two buffers
        of half the size each, shared by all members' connections (default 0: buffers are
        mapped on demand and dropped after an idle period). A batch answer that fits one of
        them lands in memory already mapped; a fresh multi-MiB buffer costs a page fault
        per 4 KiB, 15-60 ms for 16 MiB on the benchmark VM (``docs/performance.md``). The
        vLLM connector sets it to twice its staging size.

    Examples
    --------
    ``peers://h1:7070,h2:7070?replicas=2&token=env:KVTIER_TOKEN&self=h1:7070&timeout=0.5``
    """

    scheme = "peers"
    #: Other processes read what this tier holds: private tiers above it write through.
    shared = True

    def __init__(self, members: Sequence[str] | None = None, *,
                 dns: tuple[str, int] | None = None, replicas: int = 1,
                 token: str | None = None, self_id: str | None = None,
                 local: Segment | None = None, timeout: float = 0.5, ack: str = "all",
                 ssl_context: ssl.SSLContext | None = None, compress_level: int | None = None,
                 health_interval: float = 2.0, dns_interval: float = 5.0,
                 vnodes: int = DEFAULT_VNODES, pool_limit: int = 64,
                 limits: proto.Limits | None = None, name: str | None = None,
                 tls_server_name: str | None = None,
                 min_copies: int | None = None, read_walk: int = 1,
                 change_window: float = 300.0, repair_bytes: int = 256 << 20,
                 block_bytes: int | None = None, min_rate: float = DEFAULT_MIN_RATE,
                 fail_after: int = 3, rejoin_after: int = 2, hedge: bool = False,
                 placement: str = "block", home: str | None = None, recv_reserve: int = 0) -> None:
        super().__init__(name=name or ("peers+dns" if dns else "peers"))
        if ack not in ("one", "all"):
            raise ConfigError(f"ack: expected 'one' or 'all', got {ack!r}")
        if min_copies is not None and not 1 <= min_copies <= replicas:
            raise ConfigError(f"min_copies: expected 1..replicas ({replicas}), got {min_copies!r}")
        if read_walk < 0 or change_window < 0 or repair_bytes < 0 or recv_reserve < 0:
            raise ConfigError("read_walk, change_window, repair_bytes, recv_reserve: "
                              "expected >= 0")
        if not timeout > 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout!r}")
        if not min_rate > 0 or fail_after < 1 or rejoin_after < 1:
            raise ConfigError(f"min_rate, fail_after, rejoin_after: expected > 0, got "
                              f"{min_rate!r}, {fail_after!r}, {rejoin_after!r}")
        if local is not None and self_id is None:
            raise ConfigError("local: requires self (this node's member id)")
        if members is not None and self_id is not None and self_id not in members:
            raise ConfigError(f"self: {self_id!r} is not one of the members {list(members)}")
        self.placement = check_placement(placement)
        if home is not None and placement != "local":
            raise ConfigError(f"home: only with placement=local, got placement={placement}")
        home = home or self_id or (members[0] if members else None)
        if placement == "local" and home is None:
            raise ConfigError("home: placement=local over peers+dns:// needs home= (the "
                              "member on this host) or self=")
        if home is not None and members is not None and home not in members:
            raise ConfigError(f"home: {home!r} is not one of the members {list(members)}")
        #: Home-first reads and the holder directory (placement=local), else None.
        self.local_reads = LocalReads(self, home) if placement == "local" and home else None
        #: This member's holder directory when it is a ``kvtier serve`` (set by LocalHolder).
        self.directory: Directory | None = None
        self.replicas = replicas
        self.min_copies = min_copies
        self.read_walk = read_walk
        self.change_window = change_window
        self.repair_bytes = repair_bytes
        self.hedge = hedge
        self._repair_held = 0
        self.timeout = timeout
        self._token = token  # for /v1/locate (the clients hold their own copy)
        self._ssl_context = ssl_context
        self._tls_server_name = tls_server_name  # for /v1/locate too
        self.ack = ack
        self.compress_level = compress_level
        self.local = local
        self.limits = limits or proto.Limits()
        self.budget = TimeBudget(timeout, min_rate)
        if block_bytes is not None and not 0 < block_bytes <= self.limits.max_block_bytes:
            raise ConfigError(f"block_bytes: expected 1..max_block_bytes "
                              f"({self.limits.max_block_bytes}), got {block_bytes!r}")
        self.block_bytes = block_bytes
        self.recv_reserve = recv_reserve
        # One pool of answer buffers for every member: a budget per tier, not per member.
        self.answer_buffers = BodyBuffers(256 << 20)
        self.members = Membership(
            members, dns=dns, vnodes=vnodes, replicas=replicas, self_id=self_id,
            health_interval=health_interval, dns_interval=dns_interval,
            fail_after=fail_after, rejoin_after=rejoin_after,
            client_factory=lambda m: PeerClient(m, token=token, timeout=timeout,
                                                ssl_context=ssl_context,
                                                pool_limit=pool_limit, limits=self.limits,
                                                tls_server_name=tls_server_name,
                                                budget=self.budget,
                                                buffers=self.answer_buffers))
        self._start_lock = asyncio.Lock()
        self._started = False
        self._background = TaskSet()
        self._repairs: set[asyncio.Task[None]] = set()
        self.counts: dict[str, int] = defaultdict(int)
        # Keys already checked on every current owner, with the change count then.
        self._verified: OrderedDict[bytes, int] = OrderedDict()
        self._hints = Hints()
        self._clock = HybridClock()
        self._stragglers: set[asyncio.Task[Any]] = set()  # hedged reads' slower requests
        self.members.on_rejoin = self._hand_over
        self.members.on_leave = self._retarget_hints

    # ------------------------------------------------------------------ config
    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``peers://h1:port,h2:port?...`` or ``peers+dns://name:port?...`` (see class doc)."""
        parsed = parse_tier_url(url)
        if parsed.scheme not in ("peers", "peers+dns"):
            raise ConfigError(f"url: expected peers:// or peers+dns://, got {url!r}")
        if parsed.path not in ("", "/"):
            raise ConfigError(f"url: {parsed.scheme}:// takes no path, got {url!r}")
        opts = merge_options(parsed, options, _OPTIONS)
        entries = [m.strip() for m in parsed.netloc.split(",") if m.strip()]
        if not entries:
            raise ConfigError(f"url: no peers in {url!r}")
        for entry in entries:
            split_member(entry, "url")
        dns = None
        if parsed.scheme == "peers+dns":
            if len(entries) != 1:
                raise ConfigError(f"url: peers+dns:// takes one name:port, got {parsed.netloc!r}")
            dns = split_member(entries[0], "url")
        tls = {k: str(opts[k]) for k in ("tls_ca", "tls_cert", "tls_key", "tls_server_name")
               if opts.get(k)}
        # Any TLS option, a server name included, means https (system roots without tls_ca).
        ctx = client_context(tls.get("tls_ca"), tls.get("tls_cert"), tls.get("tls_key")) \
            if tls else None
        token = opts.get("token")
        limits = proto.Limits(
            max_batch=parse_number(opts.get("max_batch", proto.Limits.max_batch), "max_batch",
                                   int, 1),
            max_body_bytes=parse_number(opts.get("max_body", proto.Limits.max_body_bytes),
                                        "max_body", int, proto.Limits.max_block_bytes))
        return cls(
            None if dns else entries, dns=dns,
            replicas=parse_number(opts.get("replicas", 1), "replicas", int, 1),
            token=None if token in (None, "") else parse_secret(str(token), "token"),
            self_id=str(opts["self"]) if opts.get("self") else None,
            local=opts.get("local"),  # type: ignore[arg-type]
            timeout=parse_number(opts.get("timeout", 0.5), "timeout", float, 0.001),
            ack=str(opts.get("ack", "all")),
            ssl_context=ctx,
            compress_level=_compress_level(opts.get("compress", "")),
            health_interval=parse_number(opts.get("health_interval", 2.0), "health_interval",
                                         float, 0.01),
            dns_interval=parse_number(opts.get("dns_interval", 5.0), "dns_interval", float, 0.01),
            vnodes=parse_number(opts.get("vnodes", DEFAULT_VNODES), "vnodes", int, 1),
            pool_limit=parse_number(opts.get("pool", 64), "pool", int, 1),
            limits=limits,
            name=str(opts["name"]) if opts.get("name") else None,
            tls_server_name=tls.get("tls_server_name"),
            min_copies=parse_number(opts["min_copies"], "min_copies", int, 1)
            if opts.get("min_copies") not in (None, "") else None,
            read_walk=parse_number(opts.get("read_walk", 1), "read_walk", int, 0),
            change_window=parse_number(opts.get("change_window", 300.0), "change_window", float, 0),
            block_bytes=parse_size(str(opts["block_bytes"]), "block_bytes")
            if opts.get("block_bytes") not in (None, "") else None,
            repair_bytes=parse_size(str(opts.get("repair_bytes", 256 << 20)), "repair_bytes"),
            min_rate=parse_size(str(opts.get("min_rate", DEFAULT_MIN_RATE)), "min_rate"),
            fail_after=parse_number(opts.get("fail_after", 3), "fail_after", int, 1),
            rejoin_after=parse_number(opts.get("rejoin_after", 2), "rejoin_after", int, 1),
            hedge=parse_bool(opts.get("hedge", False), "hedge"),  # type: ignore[arg-type]
            placement=str(opts.get("placement", "block")),
            home=str(opts["home"]) if opts.get("home") else None,
            recv_reserve=parse_size(str(opts.get("recv_reserve", 0)), "recv_reserve"),
        )

    @property
    def capacity(self) -> int | None:
        # The budget lives on the peers; this node enforces none.
        return None

    @property
    def used(self) -> int:
        """Bytes held across the pool, from the last health probes (and the local segment)."""
        remote = sum(int(doc.get("used") or 0) for m, doc in self.members.health.items()
                     if m != self.members.self_id)
        return remote + int(getattr(self.local, "used", 0) or 0)

    async def _start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if not self._started:
                await self.members.start()
                self._started = True

    async def open(self) -> None:
        """Start membership and probe every member once (``open_store`` calls this).

        Raises
        ------
        ConfigError
            When every member that answered refused this tier's bearer token: puts and
            gets would all fail. Unreachable members are only logged (pools start in any
            order); they join the path when a health probe reaches them.
        """
        await self._start()
        if self.recv_reserve and not self.answer_buffers.reserved_bytes:
            await self.answer_buffers.reserve(self.recv_reserve // 2, 2)
        probed = await self.members.check_health()
        members, answers = list(probed), list(probed.values())
        refused = [m for m, a in probed.items() if a == "refused"]
        if refused and "ok" not in answers and self._token is None:
            raise ConfigError(
                f"{self.name}: no bearer token given, and the members require one "
                f"({', '.join(refused)} answered 401/403); add the token= option (e.g. "
                "token=env:KVTIER_TOKEN or token=file:/path, the servers' --token-file)")
        if refused and "ok" not in answers:
            raise ConfigError(
                f"{self.name}: every reachable member refused the bearer token "
                f"({', '.join(refused)} answered 401/403); check the token= option "
                "(same secret as the servers' --token-file)")
        down = [m for m, a in zip(members, answers, strict=True) if a == "down"]
        if down:
            log.warning("%s: %d of %d members unreachable at open (%s); they join when they "
                        "answer a health probe", self.name, len(down), len(members),
                        ", ".join(down))

    def owners(self, key: bytes) -> list[str]:
        """The live members that own ``key``, primary first: its ring owners, or under
        ``placement=local`` the holders this client last saw (no request)."""
        if self.local_reads is not None:
            return self.local_reads.holders(key)
        return self.members.live_owners(key, self.replicas)

    async def directory_holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Per key, its holders in the holder directory (``placement=local`` only)."""
        if self.local_reads is None:
            raise ConfigError(f"{self.name}: the holder directory needs placement=local")
        await self._start()
        return await self.local_reads.directory_holders(keys)

    def _order(self, key: bytes) -> list[str]:
        """Where copies of ``key`` go, first choice first."""
        if self.local_reads is not None:
            return self.local_reads.order(key)
        return self.members.order(key)

    def _write_targets(self, key: bytes, n: int) -> list[str]:
        if self.local_reads is not None:
            return self.local_reads.write_targets(key, n)
        return self.members.write_owners(key, n)

    def _is_local(self, member: str) -> bool:
        return self.local is not None and member == self.members.self_id

    async def _call(self, member: str, op: str, fn: Callable[[], Awaitable[T]],
                    keys: int = 1) -> T | object:
        """Run one peer call of ``keys`` keys; a failure is a miss for that peer only and
        returns ``FAILED``.

        Only transport errors, timeouts and 5xx answers count toward taking the member out of
        the path (a refused connection at once): a 4xx, or a ``507`` (its segment is full),
        says the peer is up and refused this one request (oversized, full, bad token).
        Answers feed the member's latency.
        """
        self.counts[f"{op}_requests"] += 1
        started = time.monotonic()
        try:
            result = await fn()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of one peer (even MemoryError) is its miss
            self.counts["errors"] += 1
            refused = isinstance(exc, PeerStatusError) and (exc.status < 500
                                                            or exc.status == _FULL)
            if not self._is_local(member) and isinstance(exc, KVTierError | OSError) \
                    and not refused:
                self.members.report_failure(
                    member, exc, started, time.monotonic() - started,
                    hard=isinstance(exc, PeerUnreachableError | ConnectionRefusedError))
            log.debug("peer %s: %s failed: %s", member, op, exc)
            return FAILED
        if not self._is_local(member):
            self.members.report_success(member, time.monotonic() - started, keys)
        return result

    def _accept(self, member: str) -> Accept:
        """What this tier accepts as a block from ``member`` (frames.py)."""
        return Accept(self.limits.max_block_bytes, self.block_bytes,
                      unbound=self.members.client(member).protocol < proto.VERSION)

    def _refused(self, member: str, key: bytes, exc: Exception) -> None:
        self.counts["corrupt"] += 1
        log.warning("peer %s sent a bad frame: %s", member, exc)
        self._report_miss((key,), MissReason.CORRUPT, f"from {member}: {exc}")

    async def _decode(self, member: str, key: bytes,
                      frame: bytes | memoryview | None) -> Block | None:
        if frame is None:
            return None
        try:
            return await decode_from_peer(frame, key, self._accept(member))
        except (CorruptBlockError, MemoryError) as exc:  # corrupt, foreign or a bomb: a miss
            self._refused(member, key, exc)
            return None

    def _next(self, key: bytes | None, order: list[str], tried: set[str]) -> str | None:
        """The first untried live member of ``order``; when none is left, the first untried
        member out of the path that still answers health probes: for a read (``key``
        given) one of the key's owners, so a member under suspicion is asked when it is the
        only owner left; for a write (``key`` ``None``) any, so a put does not fail while
        members answer. A read then asks the key's owners whose last probe timed out: one
        back from a freeze holds its blocks before two probes bring it back (a fresh client,
        which never saw it fail, asks it: a long-lived one must read what that one reads)."""
        for member in order:
            if member not in tried and self.members.alive(member):
                return member
        if key is None:
            return next((m for m in order if m not in tried and self.members.reachable(m)),
                        None)
        owners = self.members.ring.owners(key, self.replicas)
        for may in (self.members.reachable, self.members.may_hold):
            for member in owners:
                if member not in tried and may(member):
                    return member
        return None

    # ----------------------------------------------------------------- single
    async def _get(self, key: bytes) -> Block | None:
        return (await self._get_many([key]))[0]

    async def _contains(self, key: bytes) -> bool:
        return (await self._contains_many([key]))[0]

    def _copies(self) -> tuple[int, int]:
        """``(wanted, needed)`` copies of a put: ``replicas`` (at most one per member) and
        how many must succeed for ``put`` not to raise."""
        want = min(self.replicas, len(self.members.members))
        need = self.min_copies if self.min_copies is not None else (
            want if self.ack == "all" else 1)
        return want, min(need, want)

    def _track(self, task: asyncio.Task[Any]) -> None:
        # Referenced until done (a bare task can be garbage-collected mid-flight), and
        # awaited by flush()/aclose() even when the put that made it was cancelled.
        self._background.track(task)

    # Every copy of one put or delete carries one stamp of this client's clock
    # (kvtier.peer.versions): a member back from a crash then loses to it.
    async def _put(self, key: bytes, block: Block) -> None:
        with stamped(self._clock.next()):
            await self._put_once(key, block)

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        with stamped(self._clock.next()):
            await self._put_many_once(items)

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        with stamped(self._clock.next()):
            return await self._delete_many_once(keys)

    async def _put_once(self, key: bytes, block: Block) -> None:
        await self._start()
        frame = await self._encode(key, block)
        order = self._order(key)
        want, need = self._copies()
        targets = self._write_targets(key, want)
        if not targets:
            self.counts["puts_under_replicated"] += 1
            raise PeerError(f"{self.name}: no live peer to store {key.hex()}")
        if self.ack == "one" and len(targets) > 1 and not self.compress_level:
            # Copies finish after put() returns: they must not read the caller's buffer.
            frame = EncodedFrame(frame.header, memoryview(frame.payload.tobytes()))
            block = decode_frame(frame.to_bytes(), key=key)
        used = set(targets)
        refusals: list[str] = []  # why copies failed, for the error below
        tasks = [asyncio.create_task(self._write_one(key, block, frame, first, order, used,
                                                     refusals))
                 for first in targets]
        for task in tasks:
            self._track(task)
        pending: set[asyncio.Task[bool]] = set(tasks)
        copies = 0
        # asyncio.wait, not gather: cancelling this put must not cancel copies in flight
        # (a copy is all or nothing on its peer; flush() waits for the rest).
        while pending and (self.ack == "all" or copies < need):
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            copies += sum(1 for t in finished if t.result())
        hinted = self._hint_failing_owners(key, want)
        if pending:  # ack=one: the remaining copies finish in the background
            self.counts["copies_made"] += copies
            for task in pending:
                task.add_done_callback(self._count_copy)
            return
        self.counts["copies_made"] += copies
        if copies < want:
            self.counts["puts_under_replicated"] += 1
        if copies < need and not self._hints_cover(copies, hinted, need):
            why = f": {'; '.join(dict.fromkeys(refusals))}" if refusals else ""
            raise PeerError(f"{self.name}: {copies} of {want} copies of {key.hex()} stored, "
                            f"{need} required (ack={self.ack}){why}")

    def _hint_failing_owners(self, key: bytes, want: int) -> int:
        """Leave a hint for each of the key's owners that is out of the path or under
        suspicion (it gets the block when it is back); returns how many owners hold a hint
        for ``key``."""
        hinted = 0
        for owner in self._order(key)[:want]:
            if owner != self.members.self_id and (not self.members.alive(owner)
                                                  or self.members.detector[owner].suspicion):
                self._hints.add(owner, key)
                hinted += 1
        return hinted

    def _hints_cover(self, copies: int, hinted: int, need: int) -> bool:
        """Whether hints make up for the copies an ``ack=all`` put lacks: one copy at most,
        and never the only one."""
        return self.ack == "all" and copies >= max(1, need - 1) and copies + hinted >= need

    def _hint_missed_deletes(self, keys: Sequence[bytes], failed: set[str]) -> None:
        """Hint the stamped delete of ``keys`` to each owner (under ``placement=local``
        each member) out of the path or in ``failed`` (it did not answer): handed over when
        it is back, so its old copy does not outlive the delete until an anti-entropy
        pass."""
        stamp = write_stamp.get()
        if stamp is None:
            return
        for key in keys:
            # placement=local: a copy may sit on any member (where it was computed).
            owners = self.members.members if self.local_reads is not None else \
                self.members.ring.owners(key, self.replicas)
            for owner in owners:
                if owner != self.members.self_id and (owner in failed
                                                      or not self.members.alive(owner)):
                    self._hints.add_delete(owner, key, stamp)

    def _retarget_hints(self, gone: set[str]) -> None:
        """Members left the ring: their hints go to the keys' new owners at once."""
        for member in self._hints.retarget(
                gone, lambda key: self.members.ring.owners(key, self.replicas)):
            if self.members.alive(member) and not self._is_local(member):
                self._hand_over(member)

    def _hand_over(self, member: str) -> None:
        """``member`` is back (rejoined, or answered after failures): copy its hinted keys
        and send its hinted deletes to it, in the background."""
        keys = self._hints.take(member)
        deletes = self._hints.take_deletes(member)
        for work in ([self._hand_over_keys(member, keys)] if keys else []) + \
                ([self._hand_over_deletes(member, deletes)] if deletes else []):
            task = asyncio.create_task(work)
            self._repairs.add(task)
            task.add_done_callback(self._repairs.discard)

    async def _hand_over_deletes(self, member: str, items: list[tuple[bytes, int]]) -> None:
        """Send ``member`` the deletes it missed, each with its stamp (applied only where
        newer than what it holds); a batch it fails stays hinted."""
        for start in range(0, len(items), _HANDOFF_BATCH):
            chunk = items[start:start + _HANDOFF_BATCH]
            reply = await self._call(member, "handoff", partial(
                self.members.client(member).delete_many, [k for k, _ in chunk],
                stamps=[s for _, s in chunk]), len(chunk))
            if reply is FAILED:
                for key, stamp in items[start:]:
                    self._hints.add_delete(member, key, stamp)
                return
            self.counts["hinted_deletes_handed_over"] += len(chunk)

    async def _hand_over_keys(self, member: str, keys: list[bytes]) -> None:
        """Ask ``member`` which hinted keys it lacks, read those through the pool, and store
        them on it; a batch it fails puts its keys back as hints."""
        for start in range(0, len(keys), _HANDOFF_BATCH):
            chunk = keys[start:start + _HANDOFF_BATCH]
            held = await self._call(member, "handoff", partial(self._exists, member, chunk),
                                    len(chunk))
            stored: object = None
            items: list[tuple[bytes, Block]] = []
            if isinstance(held, list):
                missing = [k for k, h in zip(chunk, held, strict=True) if not h]
                blocks = await self._get_many(missing)
                items = [(k, b) for k, b in zip(missing, blocks, strict=True) if b is not None]
                frames = [(k, await self._encode(k, b)) for k, b in items]
                # fill: a newer put that reached the owner meanwhile stays.
                if items:
                    stored = await self._call(
                        member, "handoff", partial(self._put_frames, member, frames, fill=True),
                        len(items))
            if not isinstance(held, list) or stored is FAILED:
                # Gone again: the hints wait for its next return.
                for key in keys[start:]:
                    self._hints.add(member, key)
                return
            self.counts["hints_handed_over"] += len(items)

    def _count_copy(self, task: asyncio.Task[bool]) -> None:
        if not task.cancelled() and task.exception() is None and task.result():
            self.counts["copies_made"] += 1

    async def _put_to(self, target: str, op: str, key: bytes, block: Block,
                      frame: EncodedFrame, *, fill: bool = False,
                      refusals: list[str] | None = None) -> object:
        """One copy of ``key`` onto ``target`` (this node's own segment, or a member over
        HTTP) through :meth:`_call`: ``FAILED`` if it did not take it, the reason then
        appended to ``refusals`` (the server's answer names the limit it hit). ``fill``:
        only if ``target`` does not hold ``key`` (a repair never overwrites a newer put)."""
        put: Callable[[], Awaitable[None]]
        if self._is_local(target):
            put = partial(self._put_local, key, block, fill)
        else:
            put = partial(self.members.client(target).put, key, frame, fill=fill)
        if refusals is None:
            return await self._call(target, op, put)

        async def noted() -> None:
            try:
                await put()
            except Exception as exc:
                refusals.append(f"{target}: {type(exc).__name__}: {exc}")
                raise

        return await self._call(target, op, noted)

    async def _put_local(self, key: bytes, block: Block, fill: bool) -> None:
        local = cast(Segment, self.local)
        if not fill or not (await local.contains_many([key]))[0]:
            await local.put(key, block)

    async def _write_one(self, key: bytes, block: Block, frame: EncodedFrame, member: str,
                         order: list[str], used: set[str], refusals: list[str]) -> bool:
        current: str | None = member
        while current is not None:
            if await self._put_to(current, "put", key, block, frame,
                                  refusals=refusals) is not FAILED:
                return True
            current = self._next(None, order, used)
            if current is not None:
                used.add(current)
        return False

    async def _encode(self, key: bytes, block: Block) -> EncodedFrame:
        # Bound to its key (frame version 2): a server or a later reader verifies it.
        if self.compress_level is None:
            return encode_frame(block, key=key)
        return await asyncio.to_thread(encode_frame, block, compress_level=self.compress_level,
                                       shuffle=True, key=key)

    async def _delete(self, key: bytes) -> bool:
        return (await self._delete_many([key]))[0]

    # ------------------------------------------------------------------ batch
    def walk_limit(self) -> int:
        """How many "not here" answers a read accepts before it calls a key a miss.

        ``replicas`` owners, plus ``read_walk`` members past them (fallback copies written
        while an owner was down, and the old owner after one member joined), plus one for
        every member that failed, came back, joined or left in the last ``change_window``
        seconds. Capped at the member count.
        """
        extra = self.read_walk + self.members.recent_changes(self.change_window)
        return min(len(self.members.members), self.replicas + extra)

    async def _rounds(self, keys: Sequence[bytes], op: str,
                      fetch: Callable[[str, list[bytes]], Awaitable[list[Any]]],
                      found: Callable[[Any], bool]
                      ) -> tuple[list[Any], list[list[str]], list[str | None]]:
        """Ask members in read order, one request per member per round, until each key is
        found or :meth:`walk_limit` members answered without it. Failed members do not count
        as answers. Returns the results, per key the members that answered "not here", and
        per key the member that had it (``None``: nobody)."""
        await self._start()
        limit = self.walk_limit()
        results: list[Any] = [None] * len(keys)
        changed = self.members.recently_changed(self.change_window)
        orders = [self._read_order(k, changed) for k in keys]
        tried: list[set[str]] = [set() for _ in keys]
        missed: list[list[str]] = [[] for _ in keys]
        holder: list[str | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        asked = False
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                member = self._next(keys[i], orders[i], tried[i]) \
                    if len(missed[i]) < limit else None
                if member is not None:
                    tried[i].add(member)
                    groups[member].append(i)
            if not groups:
                break
            asked = True
            if self.hedge and len(keys) == 1 and op == "get":
                answers = await self._hedged(keys[0], next(iter(groups)), orders[0],
                                             tried[0], fetch, found)
            else:
                calls = [self._call(m, op, partial(fetch, m, [keys[i] for i in idx]), len(idx))
                         for m, idx in groups.items()]
                # One owner (every single-key call): await it directly, no task per request.
                replies = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
                answers = list(zip(groups, replies, strict=True))
            pending = []
            for member, reply in answers:
                idx = groups.get(member, [0])  # a hedged request asked for key 0 only
                if reply is FAILED:
                    pending += idx
                    continue
                for i, value in zip(idx, cast(list[Any], reply), strict=True):
                    results[i] = value
                    if not found(value):
                        missed[i].append(member)
                        pending.append(i)
                        continue
                    holder[i] = member
                    if len(missed[i]) > self.replicas:
                        self.counts["walk_hits"] += 1  # found past the owners' answers
        if not asked:
            # Every member is out of the path: this read awaited nothing. Suspend once, or
            # callers retrying their misses in a loop hold the event loop, the health loop
            # never probes, and no member ever comes back (100% CPU, forever).
            await asyncio.sleep(0)
        return results, missed, holder

    async def _hedged(self, key: bytes, member: str, order: list[str], tried: set[str],
                      fetch: Callable[[str, list[bytes]], Awaitable[list[Any]]],
                      found: Callable[[Any], bool]) -> list[tuple[str, object]]:
        """Ask ``member`` for ``key``; if it has not answered after its hedge delay, ask the
        next member of ``order`` too. Returns ``(member, reply)`` of the requests that
        answered before the first hit; a slower request left running finishes in the
        background (its answer, or failure, still counts for its member)."""
        first = asyncio.create_task(self._call(member, "get", partial(fetch, member, [key])))
        delay = self.members.detector.hedge_delay(member)
        done: set[asyncio.Task[object]] = set()
        if delay is not None:
            try:
                done, _ = await asyncio.wait({first}, timeout=delay)
            except asyncio.CancelledError:
                first.cancel()
                raise
        second_member = None if done or delay is None else self._next(key, order, tried)
        if second_member is None:
            return [(member, await first)]
        tried.add(second_member)
        self.counts["hedged_reads"] += 1
        second = asyncio.create_task(self._call(second_member, "get",
                                                partial(fetch, second_member, [key])))
        asked = {first: member, second: second_member}
        answers: list[tuple[str, object]] = []
        waiting: set[asyncio.Task[object]] = {first, second}
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    reply = task.result()
                    answers.append((asked[task], reply))
                    if reply is not FAILED and found(cast(list[Any], reply)[0]) and waiting:
                        if task is second:
                            self.counts["hedge_wins"] += 1
                        for straggler in waiting:
                            self._stragglers.add(straggler)
                            straggler.add_done_callback(self._stragglers.discard)
                        return answers
        except asyncio.CancelledError:
            for task in waiting:  # the read was cancelled: nothing it started acts later
                task.cancel()
            raise
        return answers

    def _read_order(self, key: bytes, changed: set[str]) -> list[str]:
        """The live owners, then the rest in ring order. Owners which recently failed,
        restarted or joined are asked first: if they came back without the key, the read
        finds the hole and read repair fills it (else a hit on another owner would hide it
        until a second failure). Owners under suspicion, and slow ones next to their
        co-owners, are asked last."""
        order = self.members.order(key)
        owners = self.members.detector.prefer(
            [m for m in order if self.members.alive(m)][:self.replicas])
        first = [m for m in owners if m in changed] + [m for m in owners if m not in changed]
        return first + [m for m in order if m not in first]

    async def _fetch_blocks(self, member: str, keys: list[bytes]) -> list[Block | None]:
        if self._is_local(member):
            return await self.local.get_many(keys)  # type: ignore[union-attr]
        client = self.members.client(member)
        if len(keys) == 1:
            return [await self._decode(member, keys[0], await client.get(keys[0]))]
        # A server answers a key repeated in one request once: ask for each key once.
        ask = list(dict.fromkeys(keys))
        blocks: dict[bytes, Block | None] = {}
        while ask:
            frames = await client.get_many(ask)
            decoded = await decode_batch_from_peer(frames, ask, self._accept(member))
            for key, block in zip(ask, decoded, strict=True):
                if isinstance(block, CorruptBlockError):  # corrupt, foreign or a bomb: a miss
                    self._refused(member, key, block)
                    block = None
                blocks[key] = block
            # A server ends a batch answer at its body limit and answers the remaining keys
            # as missing: while answers come back that full, ask again for the missing ones.
            sent = sum(len(f) for f in frames if f is not None)
            full = sent > self.limits.max_body_bytes - self.limits.max_frame_bytes
            ask = [k for k, f in zip(ask, frames, strict=True) if f is None] \
                if full and sent else []
        return [blocks[k] for k in keys]

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        if self.local_reads is not None:
            return await self.local_reads.get_many(keys)
        blocks, missed, holders = await self._rounds(keys, "get", self._fetch_blocks,
                                                     lambda b: b is not None)
        self._report_unanswered(keys, blocks, missed)
        unsettled: list[tuple[bytes, Block, str | None]] = []
        holes: list[tuple[bytes, Block, list[str]]] = []
        for key, block, not_here, holder in zip(keys, blocks, missed, holders, strict=True):
            if block is None:
                continue
            if not_here:
                holes.append((key, block, not_here))
            elif self.members.unsettled(key, self.replicas, self.change_window):
                unsettled.append((key, block, holder))
        if holes:
            self._read_repair(holes)
        if unsettled:
            self._verify_owners(unsettled)
        return cast(list[Block | None], blocks)

    def _verify_owners(self, found: list[tuple[bytes, Block, str | None]]) -> None:
        """Keys whose owners changed recently, found on the first owner asked: check their
        other current owners (one that is new for a key although unchanged itself never
        saw its put), one batch-exists request per member, and copy each block to those
        that lack it, in the background, within ``repair_bytes``. Each key is checked once
        per membership change."""
        todo: list[tuple[bytes, Block, list[str]]] = []
        held = 0
        for key, block, holder in found:
            if self._verified.get(key) == self.members.change_count:
                continue
            targets = [m for m in self.members.live_owners(key, self.replicas) if m != holder]
            if not targets or self._repair_held + held + block.nbytes > self.repair_bytes:
                continue
            self._verified[key] = self.members.change_count
            self._verified.move_to_end(key)
            if len(self._verified) > _VERIFIED_KEYS:
                self._verified.popitem(last=False)
            held += block.nbytes
            todo.append((key, block, targets))
        if not todo:
            return
        self.start_repair(self._verify(todo, held), held)

    def start_repair(self, work: Coroutine[Any, Any, None], held: int) -> None:
        """Run ``work``, a background copy holding ``held`` bytes of the repair budget
        (``repair_bytes``; ``work`` gives them back when it ends), tracked until done."""
        self._repair_held += held
        task = asyncio.create_task(work)
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _verify(self, todo: list[tuple[bytes, Block, list[str]]], held: int) -> None:
        try:
            asked: dict[str, list[int]] = defaultdict(list)
            for i, (_, _, targets) in enumerate(todo):
                for member in targets:
                    asked[member].append(i)
            replies = await asyncio.gather(*(
                self._call(m, "verify", partial(self._exists, m, [todo[i][0] for i in idx]),
                           len(idx)) for m, idx in asked.items()))
            lacking: dict[int, list[str]] = defaultdict(list)
            for (member, idx), reply in zip(asked.items(), replies, strict=True):
                if isinstance(reply, list):
                    for i, here in zip(idx, reply, strict=True):
                        if not here:
                            lacking[i].append(member)
            self.counts["owners_verified"] += len(todo)
            await self._repair_batches([(todo[i][0], todo[i][1], members)
                                        for i, members in lacking.items()])
        finally:
            self._repair_held -= held

    def _read_repair(self, found: list[tuple[bytes, Block, list[str]]]) -> None:
        """Write the blocks a read found away from their first live owners back to those
        that lacked them (``(key, block, members that answered "not here")``), in the
        background, within ``repair_bytes`` (past it a repair is dropped, counted; the next
        read or the anti-entropy pass repairs the block)."""
        todo: list[tuple[bytes, Block, list[str]]] = []
        held = 0
        for key, block, not_here in found:
            owners = self.members.live_owners(key, self.replicas)
            targets = [m for m in not_here if m in owners]
            if not targets:
                continue
            if self._repair_held + held + block.nbytes > self.repair_bytes:
                self.counts["read_repairs_dropped"] += 1
                continue
            held += block.nbytes
            todo.append((key, block, targets))
        if todo:
            self.start_repair(self._repair(todo, held), held)

    async def _repair(self, todo: list[tuple[bytes, Block, list[str]]], held: int) -> None:
        try:
            await self._repair_batches(todo)
        finally:
            self._repair_held -= held

    async def _repair_batches(self, todo: list[tuple[bytes, Block, list[str]]]) -> None:
        """Copy each ``(key, block, targets)`` to its targets with ``?fill=1``: one batch
        put per member, all members at once. Not one request per key: a read that finds
        a member back empty has hundreds of holes on it, and that burst queues past the
        client's connections, so under load most copies time out unsent and are lost."""
        frames = [await self._encode(key, block) for key, block, _ in todo]
        per_member: dict[str, list[int]] = defaultdict(list)
        for i, (_, _, targets) in enumerate(todo):
            for member in targets:
                per_member[member].append(i)

        async def copy(member: str, idx: list[int]) -> None:
            if self._is_local(member):
                for i in idx:
                    if await self._put_to(member, "repair", todo[i][0], todo[i][1],
                                          frames[i], fill=True) is not FAILED:
                        self.counts["read_repairs"] += 1
                return
            items = [(todo[i][0], frames[i]) for i in idx]
            put = partial(self.members.client(member).put_many, items, fill=True)
            if await self._call(member, "repair", put, len(items)) is not FAILED:
                self.counts["read_repairs"] += len(items)

        await asyncio.gather(*(copy(m, idx) for m, idx in per_member.items()))

    async def _exists(self, member: str, keys: list[bytes]) -> list[bool]:
        if self._is_local(member):
            return await self.local.contains_many(keys)  # type: ignore[union-attr]
        return await self.members.client(member).exists_many(keys)

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if self.local_reads is not None:
            return await self.local_reads.contains_many(keys)
        got, missed, _ = await self._rounds(keys, "exists", self._exists, bool)
        self._report_unanswered(keys, got, missed)
        return [bool(g) for g in got]

    def _report_unanswered(self, keys: Sequence[bytes], results: list[Any],
                           missed: list[list[str]]) -> None:
        """A missed key one of whose owners did not answer "not here" (down, suspected,
        failed or too slow) is unavailable, not absent: say so to the store (``explain``,
        miss reasons), naming the owners and their state (:func:`silent_owners`)."""
        lost: dict[str, list[bytes]] = defaultdict(list)
        for key, result, answered in zip(keys, results, missed, strict=True):
            if result is None or result is False:
                owners = self.members.ring.owners(key, self.replicas)
                why = silent_owners(owners, answered, self.members.detector.describe)
                if why is not None:
                    lost[why].append(key)
        for why, group in lost.items():
            self._report_miss(group, MissReason.UNAVAILABLE,
                              f"{why} (timeout={self.timeout:g}s)")

    async def _put_many_once(self, items: Sequence[tuple[bytes, Block]]) -> None:
        await self._start()
        frames = [await self._encode(key, block) for key, block in items]
        orders = [self._order(k) for k, _ in items]
        want, need = self._copies()
        used = [set(self._write_targets(k, want)) for k, _ in items]
        stored = [0] * len(items)
        plan: dict[str, list[int]] = defaultdict(list)
        for i, owners in enumerate(used):
            for member in owners:
                plan[member].append(i)
        while plan:
            groups = list(plan.items())
            replies = await asyncio.gather(*(
                self._call(m, "put", lambda m=m, idx=idx: self._store_many(m, items, frames, idx))  # type: ignore[misc]
                for m, idx in groups))
            plan = defaultdict(list)
            for (_member, idx), reply in zip(groups, replies, strict=True):
                for i in idx:
                    if reply is not FAILED:
                        stored[i] += 1
                        continue
                    fallback = self._next(None, orders[i], used[i])
                    if fallback is not None:
                        used[i].add(fallback)
                        plan[fallback].append(i)
        self.counts["copies_made"] += sum(stored)
        self.counts["puts_under_replicated"] += sum(1 for n in stored if n < want)
        hinted = [self._hint_failing_owners(key, want) for key, _ in items]
        short = sum(1 for n, h in zip(stored, hinted, strict=True)
                    if n < max(need, 1) and not self._hints_cover(n, h, need))
        if short:
            raise PeerError(f"{self.name}: {short} of {len(items)} blocks stored on fewer than "
                            f"{max(need, 1)} peers (ack={self.ack}, replicas={self.replicas})")

    async def _store_many(self, member: str, items: Sequence[tuple[bytes, Block]],
                          frames: list[EncodedFrame], idx: list[int]) -> None:
        if self._is_local(member):
            await self.local.put_many([items[i] for i in idx])  # type: ignore[union-attr]
        elif len(idx) == 1:
            await self.members.client(member).put(items[idx[0]][0], frames[idx[0]])
        else:
            await self._put_frames(member, [(items[i][0], frames[i]) for i in idx])

    async def _put_frames(self, member: str, frames: list[tuple[bytes, EncodedFrame]], *,
                          fill: bool = False) -> None:
        """Batch puts of ``frames`` onto ``member`` (``fill``: only those it lacks)."""
        await self.members.client(member).put_many(frames, fill=fill)

    async def _delete_many_once(self, keys: Sequence[bytes]) -> list[bool]:
        # Copies may sit on fallback owners written while an owner was down: ask every member.
        await self._start()
        members = [m for m in self.members.members if self.members.alive(m)]

        async def one(member: str) -> list[bool]:
            if self._is_local(member):
                return [await self.local.delete(k) for k in keys]  # type: ignore[union-attr]
            client = self.members.client(member)
            if len(keys) == 1:
                return [await client.delete(keys[0])]
            return await client.delete_many(keys)

        replies = await asyncio.gather(*(self._call(m, "delete", lambda m=m: one(m))  # type: ignore[misc]
                                         for m in members))
        self._hint_missed_deletes(keys, {m for m, r in zip(members, replies, strict=True)
                                         if not isinstance(r, list)})
        out = [False] * len(keys)
        for reply in replies:
            if isinstance(reply, list):
                out = [a or bool(b) for a, b in zip(out, reply, strict=True)]
        return out

    # ------------------------------------------------------------------ close
    async def locate(self, keys: Sequence[bytes], deadline: float | None
                     ) -> dict[str, LocalPrefix]:
        """Ask every other member (``POST /v1/locate``, concurrently, within ``deadline``
        seconds; ``None``: this tier's ``timeout``) how many leading ``keys`` it serves
        locally; late or failing members are left out. See
        :func:`kvtier.peer.locate.locate_prefix`."""
        others = [m for m in self.members.members if m != self.members.self_id]
        return await locate_prefix(others, keys, token=self._token,
                                   deadline=self.timeout if deadline is None else deadline,
                                   ssl_context=self._ssl_context,
                                   tls_server_name=self._tls_server_name)

    async def flush(self) -> None:
        """Wait for background copies (``ack=one`` puts, cancelled puts) and read repairs."""
        while self._background or self._repairs:
            await asyncio.gather(*self._background, *self._repairs, return_exceptions=True)

    async def _aclose(self) -> None:
        for straggler in list(self._stragglers):
            straggler.cancel()
        try:
            await asyncio.wait_for(self.flush(), timeout=max(self.timeout * 4, 1.0))
        except TimeoutError:
            log.warning("%s: closing with %d background copies unfinished", self.name,
                        len(self._background) + len(self._repairs))
            for task in [*self._background, *self._repairs]:
                task.cancel()
        await self.members.close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), **self.counts, "members": list(self.members.members),
                "hints": len(self._hints), "hints_dropped": self._hints.dropped,
                "dead": sorted(self.members.dead), "replicas": self.replicas,
                "walk_limit": self.walk_limit(), "repairs_in_flight": len(self._repairs),
                "placement": self.placement,
                **({} if self.local_reads is None else self.local_reads.stats()),
                "member_failures": self.members.failures,
                "member_recoveries": self.members.recoveries,
                "answer_buffers_reserved": self.answer_buffers.reserved_bytes,
                "answer_buffers_reused": self.answer_buffers.reused}


def check_placement(placement: str) -> str:
    """``placement`` if this pool supports it, else a :class:`ConfigError` that says why."""
    if placement in PLACEMENTS:
        return placement
    kind = placement.partition(":")[0]
    if kind in ("anchor", "chunk", "root"):
        raise ConfigError(
            f"placement={placement}: chain placement was removed (a block's owner depended on "
            "what each process had seen of its chain, and blocks were lost); use "
            "placement=block (every block on its own key's owners) or placement=local (a "
            "block stays on the member that computed it, found through the holder directory)")
    raise ConfigError(f"placement: expected one of {', '.join(PLACEMENTS)}, got {placement!r}")
