"""Run-time k on real engines: k set while the engine runs takes effect, and stays lossless.

Engines (module-scoped):

* ``eng_none``      no speculation: the greedy and temperature-1 references;
* ``eng_fixed``     draft_model, speculation_control ``fixed`` (k settable, k=0 fast path), k_max 3;
* ``eng_adaptive``  the same with the adaptive controller (k_max 4, exploring a lot);
* ``eng_async``     ``fixed`` on the async engine (engine core in another process);
* ``eng_threshold`` ``fixed`` with ``draft_below=8`` (a concurrency threshold, as the default config);
* ``eng_ngram``     ngram, ``fixed`` with a batch-size schedule (``NGRAM_SCHEDULED``), as the real model's
  shipped config runs it: k=0 steps take the fast path with nothing to catch up.

Every engine with run-time k passed the start-up self-check to get here.
Lossless is checked three ways while k changes between calls and within
them (a per-step cycle of k, in and out of the fast path): greedy tokens,
sampled log-probs against transformers, and the temperature-1 distribution.
"""

from __future__ import annotations

import pytest

from conftest import (
    DIST_PROMPT,
    DIST_SAMPLES,
    DIST_TOKENS,
    NGRAM,
    dist_samples,
    draft_spec,
    hf_token_logprobs,
    module_engine,
    position_test,
)
from engine_debug import (
    CYCLE,
    DebugAsyncVllmGeneration,
    DebugVllmGeneration,
    check_catch_up_is_exact,
    check_k_changing_is_lossless,
    debug,
)
from rl_specdec.errors import ConfigError
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.metrics.counters import DRAFT_TOKENS, DRAFTS
from rl_specdec.rollout import SamplingSettings

pytestmark = pytest.mark.integration

MAX_TOKENS = 40
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def eng_none(eng_plain):
    return eng_plain


@pytest.fixture(scope="module")
def eng_fixed(request, local_ray, toy):
    return module_engine(
        request, toy, draft_spec(toy.drafter), control={"mode": "fixed"}, group_cls=DebugVllmGeneration
    )


@pytest.fixture(scope="module")
def eng_adaptive(request, local_ray, toy):
    return module_engine(
        request, toy, draft_spec(toy.drafter), control={"mode": "adaptive", "k_max": 4, "explore": 0.3}
    )


@pytest.fixture(scope="module")
def eng_async(request, local_ray, toy):
    return module_engine(
        request, toy, draft_spec(toy.drafter), control={"mode": "fixed"}, group_cls=DebugAsyncVllmGeneration
    )


@pytest.fixture(scope="module")
def eng_threshold(request, local_ray, toy):
    return module_engine(
        request,
        toy,
        draft_spec(toy.drafter),
        control={"mode": "fixed", "draft_below": 8},
        group_cls=DebugVllmGeneration,
    )


# k=0 while more than 8 requests run, 1 at 5-8, 3 at 1-4: a call that starts above 8 and ends in its tail switches
# k within the call, per step, as the batch shrinks
NGRAM_SCHEDULED = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1], [9, 1024, 0]]}
SCHED_CALL = 8  # requests a call of the distribution test: k=1 at the start, k=3 once half of them are done


@pytest.fixture(scope="module")
def eng_ngram(request, local_ray, toy):
    return module_engine(request, toy, NGRAM_SCHEDULED, control={"mode": "fixed"})


@pytest.fixture(scope="module")
def none_greedy(eng_none, task_prompts):
    return eng_none.generate(task_prompts, GREEDY).token_ids


def drafts_per_draft(out) -> float:
    c = out.spec_counters
    return c.get(DRAFT_TOKENS, 0.0) / c[DRAFTS] if c.get(DRAFTS) else 0.0


# ---- k set at run time takes effect -------------------------------------------------------------


@pytest.mark.parametrize("name", ["eng_fixed", "eng_async"])
def test_a_k_set_at_run_time_takes_effect(request, name, task_prompts):
    """Per-request counters: every draft of the call has exactly the k that was set; k=0 drafts nothing, all
    steps plain."""
    g = request.getfixturevalue(name)
    sampling = SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=4)
    try:
        for k in (3, 1, 0, 2):
            g.set_speculation(k)
            out = g.generate(task_prompts * 2, sampling)
            if k == 0:
                assert out.spec_counters.get(DRAFT_TOKENS, 0.0) == 0.0, out.spec_counters
                (report,) = out.spec_control
                assert report["plain_steps"] == report["steps"] > 0, report
            else:
                assert out.spec_counters[DRAFTS] > 0
                assert drafts_per_draft(out) == k, (k, out.spec_counters)
                assert out.spec_control[0]["buckets"][0][2] == k
    finally:
        g.set_speculation(3)


@pytest.mark.parametrize("name", ["eng_fixed", "eng_async"])
def test_k_changes_within_one_call(request, name, task_prompts):
    """k=1, then k=3 after six engine steps, inside one generate call: the call's drafts mix both."""
    g = request.getfixturevalue(name)
    try:
        g.set_speculation(1)
        debug(g, plan=[(6, 3)])
        out = g.generate(task_prompts * 2, SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=5))
        assert 1.0 < drafts_per_draft(out) < 3.0, out.spec_counters
    finally:
        debug(g, plan=[])
        g.set_speculation(3)


def test_a_concurrency_threshold_drafts_only_below_it(eng_threshold, task_prompts, none_greedy):
    """draft_below=8, read back from the engine: with k=3, then k=2 set at run time, every step with 8 or more
    requests is plain (the fast path) and drafts nothing, every step with fewer drafts k; greedy output equals
    no speculation's."""
    g = eng_threshold
    assert g.settings["speculation_control/draft_below"] == 8, g.settings
    debug(g, record_steps=True)
    try:
        for k in (3, 2):
            g.set_speculation(k)
            out = g.generate(task_prompts, GREEDY)  # 16 prompts of different answer lengths: a tail below 8
            # [requests scheduled, drafts made for the next step, plain]; a step is recorded when the next one
            # starts, so the first record is the previous call's last step
            steps = debug(g)["steps"][1:]
            assert out.token_ids == none_greedy
            wide, narrow = [s for s in steps if s[0] >= 8], [s for s in steps if 0 < s[0] < 8]
            assert wide and narrow, steps
            assert all(plain and k_next == 0 for _, k_next, plain in wide), wide
            assert all(k_next == k for _, k_next, _ in narrow), narrow
            assert drafts_per_draft(out) == k, (out.spec_counters, steps)
            (report,) = out.spec_control
            assert [kb for _, _, kb in report["buckets"]] == [k if lo < 8 else 0 for lo, _, _ in report["buckets"]]
    finally:
        g.set_speculation(3)


def test_speculation_control_needs_run_time_k(eng_none):
    with pytest.raises(RuntimeError, match="speculation_control.mode to fixed or adaptive"):
        eng_none.set_speculation(0)


# ---- lossless while k changes ------------------------------------------------------------------


def test_greedy_with_k_cycling_every_step_equals_no_speculation(eng_fixed, task_prompts, none_greedy):
    stats0 = debug(eng_fixed, cycle=CYCLE)["stats"]
    try:
        out = eng_fixed.generate(task_prompts * 4, GREEDY)
    finally:
        stats1 = debug(eng_fixed, cycle=None)["stats"]
    assert out.token_ids == none_greedy * 4
    assert stats1["plain_steps"] > stats0["plain_steps"] and stats1["catch_up_tokens"] > stats0["catch_up_tokens"]


def test_temperature_one_with_k_changing_between_and_within_calls(eng_fixed, plain_samples, tokenizer, hf_policy):
    check_k_changing_is_lossless(eng_fixed, plain_samples, tokenizer.encode(DIST_PROMPT), hf_policy)


# ---- the drafter catch-up -----------------------------------------------------------------------


def test_catch_up_restores_the_drafter(eng_fixed, tokenizer):
    """After 8 plain steps the caught-up drafter proposes what a drafter that ran every step proposes.

    The first draft of a verify step is the drafter's argmax given the true prefix. Negative control:
    without the catch-up the drafter's KV has holes and its first drafts differ.
    """
    from rl_specdec.tasks.sorting import SortingTask

    prompts = [tokenizer.encode(s.prompt) for s in SortingTask(min_len=14, max_len=24).make_batch(seed=7, n=32)]
    check_catch_up_is_exact(eng_fixed, prompts, min_compared=50, control_below=0.95)


def test_the_self_check_fails_loudly_without_catch_up(eng_fixed):
    """The start-up self-check passes on this vLLM, and fails (naming the fallback switch) when the catch-up is
    broken."""
    eng_fixed.check_spec_control()
    debug(eng_fixed, catch_up=False)
    try:
        with pytest.raises(ConfigError, match="k0_fast_path=false") as e:
            eng_fixed.check_spec_control()
        assert "first drafts agree" in str(e.value)
    finally:
        debug(eng_fixed, catch_up=True)
        eng_fixed.set_speculation(3)


# ---- the adaptive controller --------------------------------------------------------------------


def test_adaptive_controller_decides_and_stays_lossless(
    eng_adaptive, task_prompts, none_greedy, plain_samples, tokenizer
):
    reports = []
    for _ in range(6):
        out = eng_adaptive.generate(task_prompts * 8, GREEDY)
        assert out.token_ids == none_greedy * 8
        reports += out.spec_control
    last = reports[-1]
    assert last["mode"] == "adaptive" and last["ready"], last
    assert len(last["buckets"]) == 7 and all(0 <= k <= 4 for _, _, k in last["buckets"])
    assert last["predicted_tokens_per_s"] > 0 and last["realised_tokens_per_s"] > 0
    assert sum(r["explore_steps"] for r in reports) > 0
    p, per_pos = position_test(plain_samples, dist_samples(eng_adaptive, tokenizer, seed=2500))
    assert p > 1e-3, f"the controller's k changes what is sampled (adjusted p={p:.2e}; per position {per_pos})"


def test_the_canary_disable_path_makes_the_next_call_draft_nothing(eng_adaptive, task_prompts):
    from pathlib import Path
    from types import SimpleNamespace

    from rl_specdec.config import load_config
    from rl_specdec.drafter.upkeep import DrafterUpkeep
    from rl_specdec.grpo.recovery import CANARY, EngineRecovery
    from rl_specdec.grpo.saves import last_checkpoint

    root = Path(__file__).resolve().parents[1]
    overrides = [
        "policy.generation.acceptance_canary.action=disable",
        "policy.generation.speculation_control.mode=adaptive",
    ]
    cfg = load_config(root / "configs/grpo_spec.yaml", overrides)
    upkeep = DrafterUpkeep(cfg)
    # the canary raises; the run's fault handler turns speculation off (k=0 here: no restart, so no policy)
    faults = EngineRecovery(SimpleNamespace(cfg=cfg, generation=eng_adaptive), last_checkpoint)

    def check(metrics):
        return faults.guarded(CANARY, lambda: upkeep.check(metrics))

    sampling = SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=6)
    # The controller drafts only where a measured k>0 pays, so a given call may draft nothing: the engine's
    # lifetime counters (its warm-up and the calls above) show that it drafts, at a healthy acceptance.
    lifetime = eng_adaptive.engine_counters()[0]
    assert lifetime.get(DRAFT_TOKENS, 0.0) > 0, lifetime
    healthy = compute_spec_decode_metrics(None, lifetime)
    for _ in range(3):
        assert check(healthy) == {"spec_decode/canary": 0.0}
    drafted = healthy["spec_decode/num_draft_tokens"]  # the canary judges accepted / drafted tokens
    collapsed = {**healthy, "spec_decode/acceptance_rate": 0.01, "spec_decode/num_accepted_tokens": 0.01 * drafted}
    assert check(collapsed) == {"spec_decode/canary": 1.0}
    out = eng_adaptive.generate(task_prompts * 4, sampling)
    assert out.spec_counters.get(DRAFT_TOKENS, 0.0) == 0.0, out.spec_counters
    (report,) = out.spec_control
    assert report["plain_steps"] == report["steps"] > 0 and report["explore_steps"] == 0
    assert [k for _, _, k in report["buckets"]] == [0] * 7


# ---- ngram: a batch-size schedule run by run-time k ---------------------------------------------------------------


def test_ngram_schedule_runs_plain_steps_above_it_drafts_below_and_changes_no_greedy_token(
    eng_ngram, task_prompts, none_greedy
):
    """16 requests start above the schedule's k>0 ranges: their first steps run plain (the fast path), and the
    steps after half of them finished draft; the engine reports what it ran, and greedy tokens are no speculation's."""
    out = eng_ngram.generate(task_prompts, GREEDY)
    (report,) = out.spec_control
    assert report["mode"] == "fixed"
    assert 0 < report["plain_steps"] < report["steps"], report
    assert out.spec_counters[DRAFTS] > 0
    assert out.token_ids == none_greedy


def test_ngram_schedule_sampled_logprobs_are_the_policys(eng_ngram, task_prompts, hf_policy):
    out = eng_ngram.generate(task_prompts, SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=11))
    assert out.spec_counters[DRAFTS] > 0
    worst = max(
        max(abs(a - b) for a, b in zip(lps, hf_token_logprobs(hf_policy, p, ids)))
        for p, ids, lps in zip(task_prompts, out.token_ids, out.logprobs)
    )
    assert worst < 1e-4, f"max |logprob - HF| = {worst:.2e}"


def test_ngram_schedule_keeps_the_temperature_one_distribution(eng_ngram, plain_samples, tokenizer):
    """k switched per step by batch size (1 while 5-8 requests run, 3 in each call's tail); the calls are small so
    that every one of them drafts and switches."""
    prompts, spec, drafts = [tokenizer.encode(DIST_PROMPT)] * SCHED_CALL, [], 0
    for i in range(DIST_SAMPLES // SCHED_CALL):
        sampling = SamplingSettings(max_tokens=DIST_TOKENS, temperature=1.0, seed=3000 + i * SCHED_CALL)
        out = eng_ngram.generate(prompts, sampling)
        spec += out.token_ids
        drafts += out.spec_counters.get(DRAFTS, 0)
    assert drafts > DIST_SAMPLES, f"only {drafts} drafts: the schedule's k>0 steps did not run"
    p, per_pos = position_test(plain_samples, spec)
    assert p > 1e-3, f"ngram with a k schedule: distribution differs from plain (adjusted p={p:.2e}; {per_pos})"
