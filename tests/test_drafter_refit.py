"""Drafter refit, weight integrity and the acceptance canary, on real engines.

Engines (module-scoped):

* ``eng_none``  no speculation: the reference samples of the distribution test;
* ``eng_draft`` draft_model with the toy drafter, k=3: gets refit here;
* ``eng_w``     draft_model started with a *different* drafter W (the toy
  drafter perturbed and saved to disk): what ``eng_draft`` must equal after
  a drafter refit with W.

Greedy decoding is deterministic, drafting included, so after a refit with W
the spec-decode counters of a fixed greedy batch must equal those of the
engine that started with W, exactly.
"""

from __future__ import annotations

import pytest
import torch

from conftest import dist_samples, draft_spec, hf_greedy, position_test, start_engine
from rl_specdec.drafter.canary import AcceptanceCanary
from rl_specdec.errors import WeightIntegrityError
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.rollout import SamplingSettings

pytestmark = pytest.mark.integration

MAX_TOKENS = 40
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0)


def _drafter_state(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {
        k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items()
    }


def _perturbed(sd: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        k: (v + torch.randn(v.shape, generator=g) * v.std() * scale) if v.numel() > 1 else v.clone()
        for k, v in sd.items()
    }
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied, as in the toy
    return out


@pytest.fixture(scope="module")
def drafter_w(toy, tmp_path_factory):
    """W: the toy drafter perturbed (acceptance drops, but not to zero), saved as a model folder."""
    from transformers import AutoModelForCausalLM

    from rl_specdec.toy.build import build_tokenizer

    w = _perturbed(_drafter_state(toy.drafter), scale=0.5, seed=1)
    model = AutoModelForCausalLM.from_pretrained(toy.drafter, dtype=torch.float32)
    model.load_state_dict(w)
    path = tmp_path_factory.mktemp("drafter_w")
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path, w


@pytest.fixture(scope="module")
def eng_none(eng_plain):
    return eng_plain


@pytest.fixture(scope="module")
def eng_draft(request, local_ray, toy):
    g = start_engine(toy.policy, draft_spec(toy.drafter))
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def eng_w(request, local_ray, toy, drafter_w):
    g = start_engine(toy.policy, draft_spec(drafter_w[0]))
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def hf_reference(hf_policy, task_prompts):
    return hf_greedy(hf_policy, task_prompts, MAX_TOKENS)


def _greedy(g, prompts):
    out = g.generate(prompts, GREEDY)
    return out.token_ids, out.spec_counters


def test_drafter_refit_is_lossless_and_equals_a_fresh_engine_with_those_weights(
    eng_draft, eng_w, drafter_w, task_prompts, hf_reference, toy
):
    tokens0, counters0 = _greedy(eng_draft, task_prompts)
    tokens_w, counters_w = _greedy(eng_w, task_prompts)
    assert tokens0 == tokens_w == hf_reference
    assert counters_w != counters0, "W must change acceptance, or the comparison below proves nothing"
    eng_draft.update_weights(drafter_w[1], target="drafter")
    tokens1, counters1 = _greedy(eng_draft, task_prompts)
    assert tokens1 == hf_reference, "a drafter refit changed what the policy generates"
    assert counters1 == counters_w, "after a refit with W the engine must draft exactly as one started with W"
    eng_draft.update_weights(_drafter_state(toy.drafter), target="drafter")  # back to the toy drafter
    assert _greedy(eng_draft, task_prompts)[1] == counters0


def test_temperature_one_distribution_after_a_drafter_refit(eng_draft, plain_samples, drafter_w, tokenizer, toy):
    plain = plain_samples
    eng_draft.update_weights(drafter_w[1], target="drafter")
    try:
        p, per_pos = position_test(plain, dist_samples(eng_draft, tokenizer, seed=2000))
    finally:
        eng_draft.update_weights(_drafter_state(toy.drafter), target="drafter")
    assert p > 1e-3, f"after a drafter refit the token distribution differs from no speculation (p={p:.2e}; {per_pos})"


@pytest.mark.parametrize("target", ["policy", "drafter"])
def test_a_wrong_name_or_shape_is_refused_and_nothing_is_loaded(
    eng_draft, hf_policy, task_prompts, hf_reference, toy, target
):
    good = dict(hf_policy.state_dict()) if target == "policy" else _drafter_state(toy.drafter)
    _, counters0 = _greedy(eng_draft, task_prompts)
    renamed = {
        ("model.layers.0.mlp.gate_prj.weight" if k == "model.layers.0.mlp.gate_proj.weight" else k): torch.zeros_like(v)
        for k, v in good.items()
    }
    with pytest.raises(
        WeightIntegrityError,
        match=r"engine 0 refused the .* 'model\.layers\.0\.mlp\.gate_prj\.weight' is not a parameter"
        r".*did you mean 'model\.layers\.0\.mlp\.gate_proj\.weight'",
    ):
        eng_draft.update_weights(renamed, target=target)
    reshaped = {k: (v[:-1] if k == "model.norm.weight" else torch.zeros_like(v)) for k, v in good.items()}
    with pytest.raises(WeightIntegrityError, match=r"'model\.norm\.weight' has shape"):
        eng_draft.update_weights(reshaped, target=target)
    # the zeroed tensors of both refused refits were never loaded
    assert _greedy(eng_draft, task_prompts) == (hf_reference, counters0)


def test_a_drafter_refit_to_an_engine_without_a_drafter_is_refused(eng_none, toy):
    with pytest.raises(WeightIntegrityError, match="no drafter model"):
        eng_none.update_weights(_drafter_state(toy.drafter), target="drafter")


def test_refitting_random_drafter_weights_trips_the_canary(eng_draft, toy, tokenizer, task_prompts):
    canary = AcceptanceCanary(min_ratio=0.5, window=20, min_history=3)

    def step(seed):
        out = eng_draft.generate(task_prompts * 4, SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed))
        rate = compute_spec_decode_metrics(None, out.spec_counters)["spec_decode/acceptance_rate"]
        return rate, canary.observe(rate)

    healthy = [step(s) for s in range(4)]
    assert not any(tripped for _, tripped in healthy), healthy
    random_drafter = {k: torch.randn_like(v) * v.std() for k, v in _drafter_state(toy.drafter).items()}
    eng_draft.update_weights(random_drafter, target="drafter")
    try:
        rate, tripped = step(10)
    finally:
        eng_draft.update_weights(_drafter_state(toy.drafter), target="drafter")
    assert tripped, f"acceptance {rate:.3f} after a random drafter did not trip the canary (healthy {healthy})"
    assert "Likely causes" in canary.message(rate)
    assert not step(11)[1], "the restored drafter still trips the canary"


def test_the_canary_judges_a_rate_over_enough_drafts():
    """A step of the controller's that drafted 2 tokens, both rejected, is no collapse: it is pooled with the
    next step. The negative control, judging every step however few its drafts, trips on it."""
    for min_drafts, trips_on_two in ((32, False), (1, True)):
        canary = AcceptanceCanary(min_ratio=0.5, window=20, min_history=3, min_drafts=min_drafts)
        for _ in range(3):
            assert canary.observe_counts(31.0, 36.0) == (31 / 36, False)
        two = canary.observe_counts(0.0, 2.0)
        assert (two is not None and two[1]) is trips_on_two, (min_drafts, two)
    canary = AcceptanceCanary(min_ratio=0.5, window=20, min_history=3)
    for _ in range(3):
        canary.observe_counts(31.0, 36.0)
    assert canary.observe_counts(0.0, 2.0) is None  # not judged yet
    rate, tripped = canary.observe_counts(36.0, 40.0)
    assert rate == 36 / 42 and not tripped  # the 2 rejected drafts are in the pooled rate
    assert canary.observe_counts(2.0, 40.0) == (2 / 40, True)  # a real collapse still trips


def test_a_streamed_refit_in_small_buckets_is_lossless_and_verified(
    eng_draft, eng_none, hf_policy, task_prompts, hf_reference, tokenizer
):
    """The loop's refit path: policy weights W streamed in buckets smaller than a layer. Greedy tokens
    equal transformers' on W; a wrong shape in a late bucket is named; streamed back to the real
    weights, greedy and the temperature-1 distribution are the policy's again."""
    import copy

    from rl_specdec.policy.state import bucketed

    good = {k: v.clone() for k, v in hf_policy.state_dict().items()}
    w = _perturbed(good, scale=0.3, seed=3)
    model_w = copy.deepcopy(hf_policy)
    model_w.load_state_dict(w)
    want = hf_greedy(model_w, task_prompts, MAX_TOKENS)
    assert want != hf_reference, "W must change greedy outputs, or the comparison proves nothing"

    def pieces(sd):
        return list(bucketed([([k], v) for k, v in sd.items()], 16 * 1024))

    assert len(pieces(w)) > 5
    eng_draft.update_weights_buckets(pieces(w))
    try:
        assert _greedy(eng_draft, task_prompts)[0] == want
        bad = pieces(w)
        i = next(i for i, b in enumerate(bad) if "model.norm.weight" in b)
        assert i > 2, "the bad tensor must come after buckets that load"
        bad[i] = {k: (v[:-1] if k == "model.norm.weight" else v) for k, v in bad[i].items()}
        with pytest.raises(
            WeightIntegrityError,
            match=r"engine 0 refused the policy refit \(the buckets before .* 'model\.norm\.weight' has shape",
        ):
            eng_draft.update_weights_buckets(bad)
    finally:
        eng_draft.update_weights_buckets(pieces(good))
    assert _greedy(eng_draft, task_prompts)[0] == hf_reference
    p, per_pos = position_test(
        dist_samples(eng_none, tokenizer, seed=1000), dist_samples(eng_draft, tokenizer, seed=3000)
    )
    assert p > 1e-3, f"after a streamed refit the token distribution differs from no speculation (p={p:.2e}; {per_pos})"
