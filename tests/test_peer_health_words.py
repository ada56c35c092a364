"""What the failure detector says of a member in words, and the ``unavailable`` reason of a
key whose owners did not all answer "not here" (``kvtier.peer.health``)."""

from __future__ import annotations

from kvtier.peer.client import PeerTimeoutError
from kvtier.peer.health import FailureDetector, failure_text, silent_owners


def test_describe_says_down_suspected_or_unreachable_with_the_last_failure() -> None:
    d = FailureDetector(fail_after=3)
    assert d.describe("a") is None
    d.failure("a", 0.0, 0.5, hard=False, error=PeerTimeoutError("peer a: GET timed out"))
    assert d.describe("a") == ("is suspected (1 failure(s) since its last answer, last: "
                               "timed out after 0.50 s)")
    d.take_down("b", ConnectionRefusedError(111, "Connect call failed"))
    text = d.describe("b")
    assert text is not None and text.startswith("is down (out of the path; no health probe")
    assert "ConnectionRefusedError" in text
    d.success("a", 0.01, 1)
    assert d.describe("a") is None


def test_silent_owners_is_none_only_when_every_owner_said_not_here() -> None:
    d = FailureDetector()
    d.take_down("b", "refused")
    assert silent_owners(["a"], {"a", "c"}, d.describe) is None
    assert silent_owners(["a", "b"], {"a"}, d.describe) == \
        "1 of 2 owners did not answer: b is down (out of the path; no health probe " \
        "answers, last: refused)"
    assert silent_owners(["c"], set(), d.describe) == "owner c did not answer this read"


def test_failure_text_is_one_bounded_line() -> None:
    assert failure_text(TimeoutError(), 1.234) == "timed out after 1.23 s"
    long = failure_text(OSError("x\n" * 200))
    assert "\n" not in long and len(long) <= 120 and long.endswith("...")
