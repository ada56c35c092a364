"""Failure detection for the peer pool: when a member leaves and rejoins the read and write
paths, how fast it answers, and when it restarted.

One slow answer says little about a member under load, so a member is taken out of the path
only by several signals (see :class:`FailureDetector`):

- ``fail_after`` failures in a row (timeouts, resets, 5xx answers, failed health probes),
  counting a burst of requests that failed together as one: a failure counts only when its
  request started after the previous counted failure, so 16 writers timing out on one stall
  are one signal, not sixteen;
- or one *hard* failure: the connection was refused (nothing listens on the port) or a
  health probe was answered wrongly (redirect, error status, bad document).

A member out of the path rejoins after ``rejoin_after`` health probes in a row answered
within the request timeout (hysteresis: a member that answers one small probe between
timeouts does not flap in and out). Meanwhile it stays *reachable* as long as its last
probe answered, and the pool still asks a reachable member when it is the only owner left;
a read asks an owner whose last probe timed out too, after the reachable ones (it may be
back from a freeze, or only busy, with its blocks: a fresh client would ask it), but never
one that refused the connection or answered wrongly.

Latency is an exponentially weighted mean of seconds per key of the member's requests
(timeouts count at the time they took), used to ask slow members after their co-owners, with
its mean deviation: ``mean + 4 x deviation`` (as TCP's retransmission timer) approximates a
high percentile of the member's latency, after which a hedged read asks the next owner too.

The detector also says, in words, what is wrong with a member (:meth:`FailureDetector.describe`:
down, suspected, not answering health probes, with its last failure), and
:func:`silent_owners` turns a read's answers into the ``unavailable`` reason of a key whose
owner did not say "not here" (:mod:`kvtier.misses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

__all__ = ["FailureDetector", "MemberHealth", "StartEstimate", "failure_text", "is_timeout",
           "silent_owners"]

_ERROR_TEXT = 120  # characters of a failure's message kept for explain (one line)


@dataclass
class StartEstimate:
    """When a member started, in this process's monotonic clock: between ``earliest`` and
    ``latest`` (the uptime was read somewhere between sending the probe and its answer)."""

    earliest: float
    latest: float

    @classmethod
    def from_uptime(cls, uptime: object, sent: float, received: float) -> StartEstimate | None:
        """The estimate from one ``/v1/health`` reading; ``None`` for a missing, negative or
        non-finite ``uptime_s`` (such a reading tells nothing about restarts)."""
        if isinstance(uptime, bool) or not isinstance(uptime, int | float) \
                or not math.isfinite(uptime) or uptime < 0:
            return None
        return cls(sent - float(uptime), received - float(uptime))


@dataclass
class MemberHealth:
    """What this process knows of one member's health."""

    down: bool = False
    #: Failures counted since the last success (each from a request started after the last).
    suspicion: int = 0
    last_failure: float = -math.inf
    #: Health probes answered in a row while down.
    good_probes: int = 0
    #: Whether the last health probe (or connection attempt) was answered.
    reachable: bool = True
    #: Seconds per key, exponentially weighted; ``None`` before the first answer.
    latency: float | None = None
    #: Mean absolute deviation of the latency samples, exponentially weighted.
    deviation: float = 0.0
    started: StartEstimate | None = None
    #: The last failure in words (``timed out after 0.50 s``, ``ConnectionRefusedError: ...``).
    last_error: str = ""
    #: Whether the last failure was a timeout: the member may be frozen or only busy, with
    #: its blocks still held (a refused connection or a wrong answer clears it).
    timed_out: bool = False


def is_timeout(error: object) -> bool:
    """Whether ``error`` is a request (or health probe) that ran out of time."""
    return isinstance(error, TimeoutError) or type(error).__name__ == "PeerTimeoutError"


def failure_text(error: object, elapsed: float | None = None) -> str:
    """One line saying how a request (or health probe) to a member failed."""
    if is_timeout(error):
        return "timed out" + (f" after {elapsed:.2f} s" if elapsed is not None else "")
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    text = " ".join(text.split())
    return text if len(text) <= _ERROR_TEXT else text[:_ERROR_TEXT - 3] + "..."


def silent_owners(owners: Sequence[str], answered: Collection[str],
                  describe: Callable[[str], str | None]) -> str | None:
    """Why a key that no member served is ``unavailable`` rather than ``not_stored``.

    Parameters
    ----------
    owners
        The key's owners under the pool's placement (whether or not they are in the path).
    answered
        The members that answered "not here" for the key during the read.
    describe
        A member's state in words (:meth:`FailureDetector.describe`), ``None`` if healthy.

    Returns
    -------
    str or None
        ``None`` when every owner answered "not here" (the key is not stored); else a line
        naming each owner that did not answer and its state.
    """
    silent = [m for m in owners if m not in answered]
    if not silent:
        return None
    states = "; ".join(f"{m} {describe(m) or 'did not answer this read'}" for m in silent)
    if len(owners) == 1:
        return f"owner {states}"
    return f"{len(silent)} of {len(owners)} owners did not answer: {states}"


class FailureDetector:
    """Per-member suspicion, hysteresis and latency.

    Parameters
    ----------
    fail_after
        Counted failures in a row that take a member out of the path.
    rejoin_after
        Health probes in a row, answered within the request timeout, that bring it back.
    slow_factor
        A member whose latency exceeds ``slow_factor`` times its fastest co-owner's (and
        that by more than ``slow_margin`` seconds) is asked after it.
    slow_margin
        See ``slow_factor``: differences below it are noise.
    """

    _ALPHA = 0.2  # weight of the newest latency sample
    _HEDGE_FLOOR = 0.002  # seconds: below this a second request costs more than it saves

    def __init__(self, *, fail_after: int = 3, rejoin_after: int = 2, slow_factor: float = 3.0,
                 slow_margin: float = 0.002) -> None:
        self.fail_after = fail_after
        self.rejoin_after = rejoin_after
        self.slow_factor = slow_factor
        self.slow_margin = slow_margin
        self._members: dict[str, MemberHealth] = {}

    def __getitem__(self, member: str) -> MemberHealth:
        found = self._members.get(member)
        if found is None:
            found = self._members[member] = MemberHealth()
        return found

    def forget(self, member: str) -> None:
        """Drop what is known of a member that left the pool."""
        self._members.pop(member, None)

    def failure(self, member: str, started: float, elapsed: float, *, hard: bool,
                error: object = None) -> bool:
        """Count one failed request (started at monotonic ``started``, failed after
        ``elapsed`` seconds, with ``error``); ``True`` when this takes the member out of
        the path."""
        state = self[member]
        state.good_probes = 0
        if error is not None:
            state.last_error = failure_text(error, elapsed)
            state.timed_out = not hard and is_timeout(error)
        if hard:
            state.reachable = False
        self._sample(state, elapsed, 1)
        if started > state.last_failure or hard:
            state.suspicion += 1
            state.last_failure = started + elapsed
        if state.down or not (hard or state.suspicion >= self.fail_after):
            return False
        state.down = True
        return True

    def success(self, member: str, elapsed: float, keys: int) -> bool:
        """Count one answered request of ``keys`` keys that took ``elapsed`` seconds;
        ``True`` when it clears the suspicion of a member in the path."""
        state = self[member]
        cleared = state.suspicion > 0 and not state.down
        state.suspicion = 0
        self._sample(state, elapsed, keys)
        return cleared

    def probe_answered(self, member: str) -> bool:
        """Count one health probe answered in time; ``True`` when the member rejoins."""
        state = self[member]
        state.reachable = True
        state.suspicion = 0
        if not state.down:
            return False
        state.good_probes += 1
        if state.good_probes < self.rejoin_after:
            return False
        state.down, state.good_probes = False, 0
        return True

    def take_down(self, member: str, error: object = None) -> bool:
        """Take a member out at once (a hard signal, ``error``); ``True`` if it was in the
        path."""
        state = self[member]
        state.reachable, state.good_probes, state.timed_out = False, 0, False
        if error is not None:
            state.last_error = failure_text(error)
        was_up, state.down = not state.down, True
        return was_up

    def bring_up(self, member: str) -> bool:
        """Put a member back at once; ``True`` if it was out."""
        state = self[member]
        was_down = state.down
        state.down, state.good_probes, state.suspicion, state.reachable = False, 0, 0, True
        return was_down

    def describe(self, member: str) -> str | None:
        """What is wrong with ``member``, in words, or ``None`` when nothing is: ``down``
        (out of the path), ``suspected`` (failures since its last answer) or not answering
        health probes, each with its last failure."""
        state = self._members.get(member)
        if state is None or not (state.down or state.suspicion or not state.reachable):
            return None
        last = f", last: {state.last_error}" if state.last_error else ""
        if state.down:
            probes = "answers health probes" if state.reachable else "no health probe answers"
            return f"is down (out of the path; {probes}{last})"
        if state.suspicion:
            return f"is suspected ({state.suspicion} failure(s) since its last answer{last})"
        return f"does not answer health probes{last}"

    def prefer(self, owners: list[str]) -> list[str]:
        """``owners`` with members under suspicion and slow ones (next to their fastest
        co-owner) moved after the others, order otherwise kept."""
        if len(owners) < 2:
            return owners
        known = [s.latency for s in (self[m] for m in owners) if s.latency is not None]
        best = min(known, default=None)

        def rank(member: str) -> tuple[bool, bool]:
            state = self[member]
            slow = best is not None and state.latency is not None and \
                state.latency > max(best * self.slow_factor, best + self.slow_margin)
            return state.suspicion > 0, slow

        return sorted(owners, key=rank)

    def hedge_delay(self, member: str) -> float | None:
        """Seconds after which a read still unanswered by ``member`` is sent to the next
        owner too: ``latency + 4 x deviation`` (at least 2 ms); ``None`` before the member
        answered anything."""
        state = self[member]
        if state.latency is None:
            return None
        return max(self._HEDGE_FLOOR, state.latency + 4 * state.deviation)

    def _sample(self, state: MemberHealth, elapsed: float, keys: int) -> None:
        sample = elapsed / max(keys, 1)
        if state.latency is None:
            state.latency = sample
            return
        state.deviation += self._ALPHA * (abs(sample - state.latency) - state.deviation)
        state.latency += self._ALPHA * (sample - state.latency)
