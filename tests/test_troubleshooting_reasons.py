"""``docs/troubleshooting.md`` lists every miss reason with what to do, generated from the
code (``kvtier.misses.REASON_HELP``, one entry per ``MissReason``): this test fails when
the two differ. ``KVTIER_UPDATE_DOCS=1`` rewrites the table from the code instead."""

from __future__ import annotations

import os

from kvtier.misses import REASON_HELP, MissReason, reasons_table
from tests.helpers.peer_helpers import REPO

DOC = REPO / "docs" / "troubleshooting.md"
END = "<!-- end of the generated table -->"
HEADER = "| reason | what happened | what to look at |"


def test_every_reason_has_help() -> None:
    assert set(REASON_HELP) == set(MissReason)
    assert all(h.what.strip() and h.todo.strip() for h in REASON_HELP.values())
    assert all("|" not in h.what + h.todo for h in REASON_HELP.values())  # one table cell


def test_troubleshooting_table_is_the_code_s() -> None:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(HEADER), text.index(END)
    if os.environ.get("KVTIER_UPDATE_DOCS") == "1":
        DOC.write_text(text[:start] + reasons_table() + text[end:], encoding="utf-8")
        text = DOC.read_text(encoding="utf-8")
        start, end = text.index(HEADER), text.index(END)
    assert text[start:end] == reasons_table(), (
        "docs/troubleshooting.md's reason table differs from kvtier.misses.REASON_HELP: "
        "run KVTIER_UPDATE_DOCS=1 pytest tests/test_troubleshooting_reasons.py")
    for reason in MissReason:
        assert f"| `{reason}` |" in text
