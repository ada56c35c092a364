"""The suite's two hypothesis profiles and the example counts of its expensive property tests.

``ci`` (the default) is what ``python -m pytest -q`` runs: the stateful machines run a quarter
of their examples, so the suite stays near 10 minutes on a loaded 2-core box. ``thorough``
(``KVTIER_HYPOTHESIS_PROFILE=thorough``) runs the full counts each test names, for a deeper
search before a release or after a change to the store's chain, eviction or codec. Neither
has a deadline: on a loaded box an example's time says nothing about the code.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["PROFILE", "PROFILE_ENV", "examples", "load_profile"]

PROFILE_ENV = "KVTIER_HYPOTHESIS_PROFILE"
PROFILE = os.environ.get(PROFILE_ENV, "ci")
_PROFILES = ("ci", "thorough")
_CI_FRACTION = 4  # ci runs 1/4 of a test's thorough examples ...
_CI_FLOOR = 10  # ... but never fewer than this (or the thorough count, if smaller)


def load_profile() -> str:
    """Register both profiles and load the one :data:`PROFILE_ENV` names (``ci`` when
    unset); returns its name. Raises ``ValueError`` on an unknown name, so a typo does not
    silently run the short profile."""
    if PROFILE not in _PROFILES:
        raise ValueError(f"{PROFILE_ENV}={PROFILE!r}: expected one of {', '.join(_PROFILES)}")
    quiet = [HealthCheck.too_slow]
    settings.register_profile("ci", max_examples=50, deadline=None, suppress_health_check=quiet)
    settings.register_profile("thorough", max_examples=200, deadline=None,
                              suppress_health_check=quiet)
    settings.load_profile(PROFILE)
    return PROFILE


def examples(thorough: int) -> int:
    """``max_examples`` for a test that runs ``thorough`` examples under the ``thorough``
    profile: that many there, a quarter (at least 10) under ``ci``."""
    if PROFILE == "thorough":
        return thorough
    return max(min(thorough, _CI_FLOOR), thorough // _CI_FRACTION)
