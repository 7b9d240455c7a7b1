"""vLLM on the real model (``pkg:smollm2-135m-instruct``): greedy tokens and log-probs equal transformers',
with an EAGLE-3 head built for it and with ``ngram``; the end-of-turn token ``<|im_end|>`` ends a response;
vLLM's OpenAI app serves it through the model's own chat template, with token ids and log-probs back, streamed or not.

Both engines run float32, eager, on the converted folder, exactly as a user's checkpoint. The ``ngram`` one
is the async engine with its OpenAI server, so the greedy comparison covers the engine the server uses. The
head is built as ``pkg:smollm2-135m-instruct-eagle3`` is, on fewer of the model's own answers and steps (the
shipped build takes minutes): enough for drafts to be accepted, which is what the comparison must cover.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import NGRAM, hf_greedy, hf_token_logprobs, start_engine
from rl_specdec.grpo.step import decode_response
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.rollout import SamplingSettings
from rl_specdec.tasks import ArithmeticChatTask

pytestmark = pytest.mark.integration

MAX_TOKENS = 32
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 2**27}  # 46 KB a token in fp32: ~2,900 tokens
SERVED = "smollm2"
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


@pytest.fixture(scope="module")
def server(request, local_ray, smollm2):
    """The async engine with ngram and vLLM's OpenAI app, on the model's own chat template."""
    from rl_specdec.rollout.group import AsyncVllmGeneration

    g = start_engine(smollm2, NGRAM, group_cls=AsyncVllmGeneration, server={"served_model_name": SERVED}, **ENGINE)
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def head(smollm2):
    from rl_specdec.toy.heads import CHAT_HEAD, build_chat_head

    return build_chat_head(
        smollm2, dataclasses.replace(CHAT_HEAD, pool=1, steps=24, chain_steps=1), log=lambda *_: None
    )


@pytest.fixture(scope="module")
def outputs(local_ray, smollm2, head, prompts, server):
    """Greedy outputs of an engine drafting with the head (started and stopped here) and of the ngram server's."""
    g = start_engine(smollm2, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}, **ENGINE)
    try:
        drafted = g.generate(prompts, GREEDY)
    finally:
        g.shutdown()
    return {"eagle3": drafted, "ngram": server.generate(prompts, GREEDY)}


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_greedy_tokens_and_logprobs_equal_transformers(outputs, reference, hf_model, prompts, method):
    out = outputs[method]
    accepted = compute_spec_decode_metrics(None, out.spec_counters)["spec_decode/num_accepted_tokens"]
    assert accepted > 0, f"{method}: no draft was accepted, so the comparison covers no accepted token"
    assert out.token_ids == reference
    for p, ids, lps in zip(prompts, out.token_ids, out.logprobs):
        hf = hf_token_logprobs(hf_model, p, ids)
        assert len(lps) == len(ids)
        worst = max(abs(a - b) for a, b in zip(lps, hf))
        assert worst < LOGPROB_TOL, f"{method}: log-prob differs from transformers' by {worst:.2e}"


def test_end_of_turn_ends_a_response(outputs, smol_tokenizer):
    """A response that stops on its own stops on ``<|im_end|>``, which decoding drops; the others are cut."""
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = outputs["eagle3"]
    assert "stop" in out.finish_reasons
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] == im_end and im_end not in ids[:-1]
            assert "<|im_end|>" not in decode_response(smol_tokenizer, ids, reason)
        else:
            assert (reason, len(ids)) == ("length", MAX_TOKENS) and im_end not in ids
    assert out.finish_reasons[-1] == "stop"  # "What is 2 + 3? Answer with the number only."
    assert decode_response(smol_tokenizer, out.token_ids[-1], "stop").strip().endswith("5")


def _chat(url: str, messages: list[dict], stream: bool):
    """(content, generated ids, log-probs, prompt ids, finish reason) of one greedy chat request."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0)
    body = {"model": SERVED, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    if not stream:
        c = client.chat.completions.create(**body).choices[0]
        m = c.to_dict()
        lps = [x["logprob"] for x in m["logprobs"]["content"]]
        return (
            m["message"]["content"],
            m["message"]["generation_token_ids"],
            lps,
            m["message"]["prompt_token_ids"],
            c.finish_reason,
        )
    text, ids, lps, prompt, finish = "", [], [], None, None
    for ch in client.chat.completions.create(**body, stream=True):
        d = ch.model_dump()
        prompt = prompt or d.get("prompt_token_ids")
        for c in d["choices"]:
            text += c["delta"].get("content") or ""
            ids += c.get("token_ids") or []
            lps += [x["logprob"] for x in ((c.get("logprobs") or {}).get("content") or [])]
            finish = c.get("finish_reason") or finish
    return text, ids, lps, prompt, finish


def test_the_openai_app_serves_it_through_its_own_chat_template(server, smol_tokenizer, hf_model):
    """A chat request is rendered by the model's template; its tokens, log-probs and text come back, streamed
    or not, and equal the engine's greedy output and transformers' log-probs."""
    (url,) = server.base_urls()
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]
    want_prompt = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    full = _chat(url, messages, stream=False)
    text, ids, lps, prompt, finish = full
    assert prompt == want_prompt
    assert ids == server.generate([want_prompt], GREEDY).token_ids[0]
    assert finish == "stop" and text == decode_response(smol_tokenizer, ids, "stop") and "5" in text
    hf = hf_token_logprobs(hf_model, want_prompt, ids)
    assert len(lps) == len(ids) and max(abs(a - b) for a, b in zip(lps, hf)) < LOGPROB_TOL
    s_text, s_ids, s_lps, s_prompt, s_finish = _chat(url, messages, stream=True)
    assert (s_text, s_ids, s_prompt, s_finish) == (text, ids, prompt, finish)
    assert max(abs(a - b) for a, b in zip(s_lps, lps)) < LOGPROB_TOL and len(s_lps) == len(lps)
