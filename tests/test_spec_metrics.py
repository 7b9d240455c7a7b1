"""Spec-decode counters and metrics: pure arithmetic, no engine."""

from __future__ import annotations

import math

import pytest

from rl_specdec.metrics import aggregate_spec_decode_counters, compute_spec_decode_metrics, counters_from_histogram
from rl_specdec.metrics.counters import ACCEPTED, DRAFT_TOKENS, DRAFTS, PER_POS


def counters(drafts, draft_tokens, accepted, per_pos):
    return {DRAFTS: drafts, DRAFT_TOKENS: draft_tokens, ACCEPTED: accepted, PER_POS: list(per_pos)}


# Three engines, k=3, before and after one generation step (cumulative counters).
START = [
    counters(10, 30, 12, [6, 4, 2]),
    counters(5, 15, 9, [4, 3, 2]),
    counters(0, 0, 0, [0, 0, 0]),
]
END = [
    counters(30, 90, 42, [18, 14, 10]),  # +20 drafts, +60 draft tokens, +30 accepted [12, 10, 8]
    counters(15, 45, 24, [10, 8, 6]),  # +10, +30, +15 [6, 5, 4]
    counters(10, 30, 6, [4, 1, 1]),  # +10, +30, +6 [4, 1, 1]
]


def test_aggregate_sums_engines():
    total = aggregate_spec_decode_counters(END)
    assert total == {DRAFTS: 55.0, DRAFT_TOKENS: 165.0, ACCEPTED: 72.0, PER_POS: [32.0, 23.0, 17.0]}


def test_aggregate_skips_engines_without_speculation_and_pads_positions():
    total = aggregate_spec_decode_counters([{}, None, counters(2, 4, 3, [2, 1]), counters(1, 3, 3, [1, 1, 1])])
    assert total == {DRAFTS: 3.0, DRAFT_TOKENS: 7.0, ACCEPTED: 6.0, PER_POS: [3.0, 2.0, 1.0]}


def test_metrics_equal_hand_computed_values():
    m = compute_spec_decode_metrics(aggregate_spec_decode_counters(START), aggregate_spec_decode_counters(END))
    # deltas: drafts 40, draft tokens 120, accepted 51, per position [22, 16, 13]
    want = {
        "spec_decode/num_drafts": 40.0,
        "spec_decode/num_draft_tokens": 120.0,
        "spec_decode/num_accepted_tokens": 51.0,
        "spec_decode/acceptance_rate": 51 / 120,
        "spec_decode/acceptance_length": 1 + 51 / 40,
        "spec_decode/num_accepted_tokens_pos_1": 22.0,
        "spec_decode/num_accepted_tokens_pos_2": 16.0,
        "spec_decode/num_accepted_tokens_pos_3": 13.0,
        "spec_decode/acceptance_rate_pos_1": 22 / 40,
        "spec_decode/acceptance_rate_pos_2": 16 / 40,
        "spec_decode/acceptance_rate_pos_3": 13 / 40,
    }
    assert m.keys() == want.keys()
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-12), k
    # the per-position counts add up to the accepted tokens
    assert sum(m[f"spec_decode/num_accepted_tokens_pos_{i}"] for i in (1, 2, 3)) == m["spec_decode/num_accepted_tokens"]


def test_first_snapshot_without_start_counts_everything():
    m = compute_spec_decode_metrics(None, counters(4, 12, 6, [3, 2, 1]))
    assert m["spec_decode/acceptance_rate"] == pytest.approx(0.5)
    assert m["spec_decode/acceptance_length"] == pytest.approx(2.5)
    assert m["spec_decode/acceptance_rate_pos_3"] == pytest.approx(0.25)


def test_zero_drafts_gives_finite_values():
    same = counters(7, 21, 10, [5, 3, 2])
    m = compute_spec_decode_metrics(same, dict(same))
    assert m, "speculation is on, so the metrics are reported even for an idle step"
    assert all(math.isfinite(v) for v in m.values())
    assert m["spec_decode/acceptance_rate"] == 0.0
    assert m["spec_decode/acceptance_length"] == 1.0
    assert m["spec_decode/acceptance_rate_pos_1"] == 0.0
    zero = compute_spec_decode_metrics({}, counters(0, 0, 0, [0, 0, 0]))
    assert all(math.isfinite(v) for v in zero.values())


def test_counter_that_went_backwards_never_gives_negative_deltas():
    before = counters(100, 300, 150, [60, 50, 40])
    after_restart = counters(3, 9, 6, [3, 2, 1])  # the engine restarted: counters from zero
    m = compute_spec_decode_metrics(before, after_restart)
    assert all(v >= 0 for v in m.values()), m
    assert all(math.isfinite(v) for v in m.values())
    assert 0.0 <= m["spec_decode/acceptance_rate"] <= 1.0
    assert m["spec_decode/acceptance_length"] >= 1.0
    # one engine of two restarted: the aggregate may go down; still no negative values
    agg0 = aggregate_spec_decode_counters([before, counters(10, 30, 20, [8, 7, 5])])
    agg1 = aggregate_spec_decode_counters([after_restart, counters(20, 60, 30, [15, 10, 5])])
    assert all(v >= 0 for v in compute_spec_decode_metrics(agg0, agg1).values())


def test_nan_or_inf_counters_give_finite_metrics():
    m = compute_spec_decode_metrics(counters(1, 3, 1, [1, 0, 0]), counters(float("nan"), float("inf"), 2, [1, 1, 0]))
    assert all(math.isfinite(v) for v in m.values()), m


def test_no_speculation_gives_empty_metrics():
    assert aggregate_spec_decode_counters([{}, {}, {}]) == {}
    assert aggregate_spec_decode_counters(None) == {}
    assert compute_spec_decode_metrics({}, {}) == {}
    assert compute_spec_decode_metrics(None, None) == {}
    assert compute_spec_decode_metrics({}, {"some/other_metric": 1.0}) == {}


def test_histogram_counters_match_the_definitions():
    # 4 verify steps with k=3: 0, 3, 1 and 3 drafted tokens accepted (12 drafted)
    c = counters_from_histogram([1, 1, 0, 2], num_draft_tokens=12)
    assert c["vllm:spec_decode_num_drafts"] == 4
    assert c["vllm:spec_decode_num_accepted_tokens"] == 0 * 1 + 1 * 1 + 3 * 2
    assert c["vllm:spec_decode_num_accepted_tokens_per_pos"] == [3, 2, 2]  # steps with j >= 1, >= 2, >= 3
    m = compute_spec_decode_metrics(None, c)
    assert m["spec_decode/acceptance_rate"] == pytest.approx(7 / 12)
    assert m["spec_decode/acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert m["spec_decode/acceptance_rate_pos_1"] == pytest.approx(3 / 4)
    # the per-position counts always add up to the accepted total
    assert sum(c["vllm:spec_decode_num_accepted_tokens_per_pos"]) == c["vllm:spec_decode_num_accepted_tokens"]
