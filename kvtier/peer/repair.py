"""Anti-entropy: a node re-replicates the blocks it holds to their current owners.

A put lands on a key's first live owners; when an owner is down it lands on the next live
member instead (a fallback copy), and a member that restarts empty, or one that joins,
holds none of the keys it now owns. Reads walk past such holes and repair what they read
(:class:`kvtier.peer.tier.PeerTier`), but a block nobody reads keeps fewer copies than
``replicas`` until a second failure loses it. :class:`AntiEntropy` closes that gap: every
``interval`` seconds it walks the keys this node's server has stored, asks each key's
current owners (one batch-exists request per owner and batch) whether they hold it, and
pushes the block to those that do not. ``kvtier serve --repair POOL_URL`` runs it. A pass
runs only when the membership changed (a member failed, restarted, joined or left, as this
node's health probes see it) since the last pass that reached every owner: a quiet pool
costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from kvtier.codec import encode_frame

if TYPE_CHECKING:
    from kvtier.peer.server import PeerServer
    from kvtier.peer.tier import PeerTier

__all__ = ["AntiEntropy"]

log = logging.getLogger("kvtier.peer.repair")


class AntiEntropy:
    """Periodic re-replication of one node's blocks.

    Parameters
    ----------
    server
        This node's server: its segment is read, and it records the keys it stores while
        this object exists (the walk covers blocks stored since the server started).
    pool
        A ``peers://`` tier over the pool this node belongs to, with ``self_id`` set to
        this node's member id (so its own copies are never pushed to itself).
    interval
        Seconds between passes.
    batch
        Keys checked per batch-exists request.

    Notes
    -----
    A pass runs on the server's event loop; it is bounded by the keys held and issues one
    request per owner and batch, each bounded by the pool's timeout. A failing owner is
    skipped for this pass (the next pass retries). Counters are in :attr:`counts`.
    """

    def __init__(self, server: PeerServer, pool: PeerTier, *, interval: float = 10.0,
                 batch: int = 256) -> None:
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
        self.counts: dict[str, int] = defaultdict(int)
        server.track_keys()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the pool tier and start the periodic passes."""
        if self._task is None:
            await self.pool.open()
            self._task = asyncio.create_task(self._loop(), name="kvtier-anti-entropy")

    async def close(self) -> None:
        """Stop the passes and close the pool tier."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.pool.aclose()

    async def _loop(self) -> None:
        clean_at = -1  # membership change count when the last pass with no failures began
        while True:
            await asyncio.sleep(self.interval)
            seen = self.pool.members.change_count
            if seen == clean_at:
                # Nobody failed, restarted, joined or left since a pass that reached every
                # owner: every put since then reached its owners too. Nothing to do.
                self.counts["passes_skipped"] += 1
                continue
            try:
                done = await self.run_pass()
                if not done.get("failed"):
                    clean_at = seen
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("anti-entropy pass failed; retrying in %.1f s", self.interval)

    async def run_pass(self) -> dict[str, int]:
        """Check every key this node holds once; returns this pass's counters."""
        held = self.server.stored_keys
        keys = list(held)
        done: dict[str, int] = defaultdict(int)
        for start in range(0, len(keys), self.batch):
            chunk = keys[start:start + self.batch]
            present = await self.server.segment.contains_many(chunk)
            for key, here in zip(chunk, present, strict=True):
                if not here:  # evicted or deleted here: nothing to re-replicate
                    held.pop(key, None)
            chunk = [k for k, here in zip(chunk, present, strict=True) if here]
            done["checked"] += len(chunk)
            await self._repair_chunk(chunk, done)
        done["passes"] = 1
        for name, n in done.items():
            self.counts[name] += n
        if done["pushed"]:
            log.info("anti-entropy: %d blocks checked, %d copies pushed to their owners",
                     done["checked"], done["pushed"])
        return dict(done)

    async def _repair_chunk(self, chunk: list[bytes], done: dict[str, int]) -> None:
        members = self.pool.members
        held = self.server.stored_keys
        # Under chain placement a key's owners are its chain's placement key's, as its
        # writer sent it; a push carries it on, so the new copy can be repaired in turn.
        plan: dict[tuple[str, bytes | None], list[bytes]] = defaultdict(list)
        for key in chunk:
            anchor = held.get(key)
            for owner in members.owners_of(key if anchor is None else anchor,
                                           self.pool.replicas):
                if owner != members.self_id:
                    plan[owner, anchor].append(key)
        await asyncio.gather(*(self._repair_owner(m, ks, anchor, done)
                               for (m, anchor), ks in plan.items()))

    async def _repair_owner(self, member: str, keys: list[bytes], anchor: bytes | None,
                            done: dict[str, int]) -> None:
        client = self.pool.members.client(member)
        try:
            flags = await client.exists_many(keys)
            missing = [k for k, held in zip(keys, flags, strict=True) if not held]
            if not missing:
                return
            blocks = await self.server.segment.get_many(missing)
            items = [(k, encode_frame(b, key=k)) for k, b in zip(missing, blocks, strict=True)
                     if b is not None]
            if items:  # fill=True: a newer value that reached the owner meanwhile stays
                await client.put_many(items, fill=True, anchor=anchor)
                done["pushed"] += len(items)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this owner is skipped until the next pass
            done["failed"] += 1
            log.debug("anti-entropy: owner %s skipped: %s", member, exc)

    def stats(self) -> dict[str, Any]:
        """Counters over every pass: ``passes``, ``checked``, ``pushed``, ``failed``."""
        return dict(self.counts)
