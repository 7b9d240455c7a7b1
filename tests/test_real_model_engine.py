"""vLLM on the real model (``pkg:smollm2-135m-instruct``): greedy tokens and log-probs equal transformers',
without speculation and with ``ngram``, and the end-of-turn token ``<|im_end|>`` ends a response.

Both engines run float32, eager, on the converted folder, exactly as a user's checkpoint.
"""

from __future__ import annotations

import pytest

from conftest import NGRAM, hf_greedy, hf_token_logprobs, start_engine
from rl_specdec.grpo.step import decode_response
from rl_specdec.rollout import SamplingSettings
from rl_specdec.tasks import ArithmeticChatTask

pytestmark = pytest.mark.integration

MAX_TOKENS = 32
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 2**27}  # 46 KB a token in fp32: ~2,900 tokens
LOGPROB_TOL = 2e-3  # float32, different kernels (vLLM's CPU attention against transformers' eager)


@pytest.fixture(scope="module")
def prompts(smol_tokenizer) -> list[list[int]]:
    """Two task prompts and one whose answer is short, so at least one response ends on its own."""
    task = ArithmeticChatTask(min_steps=1, max_steps=1, max_start=20)
    short = ArithmeticChatTask(min_steps=1, max_steps=1, instruction="Answer with the number only.")
    samples = task.make_batch(seed=11, n=2)
    return [task.encode_prompt(smol_tokenizer, s.prompt) for s in samples] + [
        short.encode_prompt(smol_tokenizer, "What is 2 + 3?")
    ]


@pytest.fixture(scope="module")
def hf_model(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return hf_greedy(hf_model, prompts, MAX_TOKENS)


def generate(smollm2, spec, prompts):
    g = start_engine(smollm2, spec, **ENGINE)
    try:
        return g.generate(prompts, GREEDY)
    finally:
        g.shutdown()


@pytest.fixture(scope="module")
def outputs(local_ray, smollm2, prompts):
    """Greedy outputs of an engine without speculation and of one with ngram, one engine at a time."""
    return {"none": generate(smollm2, None, prompts), "ngram": generate(smollm2, NGRAM, prompts)}


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_greedy_tokens_and_logprobs_equal_transformers(outputs, reference, hf_model, prompts, method):
    out = outputs[method]
    assert out.token_ids == reference
    for p, ids, lps in zip(prompts, out.token_ids, out.logprobs):
        hf = hf_token_logprobs(hf_model, p, ids)
        assert len(lps) == len(ids)
        worst = max(abs(a - b) for a, b in zip(lps, hf))
        assert worst < LOGPROB_TOL, f"{method}: log-prob differs from transformers' by {worst:.2e}"


def test_end_of_turn_ends_a_response(outputs, smol_tokenizer):
    """A response that stops on its own stops on ``<|im_end|>``, which decoding drops; the others are cut."""
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = outputs["none"]
    assert "stop" in out.finish_reasons
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] == im_end and im_end not in ids[:-1]
            assert "<|im_end|>" not in decode_response(smol_tokenizer, ids, reason)
        else:
            assert (reason, len(ids)) == ("length", MAX_TOKENS) and im_end not in ids
    assert out.finish_reasons[-1] == "stop"  # "What is 2 + 3? Answer with the number only."
    assert decode_response(smol_tokenizer, out.token_ids[-1], "stop").strip().endswith("5")
