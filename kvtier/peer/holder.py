"""A member's side of ``placement=local``: it registers what it holds in the holder
directory, and forwards a block's last copy by global age when its segment evicts it.

* **Register.** Every block stored on this member (a client's put, a forwarded last copy, a
  read's local copy, a repair push) is registered with the key's directory owners (its
  first ``replicas`` live ring members, see :mod:`kvtier.peer.directory`) before the store
  is acknowledged, one request per directory owner for a batch; a delete deregisters.
* **An overwrite supersedes.** A client's write through another home lands on other members
  than the value before it: the registration answers the key's holders, and with more than
  ``replicas`` of them the others are asked to drop a copy older than the write whose
  content differs (no tombstone), before the write is acknowledged (``superseded``).
* **Forward by global age** (the Global Memory Service, Feeley et al., SOSP 1995; N-chance
  forwarding, Dahlin et al., OSDI 1994). When the segment's last tier evicts a block for
  good, this member first takes itself off the key's directory entry, which answers the
  holders left. With at least ``replicas`` left the copy goes. Otherwise it is a last copy:
  it is sent to the member whose oldest blocks are oldest, among those whose oldest blocks
  are older than it (a member with free room counts as oldest of all), and dropped only
  when it is the oldest anywhere (a member that is down counts as of its last health
  document: with room or older blocks it may take the copy, which then stays, refusing
  the put that needed the room). Members learn each other's age from ``/v1/health``
  (``evict_age``: the age of the block its segment evicts next; ``null`` while it has
  evicted nothing) on every health probe. A forwarded block keeps its age
  (``?age=`` on the forward), so the wave of victims it sets off only ever moves to older
  members. When no older member takes it (all failed), the victim stays and the put that
  needed the room fails (``507``), so a copy is never lost to a failed forward.
* **Entries are checked before they are trusted.** A member restarted empty is still named
  by the entries of what it held (nothing tells the directory what a dead process held).
  An eviction asks the holders left whether they hold the block before it counts them (to
  drop a spare or an oldest copy, and to leave them out of the forward's targets), and the
  anti-entropy pass asks the other holders before it decides a block has ``replicas``
  copies; a member that answers "not here" is taken off the entry (``stale_holders``).
* **Spare copies never displace a last copy.** A fill put without an age (a read's copy
  home, a repair push: :func:`spare_copies`) takes free room or evicts spare copies only;
  a last copy it would evict stays and the put is refused (``spare_refused``).
* **Spare copies go first.** A put that needs room this member's segment lacks (a
  client's put, a forwarded last copy) first drops spare copies held here: blocks that at
  least ``replicas`` other members hold, each of them asked (:meth:`LocalHolder.make_room`,
  ``spares_reclaimed``), so the segment's eviction does not forward or drop a needed copy,
  or drop the oldest block anywhere, while a duplicate sits here. Spare stores are checked
  first, then the oldest blocks.
* Two members dropping their copies of one block at once each take themselves off the
  entry in one step of every directory owner, so one of them sees the other gone and
  forwards; with several directory owners the smallest count answered decides (an owner
  that did not answer within half the pool's ``timeout`` counts as none left).

A block's age here is the time since its last access on this member: its store or its
last read, whichever is later (the Global Memory Service's age). A forwarded block arrives
with its age. ``evict_age`` is the age of the block the segment evicts next (its least
recently used block under the default ``lru`` policy), so the age a member reports and the
order its segment evicts in agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from kvtier.codec import encode_frame
from kvtier.errors import TierFullError
from kvtier.peer.directory import frame_digest
from kvtier.tiers.base import Block, Tier

if TYPE_CHECKING:
    from kvtier.peer.server import PeerServer
    from kvtier.peer.tier import PeerTier

__all__ = ["LocalHolder", "spare_copies"]

log = logging.getLogger("kvtier.peer.holder")
_FORWARD_TRIES = 3  # older members a last copy is offered to before it stays here
_REPAIR_BATCH = 512
_RECLAIM_SCAN = 128  # keys checked for a spare copy per reclaim (spare stores, then oldest)
_RECLAIM_MIN = 8  # blocks of room a reclaim frees at least (one lookup serves many puts)
_RECLAIM_IDLE = 0.5  # seconds a reclaim that found no spare is not tried again
_SPARE_HINTS = 1 << 16  # keys stored here as spare copies, remembered to check first
# Set while this member stores spare copies (a fill put without an age: a read's copy
# home, a repair push), whose evictions must not cost another block its last copy.
_SPARE: ContextVar[bool] = ContextVar("kvtier_peer_spare_copies", default=False)


@contextlib.contextmanager
def spare_copies(spare: bool) -> Iterator[None]:
    """Mark the segment puts made inside as spare copies (``spare``): they take free room or
    displace spare copies only; an eviction they set off whose victim is a last copy keeps
    it and refuses the spare copy (:class:`TierFullError`, ``507``), so room is never bought
    for a second copy of one block with the only copy of another (here, or wherever the
    forward of the victim would set off a drop)."""
    token = _SPARE.set(spare)
    try:
        yield
    finally:
        _SPARE.reset(token)


class LocalHolder:
    """Directory registration and global-age forwarding of one ``kvtier serve`` member.

    Parameters
    ----------
    server
        This member's server (its segment holds the blocks; its directory answers for the
        keys this member is a directory owner of).
    pool
        This member's ``peers://?placement=local`` tier (``self=`` this member, ``local=``
        its segment): membership, ring, clients and the other members' health documents.
    """

    def __init__(self, server: PeerServer, pool: PeerTier) -> None:
        if pool.members.self_id is None:
            raise ValueError("pool: needs self= (this member's id)")
        self.server = server
        self.pool = pool
        self.me: str = pool.members.self_id
        self.born: dict[bytes, float] = {}  # key -> when its age began (monotonic)
        self._victim: tuple[float, float] | None = None  # (age, when) of the last victim
        self.counts: dict[str, int] = defaultdict(int)
        self._updates: set[asyncio.Future[Any]] = set()  # in background
        self._last: Tier = server.segment  # type: ignore[assignment]  # set by attach
        self._spare_hints: dict[bytes, None] = {}  # stored as spare copies, oldest first
        self._reclaim = asyncio.Lock()
        self._evicting: set[bytes] = set()  # keys whose eviction here is deciding
        self._no_spares_until = 0.0

    def attach(self) -> None:
        """Hook this holder into the server (registration on stores and deletes, the age in
        ``/v1/health``) and into its segment's last tier (forwarding on eviction)."""
        self.server.holder = self
        self.pool.directory = self.server.directory
        segment = self.server.segment
        tiers = getattr(segment, "tiers", None)
        last: Tier = tiers[-1] if isinstance(tiers, list) and tiers else segment  # type: ignore[assignment]
        last.on_evict = self.evicted
        self._last = last

    # ------------------------------------------------------------------ ages
    def evict_age(self) -> float | None:
        """Seconds: the age of the block this member's segment evicts next (``None``: it has
        evicted nothing yet). ``born`` is kept in the segment's recency order (a store or
        a read moves a key last), so its first key is the least recently used block, the
        next victim of the default ``lru`` policy: the age reported is the age of what a
        forward to this member displaces, not of a victim evicted long ago (a member whose
        last victim was young kept looking young while older blocks sat in it)."""
        if self._victim is None:
            return None
        now = time.monotonic()
        first = next(iter(self.born), None)
        if first is None:
            age, when = self._victim
            return age + (now - when)
        return now - self.born[first]

    def touched(self, keys: Sequence[bytes]) -> None:
        """Keys read here: their age begins again (a block's age is the time since its last
        access, as in the Global Memory Service), and they move last in ``born``'s order,
        as in the segment's recency order."""
        now = time.monotonic()
        born = self.born
        for key in keys:
            if key in born:
                del born[key]
                born[key] = now

    def _age_of(self, member: str, nbytes: int) -> float:
        """``member``'s oldest blocks' age from its last health document (infinite when it
        has room for ``nbytes`` more, or has evicted nothing; -1 when unknown)."""
        doc = self.pool.members.health.get(member)
        if not doc:
            return -1.0
        capacity, used = doc.get("capacity"), doc.get("used")
        if isinstance(capacity, int) and isinstance(used, int) and used + nbytes <= capacity:
            return math.inf
        age = doc.get("evict_age")
        return math.inf if age is None else float(age)

    # ------------------------------------------------------------------ directory
    def _directory_owners(self, key: bytes) -> list[str]:
        return self.pool.members.live_owners(key, self.pool.replicas)

    async def _update(self, member: str, add: Sequence[bytes], remove: Sequence[bytes]
                      ) -> list[list[str]] | None:
        """One directory update at ``member`` (this member's own directory directly);
        ``None`` when it did not answer."""
        if member == self.me:
            return self.server.directory.update(self.me, add, remove)
        try:
            return await self.pool.members.client(member).dir_update(self.me, add, remove)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # that owner is refilled by the next anti-entropy pass
            self.counts["directory_failed"] += 1
            log.debug("directory update at %s failed: %s", member, exc)
            return None

    async def _register_at(self, member: str, keys: Sequence[bytes]) -> list[list[str]] | None:
        """Register ``keys`` at directory owner ``member``; per key, its holders there after
        the update (``None`` when it did not answer)."""
        if member == self.me:
            self.server.directory.update(self.me, keys, ())
            return self.server.directory.lookup(keys)
        try:
            return await self.pool.members.client(member).dir_register(self.me, keys)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # that owner is refilled by the next anti-entropy pass
            self.counts["directory_failed"] += 1
            log.debug("directory update at %s failed: %s", member, exc)
            return None

    async def register(self, keys: Sequence[bytes], supersede: bool = False) -> None:
        """Tell the directory owners of ``keys`` that this member holds them: returns once
        each key's entry is recorded at one of its owners (a reader walks the owners), or
        every owner failed; the other owners' updates finish in the background, so a frozen
        owner does not stall puts until it is taken out of the path. ``supersede`` (a
        client's write landed here): the older values other holders the directory names
        keep are dropped first (:meth:`_supersede`)."""
        plan: dict[str, list[bytes]] = defaultdict(list)
        firsts: dict[bytes, list[str]] = {}
        for key in keys:
            owners = self._directory_owners(key)
            firsts[key] = owners
            for owner in owners:
                plan[owner].append(key)
        tasks = {asyncio.ensure_future(self._register_at(m, ks)): ks for m, ks in plan.items()}
        for task in tasks:
            self._updates.add(task)
            task.add_done_callback(self._updates.discard)
        pending = set(tasks)
        unrecorded = {k for k, owners in firsts.items() if owners}
        holders: dict[bytes, set[str]] = defaultdict(set)
        while pending and unrecorded:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                answer = task.result()
                if answer is not None:
                    unrecorded.difference_update(tasks[task])
                    for key, found in zip(tasks[task], answer, strict=True):
                        holders[key].update(found)
        self.counts["registered"] += len(keys)
        if supersede:
            # More holders than copies a write makes: some hold a value from before it.
            await self._supersede({k: found - {self.me} for k, found in holders.items()
                                   if len(found) > self.pool.replicas})

    async def _supersede(self, others: dict[bytes, set[str]]) -> None:
        """A client's write of each key of ``others`` landed here: drop the older values the
        members of ``others`` hold (a write through another home goes to other members
        than the one before it, so the older copies would stay readable). Each member
        drops its copy only where it is older than this write's stamp and its content
        differs (an equal block, as two hosts that computed one prefix hold, stays a copy),
        and leaves no tombstone; one request per member, within the pool's timeout, before
        the write is acknowledged."""
        if not others:
            return
        stamps = self.server.versions.stamps
        keys = list(others)
        blocks = await self.server.segment.get_many(keys)
        plan: dict[str, list[tuple[bytes, int, int]]] = defaultdict(list)
        for key, block in zip(keys, blocks, strict=True):
            stamp = stamps.get(key, 0)
            if block is None or stamp <= 0:
                continue  # evicted or written again meanwhile: nothing of this write to keep
            digest = frame_digest(self.server.frames.encode(key, block).header)
            for member in others[key]:
                if self.pool.members.reachable(member):
                    plan[member].append((key, stamp - 1, digest))

        async def drop(member: str, items: list[tuple[bytes, int, int]]) -> None:
            try:
                flags = await asyncio.wait_for(self.pool.members.client(member).drop_superseded(
                    [k for k, _, _ in items], [s for _, s, _ in items],
                    [d for _, _, d in items]), self.pool.timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # its older copy stays until a read or write finds it
                self.counts["supersede_failed"] += len(items)
                log.debug("dropping superseded copies at %s failed: %s", member, exc)
                return
            self.counts["superseded"] += sum(flags)

        await asyncio.gather(*(drop(m, items) for m, items in plan.items()))

    async def unregister(self, keys: Sequence[bytes]) -> list[tuple[int, set[str]]]:
        """Take this member off the directory entries of ``keys``; per key, the fewest
        holders left that a directory owner answered (0 when none answered) and every
        holder left that any named."""
        plan: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            for owner in self._directory_owners(key):
                plan[owner].append(i)
        tasks = [asyncio.ensure_future(self._update(m, (), [keys[i] for i in idx]))
                 for m, idx in plan.items()]
        for task in tasks:
            self._updates.add(task)
            task.add_done_callback(self._updates.discard)
        # A slow owner (frozen, not yet out of the path) is not waited for past half the
        # pool's timeout: it counts as none left (the copy is forwarded, never lost), and
        # its update still lands in the background.
        if tasks:
            await asyncio.wait(tasks, timeout=self.pool.timeout / 2)
        answers = [t.result() if t.done() and not t.cancelled() else None for t in tasks]
        fewest: list[int | None] = [None] * len(keys)
        left: list[set[str]] = [set() for _ in keys]
        for idx, answer in zip(plan.values(), answers, strict=True):
            if answer is None:
                continue
            for i, holders in zip(idx, answer, strict=True):
                others = set(holders) - {self.me}
                left[i] |= others
                fewest[i] = len(others) if fewest[i] is None else min(fewest[i] or 0,
                                                                       len(others))
        return [(n or 0, s) for n, s in zip(fewest, left, strict=True)]

    async def _confirmed(self, key: bytes, listed: set[str]) -> set[str]:
        """The members of ``listed`` that answer that they hold ``key``. A directory entry
        outlives a copy whose member restarted empty (nothing tells the directory what a
        dead process held): trusting it would drop a spare or oldest copy that is the last
        one, and keep the member with room out of the forward's targets. A member that
        answers "not here" is taken off the entry; one that does not answer counts as
        holding none (the copy is forwarded, never lost)."""
        members = self.pool.members
        ask = [m for m in listed if members.reachable(m)]
        answers = await asyncio.gather(*(self._holds(m, key) for m in ask))
        for member, held in zip(ask, answers, strict=True):
            if held is False:
                self.counts["stale_holders"] += 1
                for owner in self._directory_owners(key):
                    self._spawn(self._update_for(owner, member, (key,)))
        return {m for m, held in zip(ask, answers, strict=True) if held}

    async def _holds(self, member: str, key: bytes) -> bool | None:
        """Whether ``member`` holds ``key`` (``None``: no answer within half the timeout)."""
        try:
            [held] = await asyncio.wait_for(
                self.pool.members.client(member).exists_many([key]), self.pool.timeout / 2)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("presence of %s at %s unknown: %s", key.hex(), member, exc)
            return None
        return bool(held)

    async def _update_for(self, owner: str, holder: str, remove: Sequence[bytes]) -> None:
        """Take ``holder`` off the entries of ``remove`` at directory owner ``owner``."""
        if owner == self.me:
            self.server.directory.update(holder, (), remove)
            return
        try:
            await self.pool.members.client(owner).dir_update(holder, (), remove)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the entry stays stale; the next eviction checks again
            self.counts["directory_failed"] += 1
            log.debug("stale entry removal at %s failed: %s", owner, exc)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Future[Any] = asyncio.ensure_future(coro)
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)

    # ------------------------------------------------------------------ server hooks
    async def stored(self, keys: Sequence[bytes], age: float | None = None,
                     spare: bool = False) -> None:
        """Keys stored on this member (``age``: a forwarded block's age; ``spare``: spare
        copies, see :func:`spare_copies`): registered before the store is acknowledged."""
        # A batch's first blocks may be evicted by its last ones before this runs: those
        # are left out of ``born``, whose first key must be a block the segment holds.
        held = await self.server.segment.contains_many(keys)
        now = time.monotonic()
        for key, here in zip(keys, held, strict=True):  # young again, and last in order
            self.born.pop(key, None)
            if not here:
                continue
            self.born[key] = now - (age or 0.0)
            self._spare_hints.pop(key, None)
            if spare:
                self._spare_hints[key] = None
        while len(self._spare_hints) > _SPARE_HINTS:
            del self._spare_hints[next(iter(self._spare_hints))]
        await self.register(keys, supersede=age is None and not spare)

    async def deleted(self, keys: Sequence[bytes]) -> None:
        """Keys deleted here: off the directory."""
        for key in keys:
            self.born.pop(key, None)
            self._spare_hints.pop(key, None)
        await self.unregister(keys)

    async def evicted(self, key: bytes, block: Block) -> None:
        """The segment's last tier evicts ``key``: drop a spare copy, forward a last copy
        to an older member, or drop the oldest copy anywhere. Raises
        :class:`TierFullError` (the victim stays) when every older member failed."""
        self._evicting.add(key)
        try:
            await self._evicted(key, block)
        finally:
            self._evicting.discard(key)

    def refuse_forwards(self, keys: Sequence[bytes]) -> None:
        """Refuse a forward of ``keys`` (:class:`TierFullError`, ``507``) while one of them
        is being evicted here: the copy still here would make the forward's fill a no-op
        that answers "stored", and the sender would drop its copy as this one leaves (two
        members evicting one block at once, each the other's forward target, lost it)."""
        busy = next((k for k in keys if k in self._evicting), None)
        if busy is not None:
            raise TierFullError(f"block {busy.hex()} is being evicted here")

    async def _evicted(self, key: bytes, block: Block) -> None:
        now = time.monotonic()
        born = self.born.pop(key, now)
        self._spare_hints.pop(key, None)
        age = now - born
        self._victim = (age, now)
        [(count, left)] = await self.unregister([key])
        if count > 0:  # the entry may name members that lost the block (restarted empty)
            left = await self._confirmed(key, left)
            count = min(count, len(left))
        if count >= self.pool.replicas:
            self.counts["dropped_spare"] += 1
            return
        if _SPARE.get():  # forwarded on, its eviction there could drop another last copy
            self.counts["spare_refused"] += 1
            self.born[key] = born
            await self.register([key])
            raise TierFullError(f"block {key.hex()} stays: a spare copy does not displace a "
                                "last copy")
        members = self.pool.members
        # A member back from a restart answers probes before it rejoins the path, with room.
        ages = {m: self._age_of(m, block.nbytes) for m in members.members
                if m != self.me and m not in left
                and (members.alive(m) or members.reachable(m))}
        older = sorted((m for m, a in ages.items() if a > age), key=lambda m: -ages[m])
        if not older:
            # A member that is down (restarting empty, or frozen) counts as of its last
            # health document: with room or older blocks than this one (or unknown), this
            # is not the oldest block anywhere. Its only copy then stays, and the put that
            # needed the room is refused (507): a restart otherwise cost the blocks it
            # would have taken.
            waiting = [m for m in self._down()
                       if not 0 <= self._age_of(m, block.nbytes) <= age]
            if count == 0 and waiting:
                self.counts["kept_last"] += 1
                self.born[key] = born
                await self.register([key])
                raise TierFullError(f"block {key.hex()} stays: its last copy, and "
                                    f"{waiting[0]}, which is down, may take it")
            # With another copy confirmed on a live member the block is not lost (one
            # member down leaves R - 1); else it is the oldest anywhere.
            self.counts["dropped_oldest" if count == 0 else "dropped_copy"] += 1
            return
        frame = encode_frame(block, key=key)
        for member in older[:_FORWARD_TRIES]:
            try:
                await members.client(member).forward([(key, frame)], age)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.counts["forward_failed"] += 1
                log.debug("forward of %s to %s failed: %s", key.hex(), member, exc)
                continue
            self.counts["forwarded"] += 1
            return
        self.born[key] = born
        await self.register([key])
        raise TierFullError(f"block {key.hex()} stays: no older member took its last copy")

    def _down(self) -> list[str]:
        """The other members out of the path that do not answer probes either."""
        members = self.pool.members
        return [m for m in members.members if m != self.me and not members.alive(m)
                and not members.reachable(m)]

    # ------------------------------------------------------------------ spares first
    async def make_room(self, nbytes: int) -> None:
        """Before a put of about ``nbytes`` that is not a spare copy itself: when the
        segment's last tier lacks the room, drop spare copies held here (blocks that at
        least ``replicas`` other members hold, each asked), so that the eviction the put
        sets off does not forward or drop a needed copy, or drop the oldest block anywhere,
        while a duplicate sits here (the Global Memory Service drops duplicates first).
        Spare stores are checked first, then the oldest blocks; one reclaim frees room for
        at least ``_RECLAIM_MIN`` blocks, and one that found no spare is not tried again
        for ``_RECLAIM_IDLE`` seconds."""
        if not self._short(nbytes) or time.monotonic() < self._no_spares_until:
            return
        async with self._reclaim:  # the puts waiting here find the room it freed
            if not self._short(nbytes) or time.monotonic() < self._no_spares_until:
                return
            block = max(1, self._last.used // max(1, len(self.born)))  # about one block
            want = max(_RECLAIM_MIN, -(-self._short(nbytes) // block))
            dropped = await self._drop_spares(self._reclaim_candidates(), want)
            if not dropped:
                self._no_spares_until = time.monotonic() + _RECLAIM_IDLE

    def _short(self, nbytes: int) -> int:
        """Bytes the last tier lacks for ``nbytes`` more (0: it has the room)."""
        capacity = self._last.capacity
        return 0 if capacity is None else max(0, self._last.used + nbytes - capacity)

    def _reclaim_candidates(self) -> list[bytes]:
        """The oldest spare stores, then the oldest blocks here (``_RECLAIM_SCAN`` keys)."""
        picked = dict.fromkeys(itertools.islice(self._spare_hints, _RECLAIM_SCAN // 2))
        for key in self.born:
            if len(picked) >= _RECLAIM_SCAN:
                break
            picked[key] = None
        return list(picked)

    async def _drop_spares(self, keys: list[bytes], want: int) -> list[bytes]:
        """Drop up to ``want`` of ``keys`` that are spare copies here, oldest first: each
        listed with at least ``replicas`` other holders that answer they hold it, then
        taken off its entries in one step of every directory owner (kept, and registered
        again, where an owner answered fewer holders left: another member dropped its copy
        meanwhile). A key written here meanwhile is kept."""
        if not keys:
            return []
        replicas = self.pool.replicas
        holders = await self.pool.directory_holders(keys)
        listed = {k: {m for m in found if m != self.me}
                  for k, found in zip(keys, holders, strict=True)}
        listed = {k: others for k, others in listed.items() if len(others) >= replicas}
        confirmed = await self._held_by(listed)
        spares = [k for k in keys if len(confirmed.get(k, ())) >= replicas][:want]
        if not spares:
            return []
        with self.server.watch_writes() as written:
            left = await self.unregister(spares)
            drop = [k for k, (count, _) in zip(spares, left, strict=True) if count >= replicas]
            dropped = await self.server.drop_copies(drop, written)
        gone = set(dropped)
        kept = [k for k in spares if k not in gone]
        if kept:
            here = await self.server.segment.contains_many(kept)
            await self.register([k for k, h in zip(kept, here, strict=True) if h])
        for key in dropped:
            self.born.pop(key, None)
            self._spare_hints.pop(key, None)
        self.counts["spares_reclaimed"] += len(dropped)
        return dropped

    async def _held_by(self, listed: dict[bytes, set[str]]) -> dict[bytes, set[str]]:
        """Per key, the members of its ``listed`` set that answer that they hold it (one
        request per member, within half the pool's timeout; no answer counts as not
        held)."""
        members = self.pool.members
        ask: dict[str, list[bytes]] = defaultdict(list)
        for key, others in listed.items():
            for member in others:
                if members.alive(member):
                    ask[member].append(key)

        async def flags(member: str, ks: list[bytes]) -> list[bool]:
            try:
                return [bool(f) for f in await asyncio.wait_for(
                    members.client(member).exists_many(ks), self.pool.timeout / 2)]
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("presence at %s unknown: %s", member, exc)
                return [False] * len(ks)

        answers = await asyncio.gather(*(flags(m, ks) for m, ks in ask.items()))
        held: dict[bytes, set[str]] = defaultdict(set)
        for (member, ks), got in zip(ask.items(), answers, strict=True):
            for key, here in zip(ks, got, strict=True):
                if here:
                    held[key].add(member)
        return held

    # ------------------------------------------------------------------ repair
    async def repair_pass(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Register every key held here with its current directory owners (a restarted or
        new owner is refilled) and copy a block with fewer than ``replicas`` holders to the
        next members of its ring order (the first live holder of a key does); returns the
        pass's counters."""
        done: dict[str, int] = defaultdict(int)
        segment = self.server.segment
        for start in range(0, len(keys), _REPAIR_BATCH):
            chunk = list(keys[start:start + _REPAIR_BATCH])
            present = await segment.contains_many(chunk)
            for key, here in zip(chunk, present, strict=True):
                if not here:
                    self.server.stored_keys.pop(key, None)
                    self.born.pop(key, None)
                    self._spare_hints.pop(key, None)
            chunk = [k for k, here in zip(chunk, present, strict=True) if here]
            if not chunk:
                continue
            done["checked"] += len(chunk)
            await self.register(chunk)
            holders = await self.pool.directory_holders(chunk)
            await self._restore_copies(chunk, holders, done)
        return dict(done)

    async def _restore_copies(self, keys: list[bytes], holders: list[list[str]],
                              done: dict[str, int]) -> None:
        """Copy each key of ``keys`` with fewer than ``replicas`` live holders to the members
        that lack it (this member does it when it is the key's first live holder in sort
        order), to the members with room or the oldest blocks first, the next one when one
        refuses (a spare copy, :func:`spare_copies`: a full member whose victim is a last
        copy refuses it). Sent as a forward that displaces other blocks, the copies churned
        a pool fuller than its budget: more last copies went as the oldest."""
        members = self.pool.members
        want = min(self.pool.replicas, len(members.members))
        holders = await self._present(keys, holders)
        # key -> (members not tried yet, copies still missing)
        todo: dict[bytes, tuple[list[str], int]] = {}
        for key, found in zip(keys, holders, strict=True):
            live = [m for m in dict.fromkeys([*found, self.me]) if members.alive(m)
                    or m == self.me]
            if len(live) >= want or min(live) != self.me:
                continue  # enough copies, or another holder restores this one
            done["under_replicated"] += 1
            targets = [m for m in members.order(key) if m not in live and members.alive(m)]
            todo[key] = (targets, want - len(live))
        blocks = dict(zip(todo, await self.server.segment.get_many(list(todo)), strict=True))
        while todo:
            plan: dict[str, list[bytes]] = defaultdict(list)
            for key, (targets, _) in list(todo.items()):
                block = blocks[key]
                if block is None or not targets:
                    del todo[key]
                    continue
                best = max(targets, key=lambda m: self._age_of(m, block.nbytes))
                targets.remove(best)
                plan[best].append(key)
            for member, ks in plan.items():
                frames = [(k, encode_frame(blocks[k], key=k)) for k in ks]  # type: ignore[arg-type]
                try:
                    await members.client(member).put_many(frames, fill=True)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the next target, else the next pass
                    done["failed"] += 1
                    log.debug("copy restore to %s failed: %s", member, exc)
                    continue
                done["pushed"] += len(frames)
                for key in ks:
                    targets, missing = todo[key]
                    if missing <= 1:
                        del todo[key]
                    else:
                        todo[key] = (targets, missing - 1)

    async def _present(self, keys: list[bytes], holders: list[list[str]]) -> list[list[str]]:
        """``holders`` less the members that answer that they lack the key (restarted
        empty since they registered it), who are taken off its directory entries; one
        request per other live holder for the batch."""
        members = self.pool.members
        ask: dict[str, list[int]] = defaultdict(list)
        for i, found in enumerate(holders):
            for member in found:
                if member != self.me and members.alive(member):
                    ask[member].append(i)
        gone: list[set[str]] = [set() for _ in keys]
        for member, idx in ask.items():
            try:
                flags = await asyncio.wait_for(members.client(member).exists_many(
                    [keys[i] for i in idx]), self.pool.timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unknown: trusted, as before; the next pass asks again
                log.debug("presence check at %s failed: %s", member, exc)
                continue
            stale = [keys[i] for i, held in zip(idx, flags, strict=True) if not held]
            for i, held in zip(idx, flags, strict=True):
                if not held:
                    gone[i].add(member)
            if stale:
                self.counts["stale_holders"] += len(stale)
                plan: dict[str, list[bytes]] = defaultdict(list)
                for key in stale:
                    for owner in self._directory_owners(key):
                        plan[owner].append(key)
                for owner, ks in plan.items():
                    self._spawn(self._update_for(owner, member, ks))
        return [[m for m in found if m not in g] for found, g in zip(holders, gone, strict=True)]

    def stats(self) -> dict[str, Any]:
        """Counters: ``registered``, ``forwarded``, ``dropped_spare``, ``dropped_oldest``,
        ``dropped_copy`` (a copy dropped, no member to take it, another live copy left),
        ``kept_last`` (a last copy kept while a member is down, its put refused),
        ``forward_failed``, ``directory_failed``, ``stale_holders`` (directory entries found
        naming a member that lacks the block), ``spare_refused`` (spare copies refused
        rather than drop a last copy), ``spares_reclaimed`` (spare copies dropped to make
        room before an eviction); ``directory_keys``; ``evict_age``."""
        return {**self.counts, "directory_keys": len(self.server.directory),
                "evict_age": self.evict_age()}
