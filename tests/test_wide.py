"""The wide toy pair (rl_specdec.toy.wide): widening preserves the function, and speculation on it is lossless.

* pure logic: :func:`widen` on a tiny random Qwen2 computes what it computed
  (and a widening that breaks the rule is caught, so the check can fail);
* integration: the built pair against transformers and the long-tail target it
  was widened from (greedy tokens, log-probs), and real vLLM engines on it
  (no speculation, draft_model k=4): greedy equals transformers, sampled
  log-probs are the target's, and the temperature-1 distribution with
  speculation equals the one without (with a negative control on the same pair).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_specdec.toy.build import ModelShape, qwen2_config
from rl_specdec.toy.wide import WideToyConfig, widen

PROMPTS = [[2, 5, 7, 3, 9, 11], [4, 4, 8, 2, 11], [9, 3, 6, 6, 5, 2, 11]]


def _tiny():
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM(qwen2_config(ModelShape(64, 2, 2, 128))).eval()


def _logits(model, prompt):
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0]  # [T, V]


def test_widen_preserves_the_function():
    small = _tiny()
    wide = widen(small, WideToyConfig(intermediate_size=512, extra_layers=2))
    assert wide.config.num_hidden_layers == 4 and wide.config.intermediate_size == 512
    assert sum(p.numel() for p in wide.parameters()) > 2 * sum(p.numel() for p in small.parameters())
    for p in PROMPTS:
        torch.testing.assert_close(_logits(wide, p), _logits(small, p), rtol=0, atol=1e-5)


def test_a_widening_that_leaks_into_the_residual_stream_is_caught():
    """Negative control: one nonzero new down_proj column changes the output, and the check above sees it."""
    small = _tiny()
    wide = widen(small, WideToyConfig(intermediate_size=512, extra_layers=0))
    with torch.no_grad():
        wide.model.layers[0].mlp.down_proj.weight[:, 300] = 0.05
    assert any((_logits(wide, p) - _logits(small, p)).abs().max() > 1e-3 for p in PROMPTS)


def test_widen_refuses_a_narrower_mlp():
    with pytest.raises(ValueError, match="intermediate_size"):
        widen(_tiny(), WideToyConfig(intermediate_size=64))


# ---- the built pair ---------------------------------------------------------------------------

MAX_TOKENS = 48
SPEC_K4 = 4


@pytest.fixture(scope="module")
def wide(wide_pair):
    return wide_pair


@pytest.fixture(scope="module")
def wide_tok():
    from rl_specdec.toy.longtail import build_longtail_tokenizer

    return build_longtail_tokenizer()


@pytest.fixture(scope="module")
def wide_prompts(wide_tok):
    from rl_specdec.tasks.longtail import LongTailSortTask

    return [wide_tok.encode(s.prompt) for s in LongTailSortTask(4, 8).make_batch(seed=7, n=8)]


@pytest.fixture(scope="module")
def hf_wide(wide):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(wide.policy, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_wide_greedy(hf_wide, wide_prompts) -> list[list[int]]:
    """transformers' greedy continuations of the prompts, computed once (about 8 s on 2 cores)."""
    from conftest import hf_greedy

    return hf_greedy(hf_wide, wide_prompts, MAX_TOKENS)


def _start(wide, spec):
    from conftest import start_engine

    return start_engine(wide.policy, spec, max_model_len=512, kv_cache_memory_bytes=1 << 29)


@pytest.fixture(scope="module")
def wide_none(request, local_ray, wide):
    g = _start(wide, None)
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def wide_draft(request, local_ray, wide):
    spec = {
        "method": "draft_model",
        "model": str(wide.drafter),
        "num_speculative_tokens": SPEC_K4,
        "draft_sample_method": "probabilistic",
    }
    g = _start(wide, spec)
    request.addfinalizer(g.shutdown)
    return g


@pytest.mark.integration
def test_built_wide_target_computes_the_long_tail_target(hf_wide, wide_prompts, hf_wide_greedy, longtail_pair):
    """At build, the wide target's log-probs and greedy tokens are the long-tail target's."""
    from transformers import AutoModelForCausalLM

    from conftest import hf_greedy

    narrow = AutoModelForCausalLM.from_pretrained(longtail_pair.policy).eval()
    assert sum(p.numel() for p in hf_wide.parameters()) > 20 * sum(p.numel() for p in narrow.parameters())
    for p in wide_prompts:
        torch.testing.assert_close(_logits(hf_wide, p), _logits(narrow, p), rtol=0, atol=1e-4)
    assert hf_wide_greedy == hf_greedy(narrow, wide_prompts, MAX_TOKENS)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["none", "draft_model"])
def test_wide_greedy_matches_transformers(wide_none, wide_draft, name, hf_wide_greedy, wide_prompts):
    from rl_specdec.rollout import SamplingSettings

    g = {"none": wide_none, "draft_model": wide_draft}[name]
    out = g.generate(wide_prompts, SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0))
    assert out.token_ids == hf_wide_greedy, name


@pytest.mark.integration
@pytest.mark.parametrize("name", ["none", "draft_model"])
def test_wide_sampled_logprobs_match_transformers(wide_none, wide_draft, name, hf_wide, wide_prompts):
    from conftest import hf_token_logprobs
    from rl_specdec.metrics import compute_spec_decode_metrics
    from rl_specdec.rollout import SamplingSettings

    g = {"none": wide_none, "draft_model": wide_draft}[name]
    out = g.generate(wide_prompts, SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=5))
    worst = max(
        float(np.max(np.abs(np.array(lps) - np.array(hf_token_logprobs(hf_wide, p, ids)))))
        for p, ids, lps in zip(wide_prompts, out.token_ids, out.logprobs)
    )
    assert worst < 1e-4, f"{name}: max |logprob - HF| = {worst:.2e}"
    if name == "draft_model":  # the drafter drafts and is accepted: this pair's speculation really runs
        assert compute_spec_decode_metrics(None, out.spec_counters)["spec_decode/acceptance_length"] > 1.5


def _dist(g, prompt, seed, temperature=1.0):
    from conftest import DIST_SAMPLES, DIST_TOKENS
    from rl_specdec.rollout import SamplingSettings

    sampling = SamplingSettings(max_tokens=DIST_TOKENS, temperature=temperature, seed=seed)
    return g.generate([prompt] * DIST_SAMPLES, sampling).token_ids


@pytest.mark.integration
def test_wide_temperature_1_distribution_with_speculation_equals_plain(wide_none, wide_draft, wide_prompts):
    """The lossless test that matters for RL, on this pair; a temperature of 0.7 on the same engine is its
    negative control (the statistic must reject a distribution that differs)."""
    from conftest import position_test

    plain = _dist(wide_none, wide_prompts[0], seed=1000)
    # a guard only (the 0.7 control below is what shows power): samples must not collapse to a few sequences
    assert len({tuple(s) for s in plain}) > len(plain) // 10, "the test prompt has too little randomness"
    p_spec, per_pos = position_test(plain, _dist(wide_draft, wide_prompts[0], seed=2000))
    assert p_spec > 1e-3, f"speculation changed the distribution (adjusted p={p_spec:.2e}; {per_pos})"
    p_cold, _ = position_test(plain, _dist(wide_none, wide_prompts[0], seed=3000, temperature=0.7))
    assert p_cold < 1e-3, f"the statistic missed a temperature change (adjusted p={p_cold:.2e})"
