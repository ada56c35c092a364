"""The peer pool: consistent-hash ring, peer server and client tier."""

from kvtier.peer.protocol import Limits
from kvtier.peer.ring import HashRing
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier

__all__ = ["HashRing", "Limits", "PeerServer", "PeerTier"]
