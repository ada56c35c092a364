"""Keep secrets out of messages: masks bearer tokens and ``token=`` / password values in text.

Every :class:`kvtier.errors.KVTierError` message passes through :func:`mask_secrets`, so a
literal secret in a tier URL (``peers://...?token=s3cret``) never reaches an exception's
message or repr, a log line or a command's output.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "mask_secrets"]

MASK = "***"
# token=, secret=, password= and friends in URL queries (up to the next separator; an
# env:NAME or file:PATH reference names where the secret is and stays readable); the
# password of URL user info (scheme://user:password@host); bearer credentials.
_PATTERNS = (
    re.compile(r"(?i)((?<![\w.-])(?:[\w.-]*(?:token|secret|password|passwd|credentials?)"
               r"|[\w.-]*_key|key)=)(?!env:|file:)[^&\s'\"<>,;)]+"),
    re.compile(r"(://[^/:@\s'\"]*:)[^/@\s'\"]+(@)"),
    # Case-sensitive: the scheme as kvtier sends it, not the English word ("bearer token").
    re.compile(r"(\bBearer\s+)[^\s'\",;)]+"),
)


def mask_secrets(text: str) -> str:
    """``text`` with every secret value it shows replaced by ``***``.

    Examples
    --------
    >>> mask_secrets("peers://h:7070?token=s3cret&replicas=2")
    'peers://h:7070?token=***&replicas=2'
    >>> mask_secrets("token=env:KVTIER_TOKEN")  # a reference, not the secret
    'token=env:KVTIER_TOKEN'
    >>> mask_secrets("Authorization: Bearer abc")
    'Authorization: Bearer ***'
    """
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK + (m.group(2) if m.re.groups > 1
                                                          else ""), text)
    return text
