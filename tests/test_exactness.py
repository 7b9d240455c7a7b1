"""Speculation is invisible to learning: every sampled token's engine log-prob equals the trainer's, within fp32.

One toy engine with draft_model speculation, run-time k and prefix caching. The control is the same engine
at k=0 on every step (the fast path runs vLLM's own no-speculation code). Then k changes on almost every
engine step: random k, k=0 stretches followed by drafting with the drafter catch-up, prompts repeated as
GRPO repeats them (prefix-cache hits on blocks written in plain steps). Every sampled token's log-prob is
scored again as the trainer scores it (benchmarks/exactness/exactness_check.py), and the worst difference must stay
within a bound derived from the dtype and from the control (``exactness_check.bound``), not a constant.
benchmarks/exactness/exactness.py runs the same check at length, on the toy and wide pairs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.exactness import exactness_check as ec
from benchmarks.exactness import exactness_engine
from benchmarks.step_records import importable
from conftest import draft_spec, start_engine
from rl_specdec.rollout import SamplingSettings

PROMPTS, REPEAT, MICRO_BATCH = 32, 8, 64  # 256 requests a call, the trainer's micro-batch of the default run
STRETCHES = [0] * 8 + [3] * 3 + [0] * 5 + [1, 2, 3, 2] + [0] * 12 + [2] * 4 + [3, 0, 1, 0, 3, 3]


def test_token_contexts_place_every_token_in_its_step():
    """Two requests (vLLM numbers them: "7-ab" is the first, "12-cd" the second): a prefill, a plain step, a verify step
    that accepted one of two drafts after a catch-up, and a step past the end of request 0."""
    steps = [
        {"k_next": 0, "k_verify": 0, "plain": True, "reqs": {"12-cd": [0, 3, 0, 1, 0], "7-ab": [0, 2, 0, 1, 0]}},
        {"k_next": 2, "k_verify": 0, "plain": False, "reqs": {"12-cd": [3, 1, 0, 1, 4], "7-ab": [2, 1, 0, 1, 3]}},
        {"k_next": 2, "k_verify": 2, "plain": False, "reqs": {"12-cd": [4, 3, 2, 2, 0], "7-ab": [3, 3, 2, 3, 0]}},
    ]
    ctx = ec.token_contexts(steps, [4, 4])
    assert [[c["position"] for c in x] for x in ctx] == [[2, 3, 4, 5], [3, 4, 5, 6]]
    assert [c["step"] for c in ctx[1]] == [0, 1, 2, 2]
    assert [ec.kind(c) for c in ctx[1]] == ["plain step", "step with no drafts"] + ["drafts after a catch-up"] * 2
    assert ctx[1][2]["accepted_draft"] and not ctx[1][3]["accepted_draft"] and ctx[1][3]["k_history"] == [0, 2, 2]


def test_bound_follows_the_control_and_the_dtype():
    assert ec.bound(1e-5, 10.0) == pytest.approx(1e-4)
    assert ec.bound(0.0, 10.0) == pytest.approx(16 * torch.finfo(torch.float32).eps * 10)
    assert ec.bound(0.0, 10.0, torch.bfloat16) > 100 * ec.bound(0.0, 10.0)


def test_a_saved_run_resumes_with_its_settings_and_every_token(tmp_path):
    """Save after a call, resume from the files: the settings are the file's, the counters and every token's
    difference are kept, and calls added after the resume land in the same tally (nothing lost, nothing twice)."""
    import argparse

    from benchmarks.exactness.exactness_run import Run

    def call(tally, c, diffs):
        engine = [[-1.0 - d for d in diffs]]
        tally.add(c, [[1, 2]], [list(range(len(diffs)))], engine, [[-1.0] * len(diffs)])

    shares = {"none": 0.25, "random": 0.75}
    args = argparse.Namespace(
        pair="toy",
        drafter="draft_model",
        seed=3,
        modes=["none", "random"],
        set=[],
        perturb_target=0.0,
        tokens=400,
        out=str(tmp_path),
    )
    run = Run.new(args, shares, "here")
    call(run.tallies["random"], 0, [1e-6, 4e-6, 2e-6])
    run.info["random"].update(tokens=3, calls=1, generate_s=2.0)
    run.save()
    other = argparse.Namespace(**{**vars(args), "pair": "wide", "seed": 0, "modes": ["none"], "tokens": 800})
    again = Run.resume(run.path, other, shares, "there")
    assert (other.pair, other.seed, other.modes) == ("toy", 3, ["none", "random"])  # the file's, not the line's
    assert again.budget("random", other) == 600 and again.info["random"]["calls"] == 1
    call(again.tallies["random"], 1, [9e-6])
    again.info["random"].update(tokens=4, calls=2)
    r = again.save()["modes"]["random"]
    assert r["tokens"] == 4 and r["max"] == pytest.approx(9e-6) and r["calls"] == 2
    assert [w["call"] for w in r["worst"][:2]] == [1, 0] and "none" not in again.results["modes"]
    assert np.load(again.path.with_suffix(".npz"))["random/diffs"].size == 4
    assert "resumed on there" in again.results["machine"] and len(again.results["invocations"]) == 2


@pytest.fixture(scope="module")
def exactness_ray():
    import ray

    from shared_ray import ensure_local_ray

    ray.shutdown()
    importable()  # the engines load exactness_engine's extension by name
    ensure_local_ray()


def _engine(request, policy, spec):
    g = start_engine(
        policy, spec, control={"mode": "fixed"}, group_cls=exactness_engine.engine_group(), enable_prefix_caching=True
    )
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def engine(request, exactness_ray, toy):
    return _engine(request, toy.policy, draft_spec(toy.drafter))


@pytest.fixture(scope="module")
def head_engine(request, exactness_ray, toy, toy_head):
    return _engine(request, toy.policy, {"method": "eagle3", "model": str(toy_head), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def prompts(task_prompts):
    return [p for p in task_prompts[:PROMPTS] * 2 for _ in range(REPEAT // 2)]


@pytest.fixture(scope="module")
def control(engine, prompts, tokenizer, hf_policy) -> dict:
    """The engine at k=0 on every step: the fast path runs vLLM's own code without speculation."""
    out, _ = _run(engine, prompts, [0], seed=1)
    tally = ec.Tally()
    tally.add(0, prompts, out.token_ids, out.logprobs, _score(hf_policy, prompts, out, tokenizer))
    return tally.report()


def _run(engine, prompts, schedule, seed: int):
    """One call with ``schedule`` (k per engine step); returns (output, engine steps)."""
    engine.engine_rpc("rl_specdec_exactness", schedule=schedule, take=True)
    try:
        out = engine.generate(prompts, SamplingSettings(max_tokens=40, temperature=1.0, seed=seed))
    finally:
        steps = engine.engine_rpc("rl_specdec_exactness", schedule=None, take=True)[0]["steps"]
    return out, steps


def _score(model, prompts, out, tokenizer):
    return ec.recompute(model, prompts, out.token_ids, MICRO_BATCH, tokenizer.pad_token_id)


def _changing_k(engine, prompts, tokenizer, hf_policy, seed: int, before_call=lambda call: None):
    """A call of k=0 stretches followed by drafting, then one of a random k per engine step; returns the
    tally's report, the last call's output and what the calls covered."""
    spec, steps_seen, switches, catch_up = ec.Tally(), 0, 0, 0
    rng = np.random.default_rng(0)
    for call, schedule in enumerate([STRETCHES, rng.integers(0, 4, 97).tolist()]):
        before_call(call)
        out, steps = _run(engine, prompts, schedule, seed=seed + call)
        ctx = ec.token_contexts(steps, [len(t) for t in out.token_ids])
        spec.add(call, prompts, out.token_ids, out.logprobs, _score(hf_policy, prompts, out, tokenizer), ctx)
        # the recorded steps account for every sampled token, each at its place in the sequence
        assert [[c["position"] for c in x] for x in ctx] == [
            list(range(len(p), len(p) + len(t))) for p, t in zip(prompts, out.token_ids)
        ]
        ks = [s["k_next"] for s in steps]
        steps_seen += len(steps)
        switches += sum(a != b for a, b in zip(ks, ks[1:]))
        catch_up += sum(r[4] for s in steps for r in s["reqs"].values())
    # the run covered what it claims: many k switches
    assert switches > steps_seen // 4, (switches, steps_seen)
    return spec.report(), out, catch_up


@pytest.mark.integration
def test_sampled_logprobs_are_the_trainers_while_k_changes(engine, control, prompts, tokenizer, hf_policy):
    s, out, catch_up = _changing_k(engine, prompts, tokenizer, hf_policy, seed=100)
    c = control
    limit = ec.bound(c["max"], max(c["logprob_scale"], s["logprob_scale"]))
    assert catch_up > 0
    assert {"plain step", "accepted draft", "drafts after a catch-up"} <= set(s["max_by_kind"]), s["max_by_kind"]
    assert s["tokens"] > 3000 and c["tokens"] > 1500, (s["tokens"], c["tokens"])
    assert s["max"] <= limit, f"max |engine - trainer| {s['max']:.2e} > {limit:.2e}; worst: {s['worst'][:2]}"
    # the check can fail: the same tokens scored by a target off by 1% of its weights' std in one matrix
    perturbed = _perturbed_copy(hf_policy)
    bad = ec.Tally()
    bad.add(0, prompts, out.token_ids, out.logprobs, _score(perturbed, prompts, out, tokenizer))
    assert bad.report()["max"] > limit, (bad.report()["max"], limit)


@pytest.mark.integration
def test_with_a_head_sampled_logprobs_are_the_trainers_while_k_changes_and_after_a_refit(
    head_engine, control, prompts, tokenizer, hf_policy
):
    """The same with an EAGLE-3 head: its k=0 steps are plain steps with a catch-up, and before the second call a
    refit puts a perturbed head in (what online head training does): the head only proposes."""
    from benchmarks.exactness import exactness

    def refit(call: int) -> None:
        if call == 1:
            spec = head_engine.config.vllm_kwargs["speculative_config"]
            noisy = exactness.perturbed(spec["model"], 0.05, seed=3, method="eagle3")
            head_engine.update_weights(noisy, target="drafter")

    s, _, _ = _changing_k(head_engine, prompts, tokenizer, hf_policy, seed=200, before_call=refit)
    c = control
    limit = ec.bound(c["max"], max(c["logprob_scale"], s["logprob_scale"]))
    assert {"step with no drafts", "accepted draft", "verify step's own sample"} <= set(s["max_by_kind"])
    assert s["tokens"] > 3000, s["tokens"]
    assert s["max"] <= limit, f"max |engine - trainer| {s['max']:.2e} > {limit:.2e}; worst: {s['worst'][:2]}"


def _perturbed_copy(model):
    import copy

    m = copy.deepcopy(model)
    w = m.model.layers[-1].mlp.down_proj.weight
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w += torch.randn(w.shape, generator=g) * w.std() * 1e-2
    return m
