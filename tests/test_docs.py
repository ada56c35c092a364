"""The docs stand alone and match the code (issue 22 item 7): no reference outside the
repository, every option each tier's URL parser accepts listed in ``docs/tier-urls.md``
(the lists come from the parsers' own refusals of an unknown option), the README's test
command with its duration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.registry import tier_from_url

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# What a reader of the repository does not have: the build machine's paths and the
# workspace beside the checkout.
OUTSIDE = re.compile(r"DESIGN\.md|DESIGN (section|§)|\.\./shared|shared/traces|shared/bench|"
                     r"/work/|/home/|STYLE\.md|HELPERS\.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_reference_outside_the_repository(doc: Path) -> None:
    hits = [f"{doc.name}:{n}: {line.strip()}" for n, line in
            enumerate(doc.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def _allowed_options(url: str) -> list[str]:
    """The options the tier's parser accepts, from its refusal of an unknown one."""
    sep = "&" if "?" in url else "?"
    with pytest.raises(ConfigError) as info:
        tier_from_url(f"{url}{sep}zz_not_an_option=1")
    match = re.search(r"\((?:allowed|kvtier options): ([^)]*)\)", str(info.value))
    assert match, str(info.value)
    return [name.strip() for name in match.group(1).split(",")]


def _row(scheme: str) -> str:
    for line in (REPO / "docs" / "tier-urls.md").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| `{scheme}`"):
            return line.split(" | ")[2]  # the options column
    raise AssertionError(f"no row for {scheme}:// in docs/tier-urls.md")


def _tier_urls(tmp: Path) -> dict[str, str]:
    urls = {"dram": "dram://?capacity=1MiB", "peers": "peers://127.0.0.1:9",
            "local": "local://kv0",
            "lmdb": f"lmdb://{tmp}/lmdb", "file": f"file://{tmp}/files"}
    try:
        import redis  # noqa: F401
    except ImportError:
        pass
    else:
        urls["redis"] = "redis://127.0.0.1:9"
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        pass
    else:
        urls["mooncake"] = "mooncake://127.0.0.1:9"
    return urls


def test_every_url_option_is_in_tier_urls(tmp_path: Path) -> None:
    missing = {}
    for scheme, url in _tier_urls(tmp_path).items():
        row = _row(scheme)
        absent = [o for o in _allowed_options(url) if f"`{o}`" not in row
                  and f"`{o}=" not in row]
        if absent:
            missing[scheme] = absent
    assert not missing, f"options the parsers accept but docs/tier-urls.md omits: {missing}"


def test_readme_states_the_test_suite_duration() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    line = next(ln for ln in readme.splitlines() if ln.startswith("python -m pytest"))
    assert re.search(r"\d+ min", line), line
