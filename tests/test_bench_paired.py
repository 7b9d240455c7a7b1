"""The paired GRPO benchmark's and the batch sweep's logic, on fake engine groups (no engine starts): every
variant generates every rollout call from the same arguments and takes every refit; ratios, intervals, the Amdahl
bound and the batch-size schedule come out of the figures as defined."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from benchmarks.grpo.paired import HeadFreeTiming, PairedGeneration, PairedSource
from benchmarks.grpo.paired_account import (
    builds_line,
    drafter_seconds,
    lengths_line,
    step_rows,
    step_s,
    summarise,
    trained_drafter,
)
from benchmarks.rollout.batch_sweep import DEFAULT_VARIANTS, best_k, parse_variants, schedule


class FakeGroup:
    """Records its calls; a call takes ``seconds`` (reported, not slept) and returns ``tokens`` per prompt."""

    def __init__(self, tokens: int):
        self.tokens, self.calls, self.refits = tokens, [], []
        self.engine_info = ["own"]

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        return SimpleNamespace(token_ids=[[1] * self.tokens for _ in prompts], spec_counters={})

    def update_weights_buckets(self, buckets):
        self.refits.append(buckets)


def test_every_variant_generates_the_same_call_and_takes_every_refit_and_the_trained_output_is_returned():
    base, spec = FakeGroup(3), FakeGroup(5)
    paired = PairedGeneration("none", base, {"spec": spec})
    rollout = SimpleNamespace(temperature=1.0, seed=7, logprobs=0)
    out = paired.generate([[1, 2], [3]], rollout)
    assert base.calls == spec.calls == [([[1, 2], [3]], rollout)]
    assert out.token_ids == [[1] * 3, [1] * 3]  # the trained group's samples are the ones trained on
    assert set(paired.calls[0]) == {"none", "spec"} and paired.calls[0]["spec"]["tokens"] == 10
    paired.update_weights_buckets(iter([("w", 1)]))  # a generator is read once, for every group
    assert base.refits == spec.refits == [[("w", 1)]]
    assert paired.others_refit_s > 0  # timed apart: the step's shared rest leaves it out
    paired.generate([[1]], SimpleNamespace(temperature=0.0))  # validation: the trained group alone, untimed
    assert len(spec.calls) == 1 and len(paired.calls) == 1
    assert paired.engine_info == ["own"]  # anything else is the trained group's


def test_the_order_rotates_by_call():
    order = []

    class Named(FakeGroup):
        def __init__(self, name):
            super().__init__(1)
            self.name = name

        def generate(self, prompts, sampling):
            order.append(self.name)
            return super().generate(prompts, sampling)

    paired = PairedGeneration("a", Named("a"), {"b": Named("b"), "c": Named("c")})
    for _ in range(3):
        paired.generate([[1]], SimpleNamespace(temperature=1.0, logprobs=0))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def _rec(base_s, var_s):
    return {"none": {"s": base_s, "tokens": 100, "counters": {}}, "spec": {"s": var_s, "tokens": 90, "counters": {}}}


def test_step_ratio_shares_the_rest_and_stays_under_amdahls_bound():
    # generation 10 s against 5 s, the rest of the step 30 s: the wall time holds both generations
    rows = {
        0: step_rows([_rec(10.0, 5.0)] * 2, [45.0] * 2, [0.0] * 2, "none"),
        1: step_rows([_rec(10.0, 4.0)], [44.0], [0.0], "none"),
    }
    assert rows[0][0]["shared_s"] == pytest.approx(30.0)
    (s,) = summarise(rows, ["none", "spec"])
    assert s["generation"] == pytest.approx(30 / 14)
    assert s["generation_per_seed"] == {0: pytest.approx(2.0), 1: pytest.approx(2.5)}
    assert s["step"] == pytest.approx(120 / 104)
    assert s["generation_share"] == pytest.approx(0.25)
    assert s["amdahl_bound"] == pytest.approx(1 / (0.75 + 0.25 / (30 / 14)))
    assert s["step"] <= s["amdahl_bound"] + 1e-9
    mean, lo, hi = s["generation_per_step"]
    assert lo < mean < hi and mean == pytest.approx(math.exp((2 * math.log(2) + math.log(2.5)) / 3))


def test_an_interval_over_equal_ratios_is_a_point_and_a_slower_variant_reads_below_one():
    rows = {0: step_rows([_rec(4.0, 5.0)] * 3, [39.0] * 3, [0.0] * 3, "none")}
    (s,) = summarise(rows, ["none", "spec"])
    mean, lo, hi = s["generation_per_step"]
    assert mean == pytest.approx(0.8) and lo == pytest.approx(0.8) and hi == pytest.approx(0.8)
    assert s["step"] < 1


def test_variants_parse_with_dict_overrides_and_a_bad_entry_is_named():
    v = parse_variants(DEFAULT_VARIANTS)
    assert [n for n, _, _ in v] == ["none", "ngram k=1", "ngram k=2", "ngram k=3"]
    assert v[2][2] == [
        "policy.generation.vllm_kwargs.speculative_config="
        "{method: ngram, num_speculative_tokens: 2, prompt_lookup_max: 4, prompt_lookup_min: 2}"
    ]
    with pytest.raises(ValueError, match="'configs/x.yaml': write name: config"):
        parse_variants("configs/x.yaml; b: configs/y.yaml")
    with pytest.raises(ValueError, match="a baseline and at least one more"):
        parse_variants("a: configs/x.yaml")


def test_the_schedule_takes_k_where_it_measured_faster_and_zero_elsewhere():
    def cell(s):
        return {"s": s, "tokens": 100, "counters": {}}

    names = ["none", "ngram k=1", "ngram k=3"]
    cells = {}
    for b, (t0, t1, t3) in {1: (10, 9, 7), 8: (10, 9.9, 10.5), 64: (10, 11, 14)}.items():
        cells.update({("none", b, 0): cell(t0), ("ngram k=1", b, 0): cell(t1), ("ngram k=3", b, 0): cell(t3)})
    ks = {b: best_k(cells, names, b, [0], 0.02) for b in (1, 8, 64)}
    assert ks == {1: 3, 8: 0, 64: 0}  # at 8, k=1 is 1.01x: under the 2% it must gain
    cells[("ngram k=3", 1, 1)], cells[("none", 1, 1)], cells[("ngram k=1", 1, 1)] = cell(11), cell(10), cell(10.5)
    assert best_k(cells, names, 1, [0, 1], 0.02) == 0  # k=3 1.18x pooled, k=1 1.03x: each slower on seed 1
    assert schedule(ks) == [[1, 7, 3], [8, 1024, 0]]
    assert schedule({1: 2, 4: 2, 16: 1}) == [[1, 15, 2], [16, 1024, 1]]


def test_any_drafter_named_with_its_k_enters_the_schedule_and_other_names_do_not():
    def cell(s):
        return {"s": s, "tokens": 100, "counters": {}}

    names = ["none", "head k=1", "head k=3", "head (the schedule)"]
    cells = {("none", 1, 0): cell(10), ("head k=1", 1, 0): cell(9), ("head k=3", 1, 0): cell(8)}
    cells[("head (the schedule)", 1, 0)] = cell(5)  # fastest, but not a fixed k: never a schedule's entry
    assert best_k(cells, names, 1, [0], 0.02) == 3


def test_the_report_gives_each_steps_rollout_lengths_per_seed():
    rows = {0: [{"lengths": [88.0, 384.0, 384.0]}, {"lengths": [66.0, 248.0, 384.0]}], 1: [{"lengths": [96, 384, 384]}]}
    line = lengths_line(rows)
    assert line.endswith("seed 0: 88/384/384, 66/248/384; seed 1: 96/384/384")


# ---- every variant charged its own drafter work --------------------------------------------------------
def _charged_row():
    # trained on "spec", whose drafter worked 4 s of the step: 50 s = none's 10 + spec's 5 + shared 31 + 4
    return step_rows([_rec(10.0, 5.0)], [50.0], [4.0], "spec")[0]


def _assert_baseline_pays_no_drafter_work(step_of) -> None:
    row = _charged_row()
    assert step_of(row, "none") == pytest.approx(10.0 + 31.0)  # its generation and the shared phases, no drafter
    assert step_of(row, "spec") == pytest.approx(5.0 + 31.0 + 4.0)


def test_the_baselines_step_holds_no_drafter_work():
    _assert_baseline_pays_no_drafter_work(step_s)


def test_negative_control_the_old_accounting_charges_the_drafter_to_the_baseline():
    def shared_rest(row, name):  # what the benchmark did before: the trained run's whole rest in every step
        return row["shared_s"] + trained_drafter(row) + row[name]["s"]

    with pytest.raises(AssertionError):
        _assert_baseline_pays_no_drafter_work(shared_rest)


def test_the_drafters_work_lowers_the_step_ratio_and_the_bound_counts_it():
    row = {**_charged_row(), "lengths": [20.0, 64.0, 64.0], "trained_parts": {"timing/train": 30.0}}  # as run_seed
    (s,) = summarise({0: [row]}, ["none", "spec"])
    assert s["generation"] == pytest.approx(2.0)
    assert s["step"] == pytest.approx(41 / 40)  # against (31 + 10) / (31 + 5) = 1.14x with the drafter shared
    assert s["step_drafter_shared"] == pytest.approx(45 / 40)
    assert s["amdahl_bound"] == pytest.approx(s["step"])  # the bound at this generation, the drafter paid
    assert s["ceiling"] == pytest.approx(41 / 35)  # generation free, the drafter still paid
    assert s["drafter_s_per_step"] == pytest.approx(4.0) and s["drafter_share"] == pytest.approx(4 / 41)


def test_the_heads_part_of_the_update_is_the_difference_on_the_same_batch_plus_its_optimizer():
    row = {
        "train/forward_backward_s": 10.0,
        "drafter/optimizer_s": 0.5,
        "timing/drafter_wait": 0.1,
        "timing/drafter_refit": 0.4,
    }
    assert drafter_seconds(row, 7.0) == pytest.approx(3.0 + 0.5 + 0.1 + 0.4)
    assert drafter_seconds(row, 12.0) == pytest.approx(0.5 + 0.1 + 0.4)  # noise never makes it negative
    assert drafter_seconds(row, None) == pytest.approx(0.5)  # no head: the wait and the refit only
    assert drafter_seconds({}, None) == 0.0  # no drafter work at all


def test_the_head_free_pass_runs_beside_the_update_on_its_batch_and_is_timed_apart():
    calls = []

    class Policy:
        def forward_backward_time(self, batch, loss_fn):
            calls.append(("apart", batch))
            return 7.0

        def train_step(self, batch, loss_fn):
            calls.append(("update", batch))
            return {"forward_backward_s": 10.0}

        def state_dict_buckets(self):
            return "buckets"

    timed = HeadFreeTiming(Policy())
    assert timed.train_step("b", None) == {"forward_backward_s": 10.0}
    # the first update: one warm-up pass, not kept apart from the timed one, then the timed pass before it
    assert calls == [("apart", "b"), ("apart", "b"), ("update", "b")], calls
    assert timed.forward_backward_s == 7.0 and timed.wall_s > 0
    timed.train_step("c", None)  # the next step's extra pass comes after its update: no side always runs cold
    assert calls[3:] == [("update", "c"), ("apart", "c")]
    assert timed.state_dict_buckets() == "buckets"


def test_other_variants_sample_without_the_trained_drafters_log_probs():
    from rl_specdec.rollout import SamplingSettings

    base, spec = FakeGroup(3), FakeGroup(5)
    PairedGeneration("spec", spec, {"none": base}).generate([[1]], SamplingSettings(max_tokens=4, logprobs=8))
    assert spec.calls[0][1].logprobs == 8 and base.calls[0][1].logprobs == 0


def test_first_use_builds_are_reported_once_with_unknowns_named():
    line = builds_line({"toy:wide-eagle3": 243.4, "toy:wide-policy": None}, "AMD EPYC 2c AVX-512")
    assert "toy:wide-eagle3 243 s" in line and "toy:wide-policy not recorded" in line and "AVX-512" in line


def test_a_pairs_models_share_the_one_build_that_made_them(tmp_path):
    import json

    from rl_specdec.toy.build import BUILT, built_seconds, built_where

    pair, alone, old = tmp_path / "pair", tmp_path / "alone", tmp_path / "old"
    for d in (pair / "policy", pair / "drafter", alone, old / "head"):
        d.mkdir(parents=True)
    (pair / BUILT).write_text(json.dumps({"what": "toy pair", "seconds": 190.1, "machine": "m"}))
    (old / "DONE").write_text("243s")
    assert built_where(pair / "policy") == built_where(pair / "drafter") == pair
    assert built_seconds(pair / "drafter") == 190.1 and built_seconds(old / "head") == 243.0
    assert built_where(alone) == alone and built_seconds(alone) is None  # no record: not a guess


def test_episodes_are_paired_at_the_source_every_variant_plays_the_same_request():
    """Episodes reach the engines over HTTP, so a variant's own source plays each step's request; the order rotates
    and the trained source's output is the one trained on, as for a group's call."""
    order = []

    class Source:
        def __init__(self, name, tokens):
            self.name, self.tokens, self.requests = name, tokens, []

        def generate(self, request):
            order.append(self.name)
            self.requests.append(request)
            return SimpleNamespace(token_ids=[[1] * self.tokens] * 2, spec_counters={"n": self.tokens})

        def held_out(self, n, sampling):
            return self.name

    base, spec, calls = Source("none", 3), Source("spec", 5), []
    paired = PairedSource("none", base, {"spec": spec}, calls)
    first, second = object(), object()
    out = paired.generate(first)
    paired.generate(second)
    assert base.requests == spec.requests == [first, second]
    assert out.token_ids == [[1] * 3] * 2 and order == ["none", "spec", "spec", "none"]
    assert [set(c) for c in calls] == [{"none", "spec"}] * 2 and calls[0]["spec"]["tokens"] == 10
    assert calls[0]["spec"]["counters"] == {"n": 5}
    assert paired.held_out(8, None) == "none"  # validation and the rest: the trained source's


def test_episodes_report_the_acceptance_length_of_each_turn():
    """A source's output of episodes: each call's record keeps each turn's counters, and the table gives each
    turn's acceptance length after the step's (a single-turn call has none, and no turns are shown)."""
    from benchmarks.grpo.paired import time_each
    from benchmarks.grpo.paired_account import table
    from rl_specdec.metrics.counters import ACCEPTED, DRAFT_TOKENS, DRAFTS
    from rl_specdec.rollout.serving.episodes import EpisodeOutput, EpisodeResult, Turn

    def c(drafts, accepted):
        return {DRAFTS: drafts, DRAFT_TOKENS: 3 * drafts, ACCEPTED: accepted}

    def episode(*turns):
        return EpisodeResult([1], [Turn(0, [1], [0.0], "stop", 0, None, t) for t in turns], [], 1.0, True, {}, 1.0)

    xs = [episode(c(4, 8), c(2, 1)), episode(c(4, 4))]
    outs = {"none": SimpleNamespace(token_ids=[[1]], spec_counters={}), "spec": EpisodeOutput.of(xs, 1.0, c(10, 13))}
    calls = []
    time_each(calls, ["none", "spec"], "none", lambda name: outs[name])
    assert calls[0]["spec"]["turn_counters"] == [c(8, 12), c(2, 1)] and calls[0]["none"]["turn_counters"] == []
    calls[0]["none"]["s"], calls[0]["spec"]["s"] = 2.0, 1.0  # as timed, without a clock's luck
    (s,) = summarise({0: step_rows(calls, [10.0], [0.0], "none")}, ["none", "spec"])
    assert s["acceptance_length"] == pytest.approx(2.3) and s["acceptance_per_turn"] == [2.5, 1.5]
    assert "| 2.30 (turns 2.50, 1.50) |" in table([s], "none")
