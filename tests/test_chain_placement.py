"""ChainPlacement: which key of a prefix chain picks each block's owner (hand-computed)."""

from __future__ import annotations

import pytest

from kvtier.peer.chains import ChainPlacement


def _chain(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


def test_block_places_each_block_by_its_own_key() -> None:
    chain = _chain(4)
    p = ChainPlacement()
    assert p.per_block
    assert p.learn(chain) == chain
    assert p.placement_key(chain[2]) == chain[2]


def test_chunk_places_runs_by_their_first_key() -> None:
    k = _chain(5)
    assert ChainPlacement("chunk:2").placement_keys(k) == [k[0], k[0], k[2], k[2], k[4]]
    assert ChainPlacement("chunk:1").placement_keys(k) == k


def test_anchor_places_the_whole_chain_by_block_r_or_the_last() -> None:
    k = _chain(5)
    p = ChainPlacement("anchor:1")
    assert p.placement_keys(k) == [k[1]] * 5
    assert p.placement_keys(k[:1]) == [k[0]]  # shorter than R+1: its last block
    assert ChainPlacement("anchor:0").placement_keys(k) == [k[0]] * 5
    assert ChainPlacement("anchor:9").placement_keys(k) == [k[4]] * 5


def test_learned_keys_answer_for_a_partial_chain_and_the_memo_is_bounded() -> None:
    k = _chain(6)
    p = ChainPlacement("anchor:1", memo_keys=4)
    p.learn(k[:3])  # k0..k2 -> k1
    assert p.placement_key(k[2]) == k[1]
    p.learn(k)  # all six -> k1, the oldest learned (k0, k1) forgotten beyond 4 keys
    assert [p.placement_key(x) for x in k] == [k[0], k[1], k[1], k[1], k[1], k[1]]
    assert p.placement_key(b"unknown") == b"unknown"


@pytest.mark.parametrize("mode", ["", "chunk:0", "chunk:x", "anchor:-1", "ring"])
def test_bad_mode_is_rejected(mode: str) -> None:
    with pytest.raises(ValueError, match="placement"):
        ChainPlacement(mode)


def test_bad_memo_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="memo_keys"):
        ChainPlacement("anchor:1", memo_keys=-1)


def test_root_places_the_head_by_own_keys_and_the_rest_by_block_r() -> None:
    k = _chain(5)
    assert ChainPlacement("root:2").placement_keys(k) == [k[0], k[1], k[2], k[2], k[2]]
    assert ChainPlacement("root:9").placement_keys(k) == k


def test_a_put_after_a_parent_continues_its_chain() -> None:
    k = _chain(6)
    p = ChainPlacement("anchor:1")
    p.learn(k[:3])  # a lookup of the prompt from block 0
    assert p.learn(k[3:], parent=k[2]) == [k[1]] * 3
    assert p.placement_key(k[5]) == k[1]


def test_a_parent_before_block_r_lets_the_new_keys_pick_the_anchor() -> None:
    k = _chain(4)
    p = ChainPlacement("anchor:1")
    p.learn(k[:1])  # a one-block chain is placed by its only block
    assert p.placement_key(k[0]) == k[0]
    assert p.learn(k[1:], parent=k[0]) == [k[1]] * 3


def test_a_batch_starting_at_a_known_key_keeps_its_position() -> None:
    k = _chain(8)
    p = ChainPlacement("chunk:3")
    p.learn(k)
    assert p.learn(k[4:7]) == [k[3], k[3], k[6]]  # not re-placed as if k4 were block 0
    q = ChainPlacement("anchor:1")
    q.learn(k)
    assert q.learn(k[5:]) == [k[1]] * 3


def test_an_unknown_parent_leaves_keys_placed_by_their_own_keys() -> None:
    k = _chain(4)
    p = ChainPlacement("anchor:1")
    assert p.learn(k[2:], parent=k[1]) == k[2:]
    assert len(p) == 0
    assert p.learn(k[:2]) == [k[1], k[1]]  # an unknown first key starts a chain


def test_anchor_with_a_depth_splits_long_chains_into_runs() -> None:
    k = _chain(9)
    p = ChainPlacement("anchor:1:4")
    assert p.placement_keys(k) == [k[1]] * 4 + [k[4]] * 4 + [k[8]]
    p.learn(k[:6])
    assert p.learn(k[6:], parent=k[5]) == [k[4], k[4], k[8]]
    assert p.learn(k[5:7]) == [k[4], k[4]]


@pytest.mark.parametrize("mode", ["anchor:1:1", "anchor:2:x", "chunk:2:4", "root:1:4"])
def test_bad_depth_is_rejected(mode: str) -> None:
    with pytest.raises(ValueError, match="placement"):
        ChainPlacement(mode)
