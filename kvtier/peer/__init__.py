"""The peer pool: consistent-hash ring, peer server and client tier."""

from kvtier.peer.ring import HashRing

__all__ = ["HashRing"]
