"""EAGLE-3 heads on vLLM's CPU backend: lossless, and a head refit never touches the policy.

Three engines on the toy policy, started once for the module: ``eng_none`` (no
speculation), ``eng_head`` (``method: eagle3`` with the toy's head, built here,
k=3, run-time k on) and ``eng_dv`` (that head with its own draft vocabulary).
The head reads the policy's hidden states and shares its embedding (and, without
a draft vocabulary, its LM head) inside the engine, so the refit tests check both
that a new head changes drafting and that the policy's log-probs do not move. With
run-time k a head's k=0 steps are plain steps (the head does not run); they keep
the policy's hidden states, from which the head is caught up before it next
drafts, so drafting resumes after a stretch at k=0 with the drafts it would have
made.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DIST_PROMPT, DIST_TOKENS, dist_samples, hf_greedy, hf_token_logprobs, module_engine, position_test
from engine_debug import (
    CYCLE,
    DebugVllmGeneration,
    check_catch_up_is_exact,
    check_k_changing_is_lossless,
    debug,
    perturbed_head,
)
from rl_specdec.errors import WeightIntegrityError
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.rollout import SamplingSettings

pytestmark = pytest.mark.integration

MAX_TOKENS = 40
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def head(toy_head):
    return toy_head


@pytest.fixture(scope="module")
def eng_none(eng_plain):
    return eng_plain


@pytest.fixture(scope="module")
def eng_head(request, local_ray, toy, head):
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    return module_engine(request, toy, spec, control={"mode": "fixed"}, group_cls=DebugVllmGeneration)


@pytest.fixture(scope="module")
def hf_reference(hf_policy, task_prompts):
    return hf_greedy(hf_policy, task_prompts, MAX_TOKENS)


def drafted(g, prompts, sampling):
    out = g.generate(prompts, sampling)
    return out, compute_spec_decode_metrics(None, out.spec_counters)


def worst_logprob_error(g, prompts, hf_policy, seed: int) -> float:
    out = g.generate(prompts, SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, logprobs=0))
    worst = 0.0
    for p, ids, lps in zip(prompts, out.token_ids, out.logprobs):
        assert len(ids) == len(lps) > 0
        worst = max(worst, float(np.max(np.abs(np.array(lps) - np.array(hf_token_logprobs(hf_policy, p, ids))))))
    return worst


def test_head_drafts_and_greedy_equals_transformers(eng_head, task_prompts, hf_reference):
    out, m = drafted(eng_head, task_prompts, GREEDY)
    assert out.token_ids == hf_reference
    assert m["spec_decode/num_draft_tokens"] > 100
    assert m["spec_decode/acceptance_length"] > 2.0, m  # the head was trained on this policy: most drafts land


def test_sampled_logprobs_with_a_head_match_transformers(eng_head, task_prompts, hf_policy):
    assert worst_logprob_error(eng_head, task_prompts, hf_policy, seed=11) < 1e-4


@pytest.fixture(scope="module")
def plain(plain_samples):
    return plain_samples


def test_sampled_distribution_with_a_head_equals_plain(plain, eng_head, tokenizer):
    p, per_pos = position_test(plain, dist_samples(eng_head, tokenizer, seed=2000))
    assert p > 1e-3, f"the head changed the token distribution (adjusted p={p:.2e}; per position {per_pos})"
    # negative control: the same test, same sample size, rejects a policy sampled a little colder
    from conftest import DIST_SAMPLES

    colder = eng_head.generate(
        [tokenizer.encode(DIST_PROMPT)] * DIST_SAMPLES,
        SamplingSettings(max_tokens=DIST_TOKENS, temperature=0.7, seed=3000),
    ).token_ids
    p_cold, _ = position_test(plain, colder)
    assert p_cold < 1e-6, f"the distribution test did not see temperature 0.7 against 1.0 (adjusted p={p_cold:.2e})"


def test_head_refit_changes_drafting_and_never_the_policy(eng_head, head, task_prompts, hf_policy, hf_reference):
    from rl_specdec.heads.eagle3 import load_head

    _, before = drafted(eng_head, task_prompts, GREEDY)
    try:
        eng_head.update_weights(perturbed_head(head), target="drafter")
        out, after = drafted(eng_head, task_prompts, GREEDY)
        assert out.token_ids == hf_reference  # the policy's greedy output is untouched
        assert after["spec_decode/acceptance_length"] < before["spec_decode/acceptance_length"] - 0.3, (before, after)
        assert worst_logprob_error(eng_head, task_prompts, hf_policy, seed=12) < 1e-4  # nor its log-probs
    finally:
        eng_head.update_weights(load_head(head).vllm_state_dict(), target="drafter")
    _, restored = drafted(eng_head, task_prompts, GREEDY)
    assert restored["spec_decode/acceptance_length"] == before["spec_decode/acceptance_length"]


def test_head_refit_refuses_the_policys_shared_tensors(eng_head, head, task_prompts, hf_reference):
    """vLLM gives the head the policy's embedding and LM head: a head refit that names them is refused whole."""
    import torch

    from rl_specdec.heads.eagle3 import load_head

    sd = load_head(head).vllm_state_dict()
    for name in ("embed_tokens.weight", "lm_head.weight"):
        bad = {**sd, name: torch.zeros(32, sd["norm.weight"].shape[0])}
        with pytest.raises(WeightIntegrityError, match=rf"{name}.*policy's own"):
            eng_head.update_weights(bad, target="drafter")
    assert eng_head.generate(task_prompts, GREEDY).token_ids == hf_reference


# ---- a head with its own draft vocabulary ------------------------------------------------------------
DRAFT_VOCAB = 24  # of the toy's 32 tokens: the ones the policy answers with most, through the head's own LM head


@pytest.fixture(scope="module")
def draft_vocab_head(head, hf_policy, hf_reference, tmp_path_factory):
    """The toy's head given EAGLE-3's draft vocabulary (its own LM head over 24 tokens, mapped back by d2t)."""
    import torch

    from rl_specdec.heads.build import with_draft_vocabulary
    from rl_specdec.heads.eagle3 import load_head, save_head

    counts = torch.bincount(torch.tensor([t for ids in hf_reference for t in ids]), minlength=32)
    lm_head = hf_policy.get_output_embeddings().weight.detach()
    folder = tmp_path_factory.mktemp("draft_vocab_head")
    save_head(with_draft_vocabulary(load_head(head), counts, DRAFT_VOCAB, lm_head), folder)
    return folder


@pytest.fixture(scope="module")
def eng_dv(request, local_ray, toy, draft_vocab_head):
    return module_engine(
        request, toy, {"method": "eagle3", "model": str(draft_vocab_head), "num_speculative_tokens": 3}
    )


def test_a_draft_vocabulary_head_refit_changes_drafting_and_never_the_policy(
    eng_dv, draft_vocab_head, task_prompts, hf_policy, hf_reference
):
    """The head's own LM head is what vLLM drafts with and what a refit replaces: its rows moved by one draft
    index send drafts to the wrong tokens, while the policy's greedy tokens and log-probs stay the same."""
    from rl_specdec.heads.eagle3 import load_head

    sent = load_head(draft_vocab_head).vllm_state_dict()
    assert sent["lm_head.weight"].shape[0] == DRAFT_VOCAB and "d2t" not in sent
    out, before = drafted(eng_dv, task_prompts, GREEDY)
    assert out.token_ids == hf_reference
    assert before["spec_decode/acceptance_length"] > 1.5, before
    try:
        eng_dv.update_weights({**sent, "lm_head.weight": sent["lm_head.weight"].roll(1, 0)}, target="drafter")
        out, after = drafted(eng_dv, task_prompts, GREEDY)
        assert out.token_ids == hf_reference
        assert after["spec_decode/acceptance_length"] < before["spec_decode/acceptance_length"] - 0.3, (before, after)
        assert worst_logprob_error(eng_dv, task_prompts, hf_policy, seed=13) < 1e-4
    finally:
        eng_dv.update_weights(sent, target="drafter")
    _, restored = drafted(eng_dv, task_prompts, GREEDY)
    assert restored["spec_decode/acceptance_length"] == before["spec_decode/acceptance_length"]


# ---- run-time k with a head ------------------------------------------------------------------------


def test_greedy_with_k_cycling_every_step_equals_transformers(eng_head, task_prompts, hf_reference):
    debug(eng_head, record_steps=True)
    debug(eng_head, cycle=CYCLE)
    try:
        out = eng_head.generate(task_prompts * 2, GREEDY)
    finally:
        steps = debug(eng_head, cycle=None)["steps"]
    assert out.token_ids == hf_reference * 2
    ks = {k for _, k, _ in steps}
    assert {0, 1, 2, 3} <= ks, ks  # the cycle reached the engine: every k ran, k=0 included


def test_temperature_one_with_k_changing_between_and_within_calls(eng_head, plain, tokenizer, hf_policy):
    check_k_changing_is_lossless(eng_head, plain, tokenizer.encode(DIST_PROMPT), hf_policy)


def test_the_head_drafts_after_a_stretch_at_k0_as_if_it_never_stopped(eng_head, tokenizer):
    """8 engine steps at k=0 (plain steps: the head does not run), then k=3: the head, caught up from the policy's
    hidden states those steps kept, makes at every position the first draft a k=3 run makes there, also when the
    catch-up is split into pieces of at most 7 tokens.

    Only positions where both runs verified drafts are compared; the head lands most drafts, so a prompt has
    few verify steps and the test takes 48 prompts. Negative control: without the catch-up (prompts included)
    the head's KV has holes and its first drafts differ."""
    from rl_specdec.tasks.sorting import SortingTask

    prompts = [tokenizer.encode(s.prompt) for s in SortingTask(max_len=24).make_batch(seed=321, n=48)]
    before = debug(eng_head)["stats"]
    check_catch_up_is_exact(eng_head, prompts, min_compared=30, control_below=0.9)
    stats = debug(eng_head)["stats"]
    assert stats["plain_steps"] - before["plain_steps"] >= 16, (before, stats)
    assert stats["catch_up_tokens"] > before["catch_up_tokens"], (before, stats)
