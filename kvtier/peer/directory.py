"""The holder directory of ``placement=local``: which members hold each block.

Under ``placement=local`` a block is stored on the member that computed it, not on its key's
ring owners. The key's ring owners (its first ``replicas`` live members) are instead its
*directory owners*: each keeps, for the keys it owns, the members that hold them. There is no
master: a holder tells the key's directory owners when it stores a block, when it evicts
it for good and when it deletes it (:class:`kvtier.peer.holder.LocalHolder`), and a reader
that missed at its home member asks them (``POST /v1/dir/lookup``, one request per
directory owner for a batch) and reads from a holder.

Wire format (binary, little-endian, as ``docs/peer-protocol.md`` documents)::

    holder lists (lookup answer, update answer):
        u32 count, then count x (u16 n, then n x (u16 id_len, member id in UTF-8))
    update request:
        u16 id_len, member id in UTF-8, then a key list (keys it now holds), then a
        key list (keys it no longer holds)

An update applies its adds, then its removes, in one step of the server's event loop, and
answers, for every removed key, the holders left: two members dropping their copies of
one block at once thus see each other gone in one of the two answers, and the second
forwards the last copy (:mod:`kvtier.peer.holder`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

from kvtier.peer import protocol as proto

__all__ = ["ADDED_QUERY", "AGE_QUERY", "DIR_LOOKUP_PATH", "DIR_UPDATE_PATH", "MAX_HOLDERS",
           "MAX_MEMBER_BYTES", "SUPERSEDED_QUERY", "Directory", "decode_holders",
           "decode_superseded", "decode_update", "encode_holders", "encode_superseded",
           "encode_update", "frame_digest", "holders_cap", "parse_age"]

DIR_LOOKUP_PATH = f"{proto.API_PREFIX}/dir/lookup"
DIR_UPDATE_PATH = f"{proto.API_PREFIX}/dir/update"
#: Query name of a batch put that forwards evicted last copies: their age in seconds.
AGE_QUERY = "age"
#: Query of an update that also answers, first, the holders of each added key after it.
ADDED_QUERY = "added=1"
#: Query of a stamped batch delete that drops only values older than its stamps whose
#: content differs (a digest per key), leaving no tombstone: the older copies a client's
#: write through another member superseded.
SUPERSEDED_QUERY = "superseded=1"
#: Longest member id (``host:port``) a directory accepts.
MAX_MEMBER_BYTES = 300
#: Holders a directory keeps per key (the most recent registrations; more copies than this
#: of one block exist only as read copies, and any one of them serves a read).
MAX_HOLDERS = 16

_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<H")
_DIGEST = struct.Struct("<Q")


class Directory:
    """The holder entries one member keeps as a directory owner (in memory; a restarted
    owner is refilled by its holders' anti-entropy pass)."""

    def __init__(self) -> None:
        # key -> holders in the order they registered (a dict as an ordered set)
        self._holders: dict[bytes, dict[str, None]] = {}
        self.updates = 0

    def __len__(self) -> int:
        """Keys with at least one holder."""
        return len(self._holders)

    def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key (empty: none known)."""
        return [list(self._holders.get(k, ())) for k in keys]

    def update(self, holder: str, add: Sequence[bytes], remove: Sequence[bytes]
               ) -> list[list[str]]:
        """Record that ``holder`` holds ``add`` and no longer holds ``remove``; returns, per
        removed key, the holders left."""
        self.updates += 1
        for key in add:
            entry = self._holders.setdefault(key, {})
            entry.pop(holder, None)
            entry[holder] = None
            if len(entry) > MAX_HOLDERS:
                del entry[next(iter(entry))]
        left: list[list[str]] = []
        for key in remove:
            held = self._holders.get(key)
            if held is not None:
                held.pop(holder, None)
                if not held:
                    del self._holders[key]
            left.append(list(held or ()))
        return left


def encode_holders(lists: Sequence[Sequence[str]]) -> bytes:
    """A holder-list body."""
    out = [_COUNT.pack(len(lists))]
    for holders in lists:
        out.append(_LEN.pack(len(holders)))
        for member in holders:
            raw = member.encode()
            out += [_LEN.pack(len(raw)), raw]
    return b"".join(out)


def decode_holders(body: bytes | memoryview, expected: int) -> list[list[str]]:
    """Decode a holder-list body of ``expected`` entries.

    Raises
    ------
    ProtocolError
        If the body is truncated, has trailing bytes, another count, or a bad member id.
    """
    view = memoryview(body)
    count, at = _take_count(view, 0)
    if count != expected:
        raise proto.ProtocolError(f"holder list: {count} entries, expected {expected}")
    out: list[list[str]] = []
    for _ in range(count):
        n, at = _take_len(view, at)
        holders = []
        for _ in range(n):
            member, at = _take_member(view, at)
            holders.append(member)
        out.append(holders)
    if at != len(view):
        raise proto.ProtocolError(f"holder list: {len(view) - at} trailing bytes")
    return out


def encode_update(holder: str, add: Sequence[bytes], remove: Sequence[bytes]) -> bytes:
    """An update request body."""
    raw = holder.encode()
    return b"".join([_LEN.pack(len(raw)), raw, proto.encode_keys(add),
                     proto.encode_keys(remove)])


def decode_update(body: bytes | memoryview, max_keys: int
                  ) -> tuple[str, list[bytes], list[bytes]]:
    """``(holder, add, remove)`` of an update body; at most ``max_keys`` keys in all.

    Raises
    ------
    ProtocolError
        If the body is malformed (bad member id, truncated or oversized key lists).
    """
    view = memoryview(body)
    holder, at = _take_member(view, 0)
    add_end = _key_list_end(view, at)
    add = proto.decode_keys(view[at:add_end], max_keys)
    remove = proto.decode_keys(view[add_end:], max_keys - len(add))
    return holder, add, remove


def _take_count(view: memoryview, at: int) -> tuple[int, int]:
    if len(view) - at < _COUNT.size:
        raise proto.ProtocolError("truncated count")
    return _COUNT.unpack_from(view, at)[0], at + _COUNT.size


def _take_len(view: memoryview, at: int) -> tuple[int, int]:
    if len(view) - at < _LEN.size:
        raise proto.ProtocolError("truncated length")
    return _LEN.unpack_from(view, at)[0], at + _LEN.size


def _take_member(view: memoryview, at: int) -> tuple[str, int]:
    size, at = _take_len(view, at)
    if not 0 < size <= MAX_MEMBER_BYTES or len(view) - at < size:
        raise proto.ProtocolError(f"member id: expected 1..{MAX_MEMBER_BYTES} bytes present, "
                                  f"got a length of {size}")
    try:
        member = bytes(view[at:at + size]).decode()
    except UnicodeDecodeError:
        raise proto.ProtocolError("member id: not UTF-8") from None
    host, sep, port = member.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise proto.ProtocolError(f"member id: expected host:port, got {member[:80]!r}")
    return member, at + size


def _key_list_end(view: memoryview, at: int) -> int:
    """Where the key list starting at ``at`` ends (its keys are checked by decode_keys)."""
    count, at = _take_count(view, at)
    for _ in range(count):
        size, at = _take_len(view, at)
        at += size
        if at > len(view):
            raise proto.ProtocolError("key list: truncated")
    return at


def frame_digest(header: bytes | memoryview) -> int:
    """The content digest of a block: its version-2 frame's checksum (the header's last 8
    bytes: key, header and payload), equal for equal blocks under one key."""
    return int(_DIGEST.unpack_from(header, len(header) - _DIGEST.size)[0])


def encode_superseded(keys: Sequence[bytes], digests: Sequence[int]) -> bytes:
    """A superseded-copies body: a key list, then one u64 content digest per key."""
    return proto.encode_keys(keys) + struct.pack(f"<{len(digests)}Q", *digests)


def decode_superseded(body: bytes | memoryview, max_keys: int) -> tuple[list[bytes], list[int]]:
    """``(keys, digests)`` of a superseded-copies body.

    Raises
    ------
    ProtocolError
        If the key list is malformed or the digests are not one u64 per key.
    """
    view = memoryview(body)
    end = _key_list_end(view, 0)
    keys = proto.decode_keys(view[:end], max_keys)
    if len(view) - end != _DIGEST.size * len(keys):
        raise proto.ProtocolError(f"superseded copies: expected {len(keys)} digests of "
                                  f"{_DIGEST.size} bytes, got {len(view) - end} bytes")
    return keys, list(struct.unpack_from(f"<{len(keys)}Q", view, end))


def holders_cap(max_batch: int) -> int:
    """Most bytes of a holder-list answer for ``max_batch`` keys."""
    return 4 + max_batch * (2 + MAX_HOLDERS * (2 + MAX_MEMBER_BYTES))


def parse_age(value: str | None) -> float | None:
    """The ``age`` query of a forward (``None`` when absent).

    Raises
    ------
    ProtocolError
        If it is not a finite number of seconds >= 0.
    """
    if value is None:
        return None
    try:
        age = float(value)
    except ValueError:
        age = -1.0
    if not (age >= 0 and math.isfinite(age)):
        raise proto.ProtocolError(f"age: expected seconds >= 0, got {value[:40]!r}")
    return age
