"""The catch-up's bookkeeping, pure logic: which positions a stale request misses, how they are split into
forwards, and what a head's stash of hidden states returns (fast; the catch-up itself runs on real engines in
tests/test_spec_control.py and tests/test_eagle3.py)."""

from __future__ import annotations

import torch

from rl_specdec.vllm_ext.drafter_kv import HeadStash, forwards, stale_pieces


def test_a_stale_request_misses_its_positions_up_to_this_steps_start_in_pieces_of_the_budget():
    valid = {"a": 3, "b": 0, "gone": 5}
    pieces = stale_pieces(valid, {"a": 10, "b": 4}, {"a": 1, "b": 0}, budget=4)
    assert pieces == [(0, 0, 4), (1, 3, 7), (1, 7, 10)]
    assert valid == {"gone": 5}  # caught up now; a request not in the step stays stale
    batches = forwards(pieces, budget=8)
    assert batches == [[(0, 0, 4), (1, 3, 7)], [(1, 7, 10)]]  # one piece of a request per forward, in order


def _rows(first: int, n: int, tag: float) -> torch.Tensor:
    return torch.stack([torch.full((2,), tag + p) for p in range(first, first + n)])


def test_the_stash_returns_each_position_once_the_latest_chunk_winning_and_none_for_a_hole():
    stash = HeadStash()
    stash.chunks["r"] = [(0, _rows(0, 4, 0.0)), (4, _rows(4, 1, 0.0)), (2, _rows(2, 3, 100.0))]  # 2..4 recomputed
    got = stash.take("r", 1, 5)
    assert got[:, 0].tolist() == [1.0, 102.0, 103.0, 104.0]
    assert stash.take("r", 3, 6) is None  # position 5 was never kept
    assert stash.take("other", 0, 1) is None


def test_the_stash_drops_every_request_no_longer_stale():
    stash = HeadStash()
    for rid in ("a", "b", "c"):
        stash.chunks[rid] = [(0, _rows(0, 1, 0.0))]
    stash.keep_only({"b": 0})
    assert list(stash.chunks) == ["b"]
