"""The kvtier error tree.

Every error kvtier raises derives from :class:`KVTierError`. Argument errors also derive
from the matching builtin (``TypeError``/``ValueError``) so callers may catch either.
Messages never show a secret: string arguments pass through
:func:`kvtier.redact.mask_secrets`::

    KVTierError
    ├── ConfigError (ValueError)
    │   └── UnknownSchemeError
    ├── InvalidKeyError (ValueError)
    ├── BlockTooLargeError (ValueError)
    ├── ShapeMismatchError (ValueError)
    ├── CorruptBlockError
    ├── TierError
    │   ├── TierFullError
    │   ├── PeerError
    │   │   └── PeerStatusError
    │   └── DirectoryLockedError
    ├── ProtocolError (ValueError)
    │   └── LimitExceededError
    ├── ClosedError
    ├── WrongLoopError (RuntimeError)
    ├── NotOpenedError (AttributeError)
    └── BackendUnavailableError (ImportError)
"""

from __future__ import annotations

from kvtier.redact import mask_secrets

__all__ = [
    "BackendUnavailableError",
    "BlockTooLargeError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DirectoryLockedError",
    "InvalidKeyError",
    "KVTierError",
    "LimitExceededError",
    "NotOpenedError",
    "PeerError",
    "PeerStatusError",
    "ProtocolError",
    "ShapeMismatchError",
    "TierError",
    "TierFullError",
    "UnknownSchemeError",
    "WrongLoopError",
]


class KVTierError(Exception):
    """Base class of every kvtier error (its message is stripped of secrets)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(mask_secrets(a) if isinstance(a, str) else a for a in args))


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


class DirectoryLockedError(TierError):
    """Another process (or another tier object) already owns this LMDB directory."""


class ProtocolError(KVTierError, ValueError):
    """A peer protocol message (batch body, frame list) is malformed."""


class LimitExceededError(ProtocolError):
    """A batch body is well formed but holds more entries or a larger frame than allowed."""


class PeerStatusError(PeerError):
    """A peer answered with an HTTP error status (``status``); the peer itself is up."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ClosedError(KVTierError):
    """The tier or store was used after ``aclose()``."""


class WrongLoopError(KVTierError, RuntimeError):
    """A store was called from an event loop other than the one it was opened on.

    A ``TieredStore`` belongs to one loop. Synchronous callers (scheduler threads) use
    ``kvtier.BlockingStore``, which runs the store on its own loop thread; asyncio code on
    another loop opens its own store.
    """


class NotOpenedError(KVTierError, AttributeError):
    """A store method was called on what ``open_store(...)`` returns without awaiting it
    (``store = await open_store(...)`` or ``async with open_store(...) as store:``)."""


class BackendUnavailableError(KVTierError, ImportError):
    """An optional device backend (torch, cupy) is not installed."""
