"""The never-drafted warning's logic on step metrics as the loop logs them (pure: no engine). The run itself is
in tests/test_grpo.py: a schedule that cannot draft warns there, the default run does not."""

from __future__ import annotations

from types import SimpleNamespace

from rl_specdec.drafter.watch import FIRST_STEPS, NeverDrafted
from rl_specdec.rollout.runtime_k.metrics import control_metrics

PAYS = "its online update every step"


def _step(drafts: float, fewest: float | None = 16.0, buckets=((1, 3, 2), (4, 1024, 0))) -> dict[str, float]:
    out = {"spec_decode/num_drafts": drafts, "spec_decode/num_draft_tokens": 2 * drafts}
    out.update({f"spec_decode/k_bucket_{lo}_{hi}": float(k) for lo, hi, k in buckets})
    if fewest is not None:
        out["spec_decode/fewest_running_requests"] = fewest
    return out


def _watch(steps, speculating=True, pays=PAYS):
    w = NeverDrafted(pays, trains=True)
    return [w.observe(s, speculating) for s in steps]


def test_a_schedule_the_batch_never_reaches_warns_once_with_the_cause_and_the_fix():
    split = [{**_step(0, 8, buckets=((1, 1, 2), (2, 3, 2), (4, 1024, 0)))}] * 3
    assert "only at 1-3 running requests" in _watch(split)[-1]  # adjacent buckets read as one range
    said = _watch([_step(0, 8), _step(0, 4), _step(0, 6), _step(0, 4)])
    assert said[: FIRST_STEPS - 1] == [None] * (FIRST_STEPS - 1) and said[FIRST_STEPS:] == [None]
    message = said[FIRST_STEPS - 1]
    assert "drafted nothing in the first 3 steps" in message and PAYS in message
    assert "only at 1-3 running requests" in message and "no engine step ran fewer than 4" in message
    assert "num_speculative_tokens_per_batch_size" in message and "drafter_training.enabled=false" in message


def test_a_run_that_drafts_in_its_first_steps_says_nothing_even_if_it_stops_later():
    assert _watch([_step(0), _step(5), _step(0), _step(0), _step(0)]) == [None] * 5


def test_a_drafter_that_costs_nothing_is_not_watched():
    assert _watch([_step(0)] * 4, pays=None) == [None] * 4


def test_the_cause_it_names_follows_what_the_metrics_show():
    canary = _watch([_step(0)] * 3, speculating=False)[-1]
    assert "acceptance canary turned speculation off" in canary
    zero = _watch([_step(0, 1, buckets=((1, 3, 0), (4, 1024, 0)))] * 3)[-1]
    assert "chose k=0 at every batch size" in zero
    unknown = _watch([{"spec_decode/num_drafts": 0.0}] * 3)[-1]
    assert "no run-time k report says why" in unknown
    # the batch did reach the drafting range, yet nothing drafted: not blamed on the schedule
    reached = _watch([_step(0, 2)] * 3)[-1]
    assert "no engine step ran fewer" not in reached and "did fall to 2 running requests" in reached
    assert "inside the schedule's drafting range (1-3)" in reached and "no engine step ran the drafter" in reached
    ran = _watch([{**_step(0, 2), "spec_decode/drafted_step_fraction": 0.25}] * 3)[-1]
    assert "up to 25% of a step's engine steps ran the drafter and it proposed no token" in ran


def test_what_it_pays_for_comes_from_the_config():
    def cfg(method, model, enabled, every=1):
        spec = SimpleNamespace(method=method, model=model)
        training = SimpleNamespace(enabled=enabled, every=every)
        return SimpleNamespace(
            policy=SimpleNamespace(generation=SimpleNamespace(speculation=spec, drafter_training=training))
        )

    assert NeverDrafted.for_run(cfg("ngram", None, False)).pays is None  # nothing built, nothing trained
    assert "online update every step" in NeverDrafted.for_run(cfg("eagle3", "/h", True)).pays
    assert "eagle3 drafter in every engine" in NeverDrafted.for_run(cfg("eagle3", "/h", False)).pays
    none = SimpleNamespace(policy=SimpleNamespace(generation=SimpleNamespace(speculation=None, drafter_training=None)))
    assert NeverDrafted.for_run(none).pays is None


def test_engine_reports_give_the_fewest_running_requests_and_the_drafted_share():
    reports = [
        {"buckets": [[1, 3, 2], [4, 1024, 0]], "steps": 10, "plain_steps": 6, "draft_steps": 4, "fewest_running": 3},
        {"buckets": [[1, 3, 2], [4, 1024, 0]], "steps": 10, "plain_steps": 10, "draft_steps": 0, "fewest_running": 5},
    ]
    m = control_metrics(reports)
    assert m["spec_decode/fewest_running_requests"] == 3.0
    assert m["spec_decode/drafted_step_fraction"] == 0.2


def test_a_frozen_drafter_is_not_told_to_stop_a_training_it_does_not_do():
    w = NeverDrafted("a draft_model drafter in every engine (built at first use)")
    message = [w.observe(_step(0), True) for _ in range(3)][-1]
    assert "drafter_training" not in message and "speculative_config (no drafter)" in message
