"""The kvtier error tree.

Every error kvtier raises derives from :class:`KVTierError`. Argument errors also derive
from the matching builtin (``TypeError``/``ValueError``) so callers may catch either.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "BlockTooLargeError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "InvalidKeyError",
    "KVTierError",
    "PeerError",
    "PeerStatusError",
    "ShapeMismatchError",
    "TierError",
    "TierFullError",
    "UnknownSchemeError",
]


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A tier URL, capacity string or option is malformed."""


class UnknownSchemeError(ConfigError):
    """A tier URL names a scheme no installed tier handles."""


class InvalidKeyError(KVTierError, ValueError):
    """A key has the right type but an invalid length."""


class BlockTooLargeError(KVTierError, ValueError):
    """A block is larger than a tier's whole capacity or a configured limit."""


class ShapeMismatchError(KVTierError, ValueError):
    """A caller-owned output buffer does not match the stored block."""


class CorruptBlockError(KVTierError):
    """A stored frame failed its checksum or could not be parsed."""


class TierError(KVTierError):
    """A tier failed an operation (I/O error, peer down, ...)."""


class TierFullError(TierError):
    """A tier cannot make room: the blocks it would have to evict are pinned."""


class PeerError(TierError):
    """A peer answered with an error or could not be reached."""


class PeerStatusError(PeerError):
    """A peer answered with an HTTP error status (``status``); the peer itself is up."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ClosedError(KVTierError):
    """The tier or store was used after ``aclose()``."""


class BackendUnavailableError(KVTierError, ImportError):
    """An optional device backend (torch, cupy) is not installed."""
