"""A ``peers://?placement=local`` client's reads: home first, then the holder directory.

A client of a ``placement=local`` pool writes to its *home* member (``home=host:port``, the
``kvtier serve`` on its own host), which registers each block in the holder directory (see
:mod:`kvtier.peer.directory`, :mod:`kvtier.peer.holder`). A read asks home first (one batch
request); the keys home lacks are looked up at their directory owners (one request per
directory owner for the batch, the next owner for keys the first did not answer or knew no
holder of) and read from a holder (one batch request per holder, the next holder for keys
one lacked). A *hot* block, one this client reads from another member for the second time
(of the last 65536 such reads), is copied to home in the background (``local_copies`` in
:meth:`PeerTier.stats`; bounded by ``repair_bytes`` in flight, a copy past it dropped and
counted), so its next read stays on its host, while a block read once costs home no room.
A directory owner found without an entry that a later owner had is told
(``directory_repairs``). A key that no one served is reported ``unavailable`` to the store
(``explain``, miss reasons), naming the members and their state, when a holder the
directory named or, with no holder found, a directory owner did not answer; it is
``not_stored`` only when every directory owner answered that it knows no holder (or every
holder named answered "not here").

The holders learned are kept (bounded) for :meth:`kvtier.TieredStore.route`, which routes a
prompt to the member holding the longest run of its blocks with no request.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from kvtier.misses import MissReason
from kvtier.tiers.base import Block

if TYPE_CHECKING:
    from kvtier.peer.tier import PeerTier

__all__ = ["LocalReads"]

_KNOWN_KEYS = 1 << 18  # holders remembered for routing
_READ_ONCE = 1 << 16  # keys read once from another member, remembered to spot hot ones


class LocalReads:
    """Home-first reads and directory lookups of one ``placement=local`` tier."""

    def __init__(self, tier: PeerTier, home: str) -> None:
        self.tier = tier
        self.home = home
        self._known: OrderedDict[bytes, list[str]] = OrderedDict()
        self._read_once: OrderedDict[bytes, None] = OrderedDict()

    # ------------------------------------------------------------------ placement
    def order(self, key: bytes) -> list[str]:
        """Where copies of ``key`` go: home first, then the key's ring order."""
        return [self.home, *(m for m in self.tier.members.order(key) if m != self.home)]

    def write_targets(self, key: bytes, n: int) -> list[str]:
        """The first ``n`` live members of :meth:`order`, then members out of the path that
        still answer health probes (as :meth:`Membership.write_owners`)."""
        members = self.tier.members
        order = self.order(key)
        targets = [m for m in order if members.alive(m)][:n]
        if len(targets) < n:
            targets += [m for m in order if not members.alive(m) and members.reachable(m)
                        ][:n - len(targets)]
        return targets

    def holders(self, key: bytes) -> list[str]:
        """The live members this client last saw holding ``key`` (no request)."""
        members = self.tier.members
        return [m for m in self._known.get(key, ()) if members.alive(m)]

    def learn(self, key: bytes, holders: Sequence[str]) -> None:
        """Remember that ``holders`` hold ``key`` (for routing)."""
        known = self._known.get(key)
        merged = list(dict.fromkeys([*(known or ()), *holders]))
        self._known[key] = merged
        self._known.move_to_end(key)
        if len(self._known) > _KNOWN_KEYS:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ directory
    async def directory_holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Per key, the holders its directory owners know: the first live owner of each
        key is asked (one request per owner for the batch), the next for keys that owner
        did not answer or knew no holder of, up to :meth:`PeerTier.walk_limit` members of
        its ring order (past the ``replicas`` owners: the owners before a recent join or
        leave, until the holders' anti-entropy registered again). An owner that knew none
        of a key a later member knew is told, in the background."""
        found, _ = await self._directory(keys)
        return found

    async def _directory(self, keys: Sequence[bytes]) -> tuple[list[list[str]], list[set[str]]]:
        """:meth:`directory_holders`, and per key the members that answered."""
        tier = self.tier
        walk = tier.walk_limit()
        owners = [tier.members.live_owners(k, walk) for k in keys]
        found: list[list[str]] = [[] for _ in keys]
        empty_at: list[list[str]] = [[] for _ in keys]
        answered: list[set[str]] = [set() for _ in keys]
        pending = list(range(len(keys)))
        for depth in range(walk):
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                if depth < len(owners[i]):
                    groups[owners[i][depth]].append(i)
            if not groups:
                break
            replies = await asyncio.gather(*(
                tier._call(m, "directory", partial(self._lookup, m, [keys[i] for i in idx]),
                           len(idx)) for m, idx in groups.items()))
            pending = []
            for (member, idx), reply in zip(groups.items(), replies, strict=True):
                for n, i in enumerate(idx):
                    holders = cast(list[list[str]], reply)[n] if isinstance(reply, list) \
                        else []
                    if isinstance(reply, list):
                        answered[i].add(member)
                    if holders:
                        found[i] = holders
                    else:
                        if isinstance(reply, list) and depth < tier.replicas:
                            empty_at[i].append(member)  # an owner: repaired below
                        pending.append(i)
        self._repair_directory(keys, found, empty_at)
        for key, holders in zip(keys, found, strict=True):
            if holders:
                self.learn(key, holders)
        return found, answered

    async def _lookup(self, member: str, keys: list[bytes]) -> list[list[str]]:
        if self.tier._is_local(member) and self.tier.directory is not None:
            return self.tier.directory.lookup(keys)
        return await self.tier.members.client(member).dir_lookup(keys)

    def _repair_directory(self, keys: Sequence[bytes], found: list[list[str]],
                          empty_at: list[list[str]]) -> None:
        plan: dict[tuple[str, str], list[bytes]] = defaultdict(list)
        for key, holders, owners in zip(keys, found, empty_at, strict=True):
            for owner in owners if holders else ():
                for holder in holders:
                    plan[owner, holder].append(key)
        if not plan:
            return
        tier = self.tier

        async def update(owner: str, holder: str, ks: list[bytes]) -> None:
            if tier._is_local(owner) and tier.directory is not None:
                tier.directory.update(holder, ks, ())
            else:
                await tier.members.client(owner).dir_update(holder, ks, ())
            tier.counts["directory_repairs"] += len(ks)

        async def tell(owner: str, holder: str, ks: list[bytes]) -> None:
            await tier._call(owner, "directory", partial(update, owner, holder, ks))

        for (owner, holder), ks in plan.items():
            task = asyncio.create_task(tell(owner, holder, ks))
            tier._repairs.add(task)
            task.add_done_callback(tier._repairs.discard)

    # ------------------------------------------------------------------ reads
    async def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        """Blocks of ``keys``: home first, then holders found in the directory."""
        tier = self.tier
        await tier._start()
        blocks: list[Block | None] = [None] * len(keys)
        home = self.home
        reply = await tier._call(home, "get", partial(tier._fetch_blocks, home, list(keys)),
                                 len(keys))
        home_answered = isinstance(reply, list)
        if isinstance(reply, list):
            blocks = cast(list[Block | None], reply)
            for key, block in zip(keys, blocks, strict=True):
                if block is not None:
                    self.learn(key, [home])
        missing = [i for i, b in enumerate(blocks) if b is None]
        if not missing:
            return blocks
        holders, owners_answered = await self._directory([keys[i] for i in missing])
        tried = [{home} for _ in missing]
        answered = [{home} if home_answered else set() for _ in missing]
        pending = list(range(len(missing)))
        copies: list[tuple[bytes, Block]] = []
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for j in pending:
                member = next((m for m in holders[j] if m not in tried[j]
                               and tier.members.reachable(m)), None)
                if member is not None:
                    tried[j].add(member)
                    groups[member].append(j)
            if not groups:
                break
            replies = await asyncio.gather(*(
                tier._call(m, "get", partial(tier._fetch_blocks, m,
                                             [keys[missing[j]] for j in idx]), len(idx))
                for m, idx in groups.items()))
            pending = []
            for (member, idx), got in zip(groups.items(), replies, strict=True):
                for n, j in enumerate(idx):
                    if isinstance(got, list):
                        answered[j].add(member)
                    block = cast(list[Block | None], got)[n] if isinstance(got, list) \
                        else None
                    if block is None:
                        pending.append(j)
                        continue
                    blocks[missing[j]] = block
                    copies.append((keys[missing[j]], block))
        tier.counts["remote_hits"] += len(copies)
        self._copy_home(copies)
        self._report_unanswered([keys[i] for i in missing], [blocks[i] is not None
                                                             for i in missing],
                                holders, owners_answered, answered)
        return blocks

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence of ``keys``: home's answer, then the directory's live holders."""
        tier = self.tier
        await tier._start()
        here = await tier._call(self.home, "exists", partial(tier._exists, self.home,
                                                             list(keys)), len(keys))
        flags = [bool(f) for f in here] if isinstance(here, list) else [False] * len(keys)
        missing = [i for i, f in enumerate(flags) if not f]
        if missing:
            asked = [keys[i] for i in missing]
            holders, owners_answered = await self._directory(asked)
            for i, found in zip(missing, holders, strict=True):
                flags[i] = any(tier.members.alive(m) for m in found)
            # A holder counts as answering here when it is in the path (not asked: the
            # directory's word stands for it); home answered for what it lacks.
            answered = [{m for m in found if tier.members.alive(m)}
                        | ({self.home} if isinstance(here, list) else set())
                        for found in holders]
            self._report_unanswered(asked, [flags[i] for i in missing], holders,
                                    owners_answered, answered)
        return flags

    def _report_unanswered(self, keys: Sequence[bytes], hit: Sequence[bool],
                           holders: Sequence[Sequence[str]], owners_answered: Sequence[set[str]],
                           answered: Sequence[set[str]]) -> None:
        """A key missed although a holder the directory named, or one of its directory
        owners, did not answer is ``unavailable``, not absent: say so to the store
        (``explain``, miss reasons), naming those members and their state. It is
        ``not_stored`` only when every directory owner answered and knew no holder, or
        every holder named answered "not here"."""
        tier = self.tier
        describe = tier.members.detector.describe
        lost: dict[str, list[bytes]] = defaultdict(list)
        for key, got, found, said, heard in zip(keys, hit, holders, owners_answered, answered,
                                                strict=True):
            if got:
                continue
            if found:
                silent = [m for m in found if m not in heard]
                role = "holders"
            else:
                owners = tier.members.ring.owners(key, tier.replicas)
                silent = [m for m in owners if m not in said]
                found, role = owners, "directory owners"
            if silent:
                states = "; ".join(f"{m} {describe(m) or 'did not answer this read'}"
                                   for m in silent)
                lost[f"{len(silent)} of {len(found)} {role} did not answer: {states}"
                     ].append(key)
        for why, group in lost.items():
            tier._report_miss(group, MissReason.UNAVAILABLE, f"{why} (timeout={tier.timeout:g}s)")

    def _copy_home(self, items: list[tuple[bytes, Block]]) -> None:
        """Copy the hot ones of blocks read from other members (read so before) to home, in
        the background, within ``repair_bytes`` (past it a copy is dropped, counted)."""
        tier = self.tier
        take: list[tuple[bytes, Block]] = []
        held = 0
        once = self._read_once
        for key, block in items:
            if key not in once:
                once[key] = None
                if len(once) > _READ_ONCE:
                    once.popitem(last=False)
                continue
            del once[key]
            if tier._repair_held + held + block.nbytes > tier.repair_bytes:
                tier.counts["local_copies_dropped"] += 1
                continue
            held += block.nbytes
            take.append((key, block))
        if not take:
            return
        tier.start_repair(self._store_home(take, held), held)

    async def _store_home(self, items: list[tuple[bytes, Block]], held: int) -> None:
        from kvtier.peer.tier import FAILED  # (tier imports this module)

        tier = self.tier
        try:
            for key, block in items:
                frame = await tier._encode(key, block)
                if await tier._put_to(self.home, "local_copy", key, block, frame,
                                      fill=True) is not FAILED:
                    tier.counts["local_copies"] += 1
                    self.learn(key, [self.home])
        finally:
            tier._repair_held -= held

    def stats(self) -> dict[str, Any]:
        """``home`` and ``holders_known`` (keys whose holders this client remembers)."""
        return {"home": self.home, "holders_known": len(self._known)}

