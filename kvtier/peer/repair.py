"""Anti-entropy: a node re-replicates the blocks it holds to their current owners.

A put lands on a key's first live owners; when an owner is down it lands on the next live
member instead (a fallback copy), and a member that restarts empty, or one that joins,
holds none of the keys it now owns. Reads walk past such holes and repair what they read
(:class:`kvtier.peer.tier.PeerTier`), but a block nobody reads keeps fewer copies than
``replicas`` until a second failure loses it. :class:`AntiEntropy` closes that gap: a pass
walks the keys this node holds, asks each key's current owners (one batch-exists request per
owner and batch) whether they hold it, and pushes the block to those that do not.
``kvtier serve --pool POOL_URL`` runs it by default.

* A pass runs only when the membership changed (a member failed, restarted, joined or left,
  as this node's health probes see it) since the last pass that reached every owner, or
  when this node was stopped for over a second (SIGSTOP, a paused VM: its co-owners took
  writes it missed, maybe without marking it down): a quiet pool costs nothing. A pass
  starts within a quarter second of a change; one that failed (an owner did not answer)
  is retried every ``interval`` seconds until the next change.
* It covers the blocks stored through this server since it started and the blocks its
  segment found on disk when it started (a warm restart: an LMDB segment reopened).
* Pushes start as soon as the first keys are checked, not after the whole walk: the survey
  checks a few batches at once (``_SURVEY_AHEAD``), each batch's missing copies join a
  queue, and the pushes take from it the keys with the fewest copies found so far (one
  copy left before two). A member back empty thus gets its first blocks within a round
  trip or two of the pass's start, and the pacing, slower than the survey, lets the queue
  fill so the most exposed blocks found go first. The keys owned by a member that failed,
  restarted or joined since the last pass that reached every owner are checked first.
* Of the holders a pass finds, only the first in the key's ring order pushes (the others
  see it holds the key and leave it): the refill of a member back empty is sent once.
* Pushes are paced to a byte rate (``rate``), so a refill cannot starve client traffic.
* Versions decide, not presence (:mod:`kvtier.peer.versions`): each owner is asked the
  stamp it holds for each key (``POST /v1/batch/stamps``), and a copy is pushed, with its
  stamp, only to owners whose block (or tombstone) is older, or who hold none; a node that
  finds an owner holding something newer pushes nothing. The server applies the same rule
  to every push (a newer value or tombstone that reached an owner meanwhile stays). So a
  member restarted on its disk never pushes its stale blocks back over the overwrites and
  deletes its co-owners took while it was down: it takes theirs (the keys an owner holds
  newer are read from it, or their tombstones applied, in the pass), and their passes
  push theirs to it.
* Tombstones are walked too: a delete an owner missed is pushed to it as a stamped
  delete, and a tombstone every owner holds starts its grace period
  (``kvtier serve --tombstone-grace``), after which it is dropped.
* A pass that began while a member was down stops as soon as that member is back (counted
  in ``superseded``), and the next pass begins at once: otherwise the pass first pushes
  the member's whole share to the fallback members standing in for it, and the member's
  own refill waits for all of it (in the chaos soak, long enough for two more failures to
  lose keys).
* Stand-in copies are dropped once they are spare: a node holding a key of which it is not
  an owner (a put, push or read repair while an owner was down) deletes its copy when every
  one of the key's ring owners is in the path and answered, in this pass, that it holds
  the key; never while an owner is down, silent or "not here", never for a key a join or
  leave moved within the pool's ``change_window``, and never a copy stored here again
  since the pass began. Without it those copies pile up with every failure until they
  evict owners' copies. The stand-ins a pass keeps for an owner's refill (or for the ring
  to settle) are checked again every ``interval`` (``standins_waiting``; only those keys,
  counted in ``rechecks``), so the copy goes once the refill lands.
* The keys held here that a join or leave moved within ``change_window`` are checked again
  every ``interval`` too, while the change is recent (``moved_waiting``; stored here after
  the pass: ``late_writes``): the members see a DNS change at different times, so one pass
  for it is not enough. A writer still on the old ring puts keys on their old owners after
  those owners' pass for the change, and a member still on the old ring drops a stand-in
  copy of a key it now owns after the key's other owner found it there; without a second
  look those keys stay on one owner, and the next leave loses them (issue 30).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvtier.codec import KEYED_FORMAT_VERSION, encode_frame, parse_header

if TYPE_CHECKING:
    from kvtier.codec import EncodedFrame
    from kvtier.peer.server import PeerServer
    from kvtier.peer.tier import PeerTier

__all__ = ["DEFAULT_REPAIR_RATE", "AntiEntropy", "BytePacer"]

log = logging.getLogger("kvtier.peer.repair")

#: Default push budget of a pass in bytes per second (``kvtier serve --repair-rate``).
DEFAULT_REPAIR_RATE = 64 << 20
_WATCH = 0.25  # seconds between looks at the membership's change count (a pass follows one)
# A look that comes this many seconds late means this process was stopped (SIGSTOP, a VM
# pause) or starved: writes went to its co-owners meanwhile, and a pass takes them.
_STALL = 1.0
_PUSH_BYTES = 2 << 20  # most frame bytes per push request (each bounded by the pool timeout)
_PROBE_KEY = b"\0kvtier-anti-entropy-probe"  # a presence check that opens a lazy tier
_SURVEY_AHEAD = 4  # batches a pass checks at once (a recheck checks one at a time)


async def _sent(send: Callable[[], Awaitable[object]], what: str, member: str,
                done: dict[str, int]) -> bool:
    """Await ``send()``; a failure is counted in ``done`` and logged, and that owner is
    skipped until the next pass (False)."""
    try:
        await send()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        done["failed"] += 1
        log.debug("anti-entropy: %s to %s failed: %s", what, member, exc)
        return False
    return True


class BytePacer:
    """Paces sends to ``rate`` bytes per second, with up to one second of burst.

    Parameters
    ----------
    rate
        Bytes per second; ``None`` paces nothing.
    """

    def __init__(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"rate: expected > 0 bytes/s or None, got {rate!r}")
        self.rate = rate
        self._free_at = time.monotonic()
        self.waited = 0.0  # seconds spent waiting for the budget

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may be sent, and account for them."""
        if self.rate is None:
            return
        now = time.monotonic()
        start = max(self._free_at, now - 1.0)  # idle time banks at most one second
        self._free_at = start + nbytes / self.rate
        delay = start - now
        if delay > 0:
            self.waited += delay
            await asyncio.sleep(delay)


class _PushQueue:
    """The keys a pass's survey found to push, taken fewest copies first (ring-walk order
    among equals), until the survey is done and none are left."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, bytes, list[str]]] = []
        self._added = 0  # tie-break: the order the survey found them in
        self._closed = False
        self._ready = asyncio.Event()

    def put(self, work: list[tuple[int, bytes, list[str]]]) -> None:
        """Queue ``(copies found, key, owners missing it)`` items."""
        for copies, key, missing in work:
            heapq.heappush(self._heap, (copies, self._added, key, missing))
            self._added += 1
        if work:
            self._ready.set()

    def close(self) -> None:
        """No more items come: :meth:`take` returns what is left, then nothing."""
        self._closed = True
        self._ready.set()

    async def take(self, most: int) -> list[tuple[int, bytes, list[str]]]:
        """Up to ``most`` items, fewest copies first, waiting until there are some; an
        empty list once closed and drained."""
        while not self._heap and not self._closed:
            self._ready.clear()
            await self._ready.wait()
        taken = [heapq.heappop(self._heap) for _ in range(min(most, len(self._heap)))]
        return [(copies, key, missing) for copies, _, key, missing in taken]


class AntiEntropy:
    """Re-replication of one node's blocks, on each membership change.

    Parameters
    ----------
    server
        This node's server: its segment is read, and it records the keys it stores while
        this object exists (the walk covers those and the keys its segment held at
        :meth:`start`).
    pool
        A ``peers://`` tier over the pool this node belongs to, with ``self_id`` set to
        this node's member id (so its own copies are never pushed to itself).
    interval
        Seconds between retries of a pass that failed (a pass starts within a quarter second
        of each membership change).
    batch
        Keys checked per batch-exists request, and read from the segment per push round.
    rate
        Push budget in bytes per second (``None``: unpaced).

    Notes
    -----
    A pass runs on the server's event loop; it is bounded by the keys held and issues one
    request per owner and batch, each bounded by the pool's timeout. A failing owner is
    skipped for this pass (the next pass retries). Counters are in :attr:`counts`.
    """

    def __init__(self, server: PeerServer, pool: PeerTier, *, interval: float = 10.0,
                 batch: int = 256, rate: float | None = DEFAULT_REPAIR_RATE) -> None:
        if not interval > 0:
            raise ValueError(f"interval: expected > 0, got {interval!r}")
        if batch < 1:
            raise ValueError(f"batch: expected >= 1, got {batch!r}")
        if pool.members.self_id is None:
            raise ValueError("pool: needs self= (this node's member id)")
        self.server = server
        self.pool = pool
        self.interval = interval
        self.batch = batch
        self.pacer = BytePacer(rate)
        self.counts: dict[str, int] = defaultdict(int)
        #: The stand-in copies the last pass kept for an owner's refill or for the ring to
        #: settle (checked again every ``interval``, see :meth:`run_pass`).
        self.waiting: set[bytes] = set()
        #: The keys held here that a join or leave moved within the pool's
        #: ``change_window``, checked again every ``interval`` until the window passes (see
        #: :meth:`_note_moved`).
        self.moved: set[bytes] = set()
        self._recheck_of: int | None = None  # change count when the running recheck began
        # When the last pass that reached every owner began (members changed since then
        # have their keys checked first).
        self._clean_since = time.monotonic()
        #: Set after every pass (cleared by whoever waits for the next one).
        self.passed = asyncio.Event()
        server.track_keys()
        server.repair_stats = self.stats
        server.settle_tombstones = False  # the passes say when every owner holds one
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Note the keys the segment holds already, open the pool tier and start the passes."""
        if self._task is None:
            await self.note_held_keys()
            await self.pool.open()
            self._task = asyncio.create_task(self._loop(), name="kvtier-anti-entropy")

    async def note_held_keys(self) -> int:
        """Add the keys the segment's tiers hold now (those that can list them) to the
        walk; returns how many. A persistent tier reopened by a warm restart opens lazily,
        so each tier is asked one presence check first."""
        segment = self.server.segment
        tiers = getattr(segment, "tiers", None)
        found = 0
        for tier in tiers if isinstance(tiers, list) else [segment]:
            try:
                await tier.contains_many([_PROBE_KEY])
            except Exception as exc:  # a tier that cannot answer now lists nothing
                log.warning("anti-entropy: cannot list the blocks of %r: %s",
                            getattr(tier, "name", tier), exc)
                continue
            listed = getattr(tier, "resident_keys", None)
            keys = listed() if callable(listed) else None
            if keys:
                self.server.stored(keys)
                found += len(keys)
        self.counts["found_at_start"] += found
        return found

    async def close(self) -> None:
        """Stop the passes and close the pool tier."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.pool.aclose()

    async def _loop(self) -> None:
        with self.server.watch_writes() as writes:
            await self._passes(writes)

    def _note_moved(self, keys: set[bytes] | list[bytes]) -> int:
        """Add the ``keys`` a join or leave moved within ``change_window`` to
        :attr:`moved`; returns how many. One pass for the change is not enough for them,
        since the members do not see a DNS change at once: a writer still on the old ring
        puts a key on its old owners after their pass for the change (a late write, that
        no further change would check), and a member still on the old ring drops its
        stand-in copy of a key whose new owner it is, after that key's other owner checked
        it there (its ring said every owner held the key). So they are checked again every
        ``interval`` while the change is recent, and pushed to the owners that lack them."""
        if self.server.holder is not None:  # placement=local: no ring owners to reach
            return 0
        members, pool = self.pool.members, self.pool
        moved = [k for k in keys if members.moved(k, pool.replicas, pool.change_window)]
        self.moved.update(moved)
        return len(moved)

    async def _passes(self, writes: set[bytes]) -> None:
        clean_at = -1  # membership change count when the last pass with no failures began
        tried_at = -1  # change count when the last pass began
        began = -float("inf")  # when the last pass began
        rechecked = -float("inf")  # when the stand-ins a pass kept were last checked again
        looked = expired = time.monotonic()
        while True:
            await asyncio.sleep(_WATCH)
            seen = self.pool.members.change_count
            now = time.monotonic()
            if now - looked > _WATCH + _STALL:
                # Stopped for a while: nobody saw this node fail, but it missed writes.
                self.counts["stalls"] += 1
                clean_at = -1
            looked = now
            if writes:
                self.counts["late_writes"] += self._note_moved(writes)
                writes.clear()
            if now - expired >= self.interval:  # settled tombstones past their grace go
                expired = now
                self.counts["tombstones_expired"] += self.server.versions.expire()
                self.server.versions.flush()
            try:
                # Nobody failed, restarted, joined or left since a pass that reached every
                # owner: every put since then reached its owners too. A pass runs after a
                # change, and a pass that failed is retried every interval.
                if seen != clean_at and (seen != tried_at or now - began >= self.interval):
                    tried_at, began = seen, now
                    done = await self.run_pass()
                    if not done.get("failed") and not done.get("superseded"):
                        clean_at = seen
                elif now - max(began, rechecked) >= self.interval and (
                        recheck := self._recheck_keys()):
                    # The stand-in copies a pass kept for an owner's refill (or for the
                    # ring to settle), the keys a recent join or leave moved, and the
                    # tombstones not every owner is known to hold, are checked again
                    # every interval, not every key.
                    rechecked = now
                    await self.run_pass(recheck)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("anti-entropy pass failed; retrying in %.1f s", self.interval)

    def _recheck_keys(self) -> list[bytes]:
        """The keys a recheck looks at: the stand-ins kept waiting, the keys a recent join
        or leave moved, and the tombstones whose grace period has not started (so that, in
        a quiet pool, they settle and expire instead of piling up)."""
        unsettled = [k for k, (_, when) in self.server.versions.tombs.items() if not when]
        both = self.waiting | self.moved
        return list(both) + [k for k in unsettled if k not in both]

    async def run_pass(self, keys: list[bytes] | None = None) -> dict[str, int]:
        """Check every key this node holds (or only ``keys``: counted as a ``recheck``, not
        a pass), push the missing copies as they are found, fewest copies first of those
        found so far, and drop the spare stand-in copies; returns this pass's counters. The
        stand-ins it keeps for an owner's refill are :attr:`waiting`."""
        holder = self.server.holder
        if holder is not None:  # placement=local: blocks stay where they are
            return await self._local_pass(keys)
        done: dict[str, int] = defaultdict(int)
        members = self.pool.members
        down = members.dead
        self._recheck_of = None if keys is None else members.change_count
        self.waiting = set()
        # Checked now (a full pass checks every key held): the survey puts back those still
        # moved; a pass that did not reach every owner puts them all back.
        moved = self.moved if keys is None else self.moved.intersection(keys)
        self.moved -= moved
        checked = False
        began = time.monotonic()
        queue = _PushQueue()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._push_queued(queue, down, done))
                try:
                    with self.server.watch_writes() as written:
                        await self._survey(done, down, written, keys, queue)
                finally:
                    queue.close()
            checked = not done.get("failed") and not done.get("superseded")
        except BaseExceptionGroup as group_error:
            # The survey's or the pushes' first failure ends the pass, raised as itself.
            error: BaseException = group_error
            while isinstance(error, BaseExceptionGroup):
                error = error.exceptions[0]
            raise error from None
        finally:
            if not checked:
                self.moved |= moved
            done["passes" if keys is None else "rechecks"] = 1
            done["tombstones_expired"] += self.server.versions.expire()
            self.server.versions.flush()
            for name, n in done.items():
                self.counts[name] += n
            self.passed.set()
        if keys is None and not done.get("failed") and not done.get("superseded"):
            self._clean_since = began
        if done["pushed"]:
            log.info("anti-entropy: %d blocks checked, %d copies pushed (%d blocks below "
                     "replicas)", done["checked"], done["pushed"], done["under_replicated"])
        return dict(done)

    async def _local_pass(self, keys: list[bytes] | None) -> dict[str, int]:
        """Under ``placement=local``: register every block held here with its current
        directory owners and restore copies below ``replicas``
        (:meth:`kvtier.peer.holder.LocalHolder.repair_pass`); no stand-in is pruned, since
        a copy away from the key's ring owners is where the placement puts it."""
        holder = self.server.holder
        assert holder is not None
        began = time.monotonic()
        done: dict[str, int] = {}
        try:
            done = await holder.repair_pass(list(self.server.stored_keys) if keys is None
                                            else keys)
        finally:
            done["passes" if keys is None else "rechecks"] = 1
            for name, n in done.items():
                self.counts[name] += n
            self.passed.set()
        if keys is None and not done.get("failed"):
            self._clean_since = began
        return done

    async def _push_queued(self, queue: _PushQueue, down: frozenset[str],
                           done: dict[str, int]) -> None:
        """Push rounds of up to ``batch`` keys from ``queue`` until the survey ends and the
        queue is empty, or the pass is superseded."""
        while work := await queue.take(self.batch):
            if self._superseded(down, done):
                return
            await self._push_round(work, done)

    def _superseded(self, down: frozenset[str], done: dict[str, int]) -> bool:
        """Whether a member that was down when this pass began is back: the pass's owners
        then hold fallback members in its place, and its own refill is missing. The pass
        stops (counted in ``superseded``) and the loop begins the next one at once, rather
        than first pushing the member's whole share to the fallbacks. A recheck of the
        waiting stand-ins stops at any membership change (the full pass it calls for goes
        first)."""
        members = self.pool.members
        if any(members.alive(m) for m in down) or (
                self._recheck_of is not None and members.change_count != self._recheck_of):
            done["superseded"] = 1
            return True
        return False

    async def _survey(self, done: dict[str, int], down: frozenset[str], written: set[bytes],
                      only: list[bytes] | None, queue: _PushQueue) -> None:
        """Queue ``(copies found, key, owners missing it)`` for each key this node should
        push (of those in ``only`` if given; no more once the pass is superseded), checking
        up to ``_SURVEY_AHEAD`` batches at once; drops the stand-in copies every owner
        holds, except those in ``written`` (stored here since the pass began)."""
        held = self.server.stored_keys
        versions = self.server.versions
        if only is None:
            keys = await self._owned_by_changed_first(
                list(held) + [k for k in versions.tombs if k not in held])
        else:
            keys = [k for k in only if k in held or k in versions.tombs]
        # Shared by the checkers: each takes the next batch when it is done with one.
        starts = iter(range(0, len(keys), self.batch))

        async def check_batches() -> None:
            for start in starts:
                if self._superseded(down, done):
                    return
                chunk = keys[start:start + self.batch]
                present = await self.server.segment.contains_many(chunk)
                mine = {k: versions.state(k, here)
                        for k, here in zip(chunk, present, strict=True)}
                for key, (kind, _) in mine.items():
                    if not kind:  # evicted here: nothing to re-replicate
                        held.pop(key, None)
                        versions.forget(key)
                chunk = [k for k in chunk if mine[k][0]]
                done["checked"] += len(chunk)
                done["moved_waiting"] += self._note_moved(chunk)
                found, standins, newer = await self._check_chunk(chunk, mine, done)
                if newer:
                    await self._adopt(newer, done)
                queue.put(found)
                if standins:
                    await self._drop_standins(standins, written, done)

        # A recheck (the waiting stand-ins alone) goes one batch at a time: it yields to
        # the full pass a membership change calls for at the next batch.
        ahead = _SURVEY_AHEAD if only is None else 1
        async with asyncio.TaskGroup() as group:
            for _ in range(ahead):
                group.create_task(check_batches())

    async def _owned_by_changed_first(self, keys: list[bytes]) -> list[bytes]:
        """``keys``, those owned by a live member that failed, restarted or joined since
        the last pass that reached every owner first (a member back empty lacks them all),
        in their order otherwise."""
        members = self.pool.members
        changed = {m for m in members.recently_changed(time.monotonic() - self._clean_since)
                   if members.alive(m)}
        if not changed:
            return keys
        first: list[bytes] = []
        rest: list[bytes] = []
        for i, key in enumerate(keys):
            if i % 1024 == 1023:
                await asyncio.sleep(0)  # tens of thousands of ring walks: let others run
            owners = members.owners_of(key, self.pool.replicas)
            (first if changed.intersection(owners) else rest).append(key)
        return first + rest

    async def _drop_standins(self, keys: list[bytes], written: set[bytes],
                             done: dict[str, int]) -> None:
        dropped = await self.server.drop_copies(keys, written)
        done["standins_pruned"] += len(dropped)
        # Stored again here since the pass began: checked again later.
        again = [k for k in keys if k in written]
        done["standins_waiting"] += len(again)
        self.waiting.update(again)

    async def _check_chunk(self, chunk: list[bytes], mine: dict[bytes, tuple[int, int]],
                           done: dict[str, int]
                           ) -> tuple[list[tuple[int, bytes, list[str]]], list[bytes],
                                      dict[bytes, tuple[str, int, int]]]:
        """The chunk's keys to push (as :meth:`_survey`), and the stand-in copies here
        that every owner holds at this node's stamp or newer (:meth:`_is_spare`).

        ``mine``: this node's ``(kind, stamp)`` of each key. An owner holds a key when its
        ``(stamp, kind)`` is at least this node's, misses it when less; a tombstone every
        owner holds is settled (its grace period starts), and a stand-in tombstone so held
        is left to expire, not dropped. The third result: for each key an owner holds a
        newer block or tombstone of, the owner holding the newest and its ``(kind,
        stamp)``, for :meth:`_adopt`."""
        members = self.pool.members
        me = members.self_id
        owners = {key: members.owners_of(key, self.pool.replicas) for key in chunk}
        asked: dict[str, list[bytes]] = defaultdict(list)
        for key, found in owners.items():
            for owner in found:
                if owner != me:
                    asked[owner].append(key)
        answers = await asyncio.gather(*(self._states(m, ks, done)
                                         for m, ks in asked.items()))
        holds: dict[tuple[str, bytes], bool] = {}
        # Keys an owner holds a newer block or tombstone of: (that owner, kind, stamp).
        newer: dict[bytes, tuple[str, int, int]] = {}
        for (member, ks), states in zip(asked.items(), answers, strict=True):
            for key, state in zip(ks, states, strict=True):
                if state is None:  # the owner did not answer
                    continue
                kind, stamp = mine[key]
                theirs, ours = (state[1], state[0]), (stamp, kind)
                holds[member, key] = theirs >= ours
                best = newer.get(key)
                if theirs > ours and (best is None or theirs > (best[2], best[1])):
                    newer[key] = (member, state[0], state[1])
        work = []
        spare = []
        for key in chunk:
            found = owners[key]
            tomb = mine[key][0] == 2
            if me not in found and self._is_spare(found, holds, key, done):
                if tomb:
                    self.server.versions.settle(key, mine[key][1])
                else:
                    spare.append(key)
                continue
            if tomb and all(holds.get((m, key), False) for m in found if m != me):
                self.server.versions.settle(key, mine[key][1])
            if key in newer:
                continue  # an owner holds a newer value or delete: it pushes, not this node
            holders = [m for m in found if m == me or holds.get((m, key), False)]
            # An owner that did not answer counts as missing nothing (this pass skips it).
            missing = [m for m in found if m != me and (m, key) in holds
                       and not holds[m, key]]
            if not missing:
                continue
            if holders and holders[0] != me:
                continue  # an earlier holder in ring order pushes this one
            copies = 1 + sum(1 for m in found if m != me and holds.get((m, key), False))
            if copies < self.pool.replicas:
                done["under_replicated"] += 1
            work.append((copies, key, missing))
        return work, spare, newer

    async def _adopt(self, newer: dict[bytes, tuple[str, int, int]],
                     done: dict[str, int]) -> None:
        """Take the newer blocks and tombstones owners hold of keys this node holds older
        (a member back from a crash or a freeze, which missed overwrites and deletes): the
        tombstones are applied here, the blocks read from their owner and stored here
        with its stamp. Every write goes through the server's rule (only if newer)."""
        server = self.server
        reads: dict[str, list[tuple[bytes, int]]] = defaultdict(list)
        for key, (member, kind, stamp) in newer.items():
            if kind == 2:
                async with server.write_order.turn((key,)):
                    server.stored_keys.pop(key, None)
                    server.frames.forget(key)
                    await server.delete_stamped(key, stamp)
                done["tombstones_adopted"] += 1
            else:
                reads[member].append((key, stamp))
        for member, items in reads.items():
            try:
                frames = await self.pool.members.client(member).get_many(
                    [k for k, _ in items])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # this owner is skipped until the next pass
                done["failed"] += 1
                log.debug("anti-entropy: reading newer blocks from %s failed: %s",
                          member, exc)
                continue
            for (key, stamp), frame in zip(items, frames, strict=True):
                if frame is None or parse_header(frame).version != KEYED_FORMAT_VERSION:
                    continue  # gone since, or not bound to its key: the next pass sees
                block = await server.decode(key, frame)
                async with server.write_order.turn((key,)):
                    landed = await server.put_stamped(key, block, stamp, False)
                if landed:
                    server.stored((key,))
                    done["adopted"] += 1
        server.versions.flush()

    def _is_spare(self, owners: list[str], holds: dict[tuple[str, bytes], bool], key: bytes,
                  done: dict[str, int]) -> bool:
        """Whether this node's copy of ``key`` (of which it is not a live owner) is a spare
        stand-in: every one of the key's ring owners is in the path and answered that it
        holds the key in this pass, and no join or leave moved the key within the pool's
        ``change_window`` (two nodes whose rings differ could each take the other for an
        owner). A copy standing in for an owner that is down, did not answer, or answered
        "not here" is kept."""
        members = self.pool.members
        replicas = self.pool.replicas
        if owners != members.ring.owners(key, replicas):
            return False  # an owner is out of the path: this copy may be one of its stand-ins
        if not members.moved(key, replicas, self.pool.change_window) and all(
                holds.get((m, key), False) for m in owners):
            return True
        # Its owners' refill is on its way, or the ring settles: checked again.
        done["standins_waiting"] += 1
        self.waiting.add(key)
        return False

    async def _states(self, member: str, keys: list[bytes], done: dict[str, int]
                      ) -> list[tuple[int, int] | None]:
        try:
            return list(await self.pool.members.client(member).stamps_many(keys))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this owner is skipped until the next pass
            done["failed"] += 1
            log.debug("anti-entropy: owner %s skipped: %s", member, exc)
            return [None] * len(keys)

    async def _push_round(self, work: list[tuple[int, bytes, list[str]]],
                          done: dict[str, int]) -> None:
        versions = self.server.versions
        # The stamps are read before the blocks: a write landing meanwhile makes the block
        # pushed newer than its stamp says, never older (the receiver keeps the newer).
        tombs = [(key, missing, versions.tombs[key][0]) for _, key, missing in work
                 if key in versions.tombs]
        work = [item for item in work if item[1] not in versions.tombs]
        stamps = [versions.stamps.get(key, 0) for _, key, _ in work]
        blocks = await self.server.segment.get_many([key for _, key, _ in work])
        plan: dict[str, list[tuple[bytes, EncodedFrame, int]]] = defaultdict(list)
        for (_, key, missing), block, stamp in zip(work, blocks, stamps, strict=True):
            if block is None:
                continue  # evicted since the survey
            frame = encode_frame(block, key=key)
            for member in missing:
                plan[member].append((key, frame, stamp))
        deletes: dict[str, list[tuple[bytes, int]]] = defaultdict(list)
        for key, missing, stamp in tombs:
            for member in missing:
                deletes[member].append((key, stamp))
        await asyncio.gather(*(self._push(m, items, done) for m, items in plan.items()),
                             *(self._push_deletes(m, items, done)
                               for m, items in deletes.items()))

    async def _push_deletes(self, member: str, items: list[tuple[bytes, int]],
                            done: dict[str, int]) -> None:
        """Send ``member`` the deletes it missed, with their stamps."""
        if await _sent(lambda: self.pool.members.client(member).delete_many(
                [k for k, _ in items], stamps=[s for _, s in items]),
                "deletes", member, done):
            done["tombstones_pushed"] += len(items)

    async def _push(self, member: str, items: list[tuple[bytes, EncodedFrame, int]],
                    done: dict[str, int]) -> None:
        client = self.pool.members.client(member)
        start = 0
        while start < len(items):
            # Requests of at most _PUSH_BYTES each, paced: one timeout bounds each request.
            end, size = start + 1, items[start][1].nbytes
            while end < len(items) and size + items[end][1].nbytes <= _PUSH_BYTES:
                size += items[end][1].nbytes
                end += 1
            await self.pacer.take(size)
            # Stamped: a newer value or delete that reached the owner meanwhile stays
            # (fill=True keeps that so on a server of before stamps, too).
            batch = items[start:end]
            if not await _sent(partial(client.put_many, [(k, f) for k, f, _ in batch],
                                       fill=True, stamps=[s for _, _, s in batch]),
                               "push", member, done):
                return
            done["pushed"] += end - start
            done["pushed_bytes"] += size
            start = end

    def stats(self) -> dict[str, Any]:
        """Counters over every pass: ``passes``, ``checked``, ``pushed``, ``failed``,
        ``under_replicated`` (keys found below ``replicas``), ``found_at_start``,
        ``superseded`` (passes stopped because a member down at their start came back),
        ``standins_pruned`` (stand-in copies dropped once every owner held them),
        ``standins_waiting`` (stand-in copies kept for an owner's refill, checked again),
        ``rechecks`` (checks of those alone), ``stalls`` (times this node found it had been
        stopped, see :data:`_STALL`), ``moved_waiting`` (keys a recent join or leave
        moved, checked again; ``late_writes``: of them, those stored here after a pass),
        ``tombstones_pushed`` (deletes sent to owners that missed them), ``adopted`` and
        ``tombstones_adopted`` (newer blocks and deletes taken from an owner, over older
        ones held here), ``tombstones_expired`` (dropped past their grace period), and
        ``paced_s`` (seconds pushes waited for the byte budget)."""
        return {**self.counts, "paced_s": round(self.pacer.waited, 3)}
