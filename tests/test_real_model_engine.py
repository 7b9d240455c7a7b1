"""vLLM on the real model (``pkg:smollm2-135m-instruct``): greedy tokens and log-probs equal transformers',
with an EAGLE-3 head built for it and with ``ngram``; the end-of-turn token ``<|im_end|>`` ends a response;
vLLM's OpenAI app serves it through the model's own chat template, with token ids and log-probs back, streamed or not.

Both engines run float32, eager, on the converted folder, exactly as a user's checkpoint. The ``ngram`` one
is the async engine with its OpenAI server, so the greedy comparison covers the engine the server uses. The
head is built as ``pkg:smollm2-135m-instruct-eagle3`` is, on fewer of the model's own answers and steps (the
shipped build takes minutes): enough for drafts to be accepted, which is what the comparison must cover.
Its engine chooses k at run time, so the head is also checked through k switches (greedy, and temperature 1
against transformers' own sampling, with a negative control) and through a head refit.
"""

from __future__ import annotations

import pytest

from conftest import DIST_SAMPLES, NGRAM, hf_greedy, hf_samples, hf_token_logprobs, position_test, start_engine
from engine_debug import CYCLE, check_k_changing_is_lossless, debug, perturbed_head
from rl_specdec.grpo.sources import decode_response
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.rollout import SamplingSettings
from rl_specdec.tasks import ArithmeticChatTask

pytestmark = pytest.mark.integration

MAX_TOKENS = 32
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
SAMPLED = SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, logprobs=0)
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
def head(smollm2_head):
    return smollm2_head


@pytest.fixture(scope="module")
def eng_head(request, local_ray, smollm2, head):
    """An engine drafting with the head, k chosen at run time (mode fixed: k=3 until set), the test hooks in it."""
    from engine_debug import DebugVllmGeneration

    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    g = start_engine(smollm2, spec, control={"mode": "fixed"}, group_cls=DebugVllmGeneration, **ENGINE)
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def outputs(eng_head, prompts, server):
    """Greedy outputs of the engine drafting with the head and of the ngram server's."""
    return {"eagle3": eng_head.generate(prompts, GREEDY), "ngram": server.generate(prompts, GREEDY)}


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


def test_a_second_turn_is_spliced_and_renders_as_the_tokenizers_own_template(server, smol_tokenizer):
    """The real model's multi-turn task (tasks/retry.py): an answer, the feedback, a second try. The second
    prompt begins with the first prompt and the model's own ids, and decodes to the tokenizer's own
    ``apply_chat_template`` of the conversation; where the template re-encodes the answer to the model's ids
    (exact), the prompt is that template's ids, token for token."""
    from openai import OpenAI

    from rl_specdec.tasks.retry import FEEDBACK

    (url,) = server.base_urls()
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0)
    body = {"model": SERVED, "max_tokens": MAX_TOKENS, "temperature": 0}
    first = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]
    m1 = client.chat.completions.create(messages=first, **body).choices[0].message.to_dict()
    talk = [*first, m1, {"role": "user", "content": FEEDBACK}]
    m2 = client.chat.completions.create(messages=talk, **body).choices[0].message.to_dict()
    p1, g1, p2 = m1["prompt_token_ids"], m1["generation_token_ids"], m2["prompt_token_ids"]
    assert p2[: len(p1) + len(g1)] == p1 + g1, "the second prompt does not carry the model's own first answer"
    plain = [*first, {"role": "assistant", "content": m1["content"]}, talk[-1]]
    text = smol_tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert smol_tokenizer.decode(p2) == text
    ids = smol_tokenizer.apply_chat_template(plain, add_generation_prompt=True)["input_ids"]
    if ids[len(p1) : len(p1) + len(g1)] == g1:
        assert p2 == ids


# ---- the head through k switches and a refit --------------------------------------------------------------

DIST_CHAT = "Write one sentence about the sea."  # an open answer: a spread-out distribution at temperature 1
DIST_LEN = 6  # tokens a sample: the samples' positions each get a chi-square
DIST_DRAWN = 200  # samples drawn to be tested against DIST_SAMPLES plain ones (the control shows it is enough)


@pytest.fixture(scope="module")
def dist_prompt(smol_tokenizer) -> list[int]:
    messages = [{"role": "user", "content": DIST_CHAT}]
    return smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


@pytest.fixture(scope="module")
def plain(hf_model, dist_prompt) -> list[list[int]]:
    return hf_samples(hf_model, dist_prompt, DIST_SAMPLES, DIST_LEN, seed=1000)


def test_the_distribution_test_sees_a_colder_policy(hf_model, dist_prompt, plain):
    """The negative control of the temperature-1 test below: the same test, the same sample sizes, on this
    prompt, rejects the policy sampled at temperature 0.8."""
    cold = hf_samples(hf_model, dist_prompt, DIST_DRAWN, DIST_LEN, seed=1001, temperature=0.8)
    p_cold, per_pos = position_test(plain, cold, n_pos=DIST_LEN)
    assert p_cold < 1e-6, f"the test did not see temperature 0.8 against 1.0 (adjusted p={p_cold:.2e}; {per_pos})"


def test_greedy_with_k_cycling_every_step_equals_transformers(eng_head, prompts, reference):
    debug(eng_head, record_steps=True)
    debug(eng_head, cycle=CYCLE)
    try:
        out = eng_head.generate(prompts, GREEDY)
    finally:
        steps = debug(eng_head, cycle=None)["steps"]
    assert out.token_ids == reference
    assert {0, 1, 2, 3} <= {k for _, k, _ in steps}  # the cycle reached the engine: every k ran, k=0 included


def test_temperature_one_through_k_switches_is_the_policys(eng_head, plain, dist_prompt, hf_model):
    """k=3, k=0, k cycling every step, and k=2 then 3 within a call: the samples follow transformers' plain
    sampling, and every sampled token's log-prob is transformers'."""
    check_k_changing_is_lossless(
        eng_head, plain, dist_prompt, hf_model, tol=LOGPROB_TOL, tokens=DIST_LEN, per_call=DIST_DRAWN // 4
    )
    accepted = compute_spec_decode_metrics(None, eng_head.generate([dist_prompt] * 8, SAMPLED).spec_counters)
    assert accepted["spec_decode/num_accepted_tokens"] > 0  # the head lands drafts on this prompt too


def test_after_a_head_refit_the_policy_is_unchanged(eng_head, head, prompts, reference, hf_model):
    """A head refit (the head's weights perturbed) changes drafting, never what is generated: greedy tokens and
    sampled log-probs stay transformers'; the head put back drafts as before."""
    from rl_specdec.heads.eagle3 import load_head

    def drafted(sampling):
        out = eng_head.generate(prompts, sampling)
        return out, compute_spec_decode_metrics(None, out.spec_counters)

    _, before = drafted(GREEDY)
    try:
        eng_head.update_weights(perturbed_head(head), target="drafter")
        out, after = drafted(GREEDY)
        assert out.token_ids == reference
        assert after["spec_decode/acceptance_length"] < before["spec_decode/acceptance_length"], (before, after)
        sampled, _ = drafted(SAMPLED)
        for p, ids, lps in zip(prompts, sampled.token_ids, sampled.logprobs):
            worst = max(abs(a - b) for a, b in zip(lps, hf_token_logprobs(hf_model, p, ids)))
            assert worst < LOGPROB_TOL, f"after a head refit a log-prob differs from transformers' by {worst:.2e}"
    finally:
        eng_head.update_weights(load_head(head).vllm_state_dict(), target="drafter")
    _, restored = drafted(GREEDY)
    assert restored["spec_decode/acceptance_length"] == before["spec_decode/acceptance_length"]
