"""Read-only readers of a shared location: the write probe's modes, which probe failures
mean "readable but not writable", and the guard that refuses writes afterwards.

A WEKA/VAST mount or a bucket is often shared by writers and by readers that may read but
not write it (another owner, mode 0555/0444, a read-only mount or credentials). Such a
reader should just work: under ``probe=auto`` (the default) a probe that fails with a
permission or read-only error (``EACCES``, ``EPERM``, ``EROFS``) opens the tier read-only
if its root can still be listed; ``probe=require`` makes every probe failure a
:class:`~kvtier.errors.ConfigError` (a writer that must write), ``probe=0`` skips the probe.
A location that cannot be read either is always a ``ConfigError``.
"""

from __future__ import annotations

import errno
import logging
import os
from enum import StrEnum

from kvtier.deadline import Deadline, in_thread
from kvtier.errors import ConfigError
from kvtier.tiers.fsspec_io import AsyncFsBackend, Backend, LocalBackend, SyncFsBackend
from kvtier.warnsummary import WarningSummary

__all__ = ["ProbeMode", "ReadOnlyGuard", "check_readable", "is_read_only_error", "parse_probe"]

#: errno values that say "you may not write here" (not "there is nothing here").
_READ_ONLY_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class ProbeMode(StrEnum):
    """The ``probe=`` option of a ``file://`` (fsspec) tier."""

    #: Probe; a permission or read-only failure opens the tier read-only (the default).
    AUTO = "auto"
    #: Probe; any failure is a ``ConfigError``.
    REQUIRE = "require"
    #: No probe (writes are attempted and fail one by one if the location refuses them).
    OFF = "off"


def parse_probe(value: object) -> ProbeMode:
    """``probe=``: ``auto`` (also ``1``/``true``/``yes``/``on``), ``require``, or ``off``
    (also ``0``/``false``/``no``)."""
    if isinstance(value, ProbeMode):
        return value
    if isinstance(value, bool):
        return ProbeMode.AUTO if value else ProbeMode.OFF
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "auto"):
        return ProbeMode.AUTO
    if text in ("0", "false", "no", "off"):
        return ProbeMode.OFF
    if text == "require":
        return ProbeMode.REQUIRE
    raise ConfigError(f"probe: expected auto, require or 0, got {value!r}")


def is_read_only_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the location refuses writes
    (permission denied, read-only filesystem), as opposed to missing or broken."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PermissionError):
            return True
        if isinstance(current, OSError) and current.errno in _READ_ONLY_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


class ReadOnlyGuard:
    """Counts and reports the writes a read-only tier refuses.

    Parameters
    ----------
    name
        The tier's name (in the warning).
    logger
        Where the warning goes: the first refused write of an interval in full, the rest as
        one summary line with a count (:class:`~kvtier.warnsummary.WarningSummary`).

    Notes
    -----
    Runs on the tier's loop only.
    """

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self.name = name
        self.read_only = False
        #: Why the tier is read-only (the probe's error).
        self.why = ""
        self.refused_writes = 0
        self.refused_deletes = 0
        self._warnings = WarningSummary(logger)

    def set_read_only(self, why: str) -> None:
        """Refuse writes from now on, because of ``why``."""
        self.read_only, self.why = True, why

    def refuse(self, op: str, count: int = 1) -> None:
        """Count ``count`` refused ``op`` (``put`` or ``delete``) calls and warn."""
        if op == "delete":
            self.refused_deletes += count
        else:
            self.refused_writes += count
        self._warnings.warn(f"{self.name} tier", f"read-only {op}",
                            f"refused: the tier opened read-only ({self.why})")

    def flush(self) -> None:
        """Log what is still counted in the current warning window."""
        self._warnings.flush()

    def stats(self) -> dict[str, object]:
        """``read_only``, ``read_only_reason``, ``refused_writes`` and ``refused_deletes``."""
        return {"read_only": self.read_only, "read_only_reason": self.why,
                "refused_writes": self.refused_writes, "refused_deletes": self.refused_deletes}


async def check_readable(backend: Backend | None, root: str, seconds: float) -> str | None:
    """``None`` when the directory ``root`` can be listed through ``backend`` within
    ``seconds``, else why not (missing, no permission, the back end failing)."""
    try:  # under the probe's one deadline: a listing still queued at it never runs
        async with Deadline.after(seconds, "read probe"):
            if isinstance(backend, LocalBackend):
                await in_thread(os.listdir, root, what="listdir", wait_started=False)
            elif isinstance(backend, AsyncFsBackend):
                await backend.fs._ls(root)
            elif isinstance(backend, SyncFsBackend):
                await in_thread(backend.fs.ls, root, what="fsspec ls", wait_started=False)
            else:
                return "no back end to read it with"
    except Exception as exc:  # whatever the back end raises, it cannot be read
        return f"{type(exc).__name__}: {exc}"
    return None
