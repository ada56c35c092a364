"""Errors that say what to do: a forgotten ``await`` on ``open_store``, a ``peers://`` URL
without a token, and ``kvtier explain``'s exit status when the tiers cannot open (1, as its
docs say) against a malformed URL (2)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier import KVTierError, open_store
from kvtier.cli import main
from kvtier.errors import ConfigError, NotOpenedError
from kvtier.testing.conformance import key_of
from tests.helpers.peer_helpers import TOKEN, serve_processes


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_processes(tmp_path_factory.mktemp("serve"), 1, ["--tier", "dram://"]) as [p]:
        yield p.member


async def test_forgotten_await_says_to_await() -> None:
    opener = open_store(["dram://?capacity=1MiB"])
    with pytest.raises(NotOpenedError, match=r"was not awaited.*await open_store.*async with"):
        await opener.get(key_of(1))  # type: ignore[attr-defined]
    assert isinstance(NotOpenedError("x"), KVTierError | AttributeError)
    assert not hasattr(opener, "put")
    async with opener as store:  # the opener itself still works
        assert await store.get(key_of(1)) is None


async def test_peers_without_token_is_a_missing_token(member: str) -> None:
    with pytest.raises(ConfigError) as info:
        await open_store([f"peers://{member}?timeout=2"])
    message = str(info.value)
    assert "no bearer token given" in message and "token=" in message, message
    with pytest.raises(ConfigError, match="refused the bearer token"):
        await open_store([f"peers://{member}?token=wrong-{TOKEN}&timeout=2"])


@pytest.mark.parametrize("query", ["token=wrong-token", ""], ids=["wrong", "missing"])
def test_explain_exits_1_when_the_pool_refuses_the_token(
        member: str, query: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", f"peers://{member}?timeout=2&{query}", "--key", key_of(1).hex()])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "cannot open" in out and "token" in out and "wrong-token" not in out


def test_explain_exits_2_on_a_malformed_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "peers://host:notaport", "--key", key_of(1).hex()]) == 2
    assert capsys.readouterr().out.startswith("kvtier explain: ")

