"""Tools through vLLM's OpenAI server on our engine: tool calls in and out, the splice across a tool turn.

One async engine on the trained tool toy (rl_specdec/toy/tools.py, the
session's ``tool_toy``) with its drafter (draft_model speculation), serving
with vLLM's hermes tool-call parser and an API key. Where a test needs a
given turn, the model's output is forced with a ``structured_outputs`` regex:
the tokens are still sampled by the engine (under speculation) and parsed by
vLLM's parser. The temperature-1 test samples a spliced turn freely, against
transformers. The same toy trains in the GRPO loop in tests/test_agent_grpo.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import CPU_VLLM_KWARGS, DIST_SAMPLES, HOST_CORES, draft_spec, hf_samples, position_test
from rl_specdec.config import GenerationConfig, validate_vllm_kwargs
from rl_specdec.tasks.lookup import LOOKUP_TOOL, Episode, LookupTask, model_tool_call, play

pytestmark = pytest.mark.integration

MODEL = "tooltoy"
API_KEY = "test-key"
HTTP_TIMEOUT = 120.0  # per request, seconds: a bound, not an assertion


def regex(text: str) -> str:
    """``text`` as a regex for vLLM's structured outputs (escape what the grammar treats as syntax)."""
    return "".join("\\" + c if c in "{}[]().*+?^$|\\" else c for c in text)


def forced(key: str, answer: str):
    """extra_body per turn: turn 0 writes the tool call for ``key``, turn 1 answers ``answer``."""
    return lambda turn: {"structured_outputs": {"regex": regex(model_tool_call(key)) if turn == 0 else answer}}


def episode(key: str = "q", values: dict[str, str] | None = None) -> Episode:
    values = values or {}
    return Episode(key=key, table=tuple((k, values.get(k, "123")) for k in "abcdefghijklmnopqrstuvwxyz"))


@pytest.fixture(scope="module")
def tool_tok(tool_toy):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_toy.policy))  # what vLLM loads (Qwen2Tokenizer)


@pytest.fixture(scope="module")
def url(request, local_ray, tool_toy):
    from rl_specdec.rollout.group import AsyncVllmGeneration

    kw = validate_vllm_kwargs(
        {**CPU_VLLM_KWARGS, "speculative_config": draft_spec(tool_toy.drafter)}, str(tool_toy.policy)
    )
    cfg = GenerationConfig(num_engines=1, cpus_per_engine=HOST_CORES, vllm_kwargs=kw, self_check=False)
    server = {
        "served_model_name": MODEL,
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "api_key": API_KEY,
    }
    g = AsyncVllmGeneration(str(tool_toy.policy), cfg, server=server)  # the chat template is the tokenizer's own
    request.addfinalizer(g.shutdown)
    return g.base_urls()[0]


@pytest.fixture(scope="module")
def client(url):
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=HTTP_TIMEOUT)


def run(coro_fn):
    return asyncio.run(asyncio.wait_for(coro_fn(), 4 * HTTP_TIMEOUT))


def test_tools_in_tool_calls_out(client, tool_tok):
    """The model's compact hermes call comes back parsed by vLLM: tool_calls, no content, finish tool_calls."""

    async def main():
        async with client() as c:
            return await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "q"}],
                tools=[LOOKUP_TOOL],
                max_tokens=48,
                extra_body={"structured_outputs": {"regex": regex(model_tool_call("q"))}},
            )

    r = run(main)
    choice = r.choices[0]
    m = choice.message.to_dict()
    assert choice.finish_reason == "tool_calls" and not m.get("content")
    (call,) = m["tool_calls"]
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"key": "q"}
    assert tool_tok.decode(m["generation_token_ids"]) == model_tool_call("q") + "<eos>"
    assert m["prompt_token_ids"] == tool_tok.encode("<tools>lookup</tools>q=")
    assert len(m["generation_log_probs"]) == len(m["generation_token_ids"])


def test_a_tool_episode_is_one_monotonic_token_sequence_over_three_turns(client, tool_tok):
    """Tool call, tool result, answer, a new user turn, answer: every prompt starts with all earlier tokens."""

    async def main():
        async with client() as c:
            x = await play(c, MODEL, LookupTask(), episode("q", {"q": "482"}), seed=1, extra_body=forced("q", "482"))
            # a third model turn after the tool turn: the client sends the whole history back
            msgs = [{"role": "user", "content": "q"}]
            r1 = await c.chat.completions.create(
                model=MODEL,
                messages=msgs,
                tools=[LOOKUP_TOOL],
                max_tokens=48,
                extra_body={"structured_outputs": {"regex": regex(model_tool_call("q"))}},
            )
            m1 = r1.choices[0].message.to_dict()
            msgs += [m1, {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": "482"}]
            r2 = await c.chat.completions.create(
                model=MODEL,
                messages=msgs,
                tools=[LOOKUP_TOOL],
                max_tokens=8,
                extra_body={"structured_outputs": {"regex": "482"}},
            )
            m2 = r2.choices[0].message.to_dict()
            msgs += [m2, {"role": "user", "content": "z"}]
            r3 = await c.chat.completions.create(model=MODEL, messages=msgs, tools=[LOOKUP_TOOL], max_tokens=4)
            return x, [m1, m2, r3.choices[0].message.to_dict()]

    x, (m1, m2, m3) = run(main)
    assert x["reward"] == 1.0 and x["called"] and x["right_key"]
    (s1, g1, _), (s2, g2, _) = x["turns"]
    assert x["ids"][s1 : s1 + len(g1)] == g1 and x["ids"][s2 : s2 + len(g2)] == g2 and x["ids"][-len(g2) :] == g2
    for a, b in ((m1, m2), (m2, m3)):
        prefix = a["prompt_token_ids"] + a["generation_token_ids"]
        assert b["prompt_token_ids"][: len(prefix)] == prefix
    assert (
        tool_tok.decode(m3["prompt_token_ids"][len(m2["prompt_token_ids"]) + len(m2["generation_token_ids"]) :]) == "z="
    )


def test_retokenization_case_the_splice_keeps_the_models_own_tool_call_tokens(url, client, tool_tok):
    """The template re-renders the call with newlines and spaces (Qwen2.5 style); the model wrote compact JSON.

    Without the ids (/tokenize of the plain history) the prompt holds the template's
    rendering; with them it holds the model's exact tokens, and turn 2 trains on those.
    """
    import httpx

    async def main():
        async with client() as c:
            return await play(c, MODEL, LookupTask(), episode("k", {"k": "907"}), seed=3, extra_body=forced("k", "907"))

    x = run(main)
    p1, p2 = x["prompts"]
    (_, g1, _), _ = x["turns"]
    msgs = [
        {"role": "user", "content": "k"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "k"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "907"},
    ]
    r = httpx.post(
        url.removesuffix("/v1") + "/tokenize",
        json={"model": MODEL, "messages": msgs, "tools": [LOOKUP_TOOL]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=HTTP_TIMEOUT,
    )
    template = r.json()["tokens"]
    assert (
        tool_tok.decode(template)
        == '<tools>lookup</tools>k=<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call><eos>'
        "<tool_response>907</tool_response>"
    )
    assert p2 == p1 + g1 + tool_tok.encode("<tool_response>907</tool_response>")
    assert tool_tok.decode(g1) == model_tool_call("k") + "<eos>"
    assert template != p2 and template[: len(p1)] == p1


def test_a_streamed_tool_call(client):
    async def main():
        async with client() as c:
            s = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                tools=[LOOKUP_TOOL],
                max_tokens=48,
                stream=True,
                extra_body={"structured_outputs": {"regex": regex(model_tool_call("x"))}},
            )
            names, args, finish = [], "", None
            async for chunk in s:
                for ch in chunk.choices:
                    for tc in ch.delta.tool_calls or []:
                        if tc.function is not None:
                            names += [tc.function.name] if tc.function.name else []
                            args += tc.function.arguments or ""
                    finish = ch.finish_reason or finish
            return names, args, finish

    names, args, finish = run(main)
    assert names == ["lookup"] and json.loads(args) == {"key": "x"} and finish == "tool_calls"


def test_wrong_key_and_malformed_calls_score_zero(client):
    """The environment answers the key the model asked for; a call the parser cannot read comes back as content."""

    async def main():
        async with client() as c:
            ep = episode("q", {"q": "482", "b": "555"})
            wrong = await play(c, MODEL, LookupTask(), ep, seed=5, extra_body=forced("b", "555"))
            broken = await play(
                c,
                MODEL,
                LookupTask(),
                ep,
                seed=7,
                extra_body=lambda t: {
                    "structured_outputs": {"regex": regex('<tool_call>{"name":"lookup"</tool_call>')}
                },
            )
            return wrong, broken

    wrong, broken = run(main)
    assert wrong["called"] and not wrong["right_key"] and wrong["reward"] == 0.0
    assert len(wrong["turns"]) == 2
    assert not broken["called"] and broken["reward"] == 0.0 and len(broken["turns"]) == 1


def test_trajectory_masks_the_tool_tokens(client, tool_tok):
    """Both model turns are in the loss; the tool response and the prompt are context only."""
    import torch

    from rl_specdec.grpo.batch import Trajectory, build_train_batch

    async def main():
        async with client() as c:
            return await play(c, MODEL, LookupTask(), episode("m", {"m": "314"}), seed=9, extra_body=forced("m", "314"))

    x = run(main)
    batch = build_train_batch([Trajectory(x["ids"], x["turns"])], torch.zeros(1), tool_tok.pad_token_id)
    mask = batch["loss_mask"][0]  # position t predicts token t+1
    trained = [x["ids"][t + 1] for t in range(len(mask)) if mask[t] > 0]
    (_, g1, lp1), (_, g2, lp2) = x["turns"]
    assert trained == g1 + g2
    assert tool_tok.decode(trained) == model_tool_call("m") + "<eos>314<eos>"
    assert batch["gen_logprobs"][0][mask > 0].tolist() == pytest.approx(lp1 + lp2)


def test_the_api_key_is_required(url):
    import httpx

    assert httpx.get(url + "/models", timeout=HTTP_TIMEOUT).status_code == 401
    r = httpx.get(url + "/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]


def test_where_the_template_is_exact_the_spliced_prompt_is_apply_chat_template(client, tool_tok):
    """No tool call: the template renders the model's answer as the model wrote it (the answer, then the
    end-of-turn token), so the server's spliced prompt is the tokenizer's own ``apply_chat_template`` of the
    conversation, token for token, and decodes to the template's text. (Where it is not exact, the prompt holds
    the model's own ids instead: the retokenization test above.)"""

    async def main():
        async with client() as c:
            first = [{"role": "user", "content": "q"}]
            r1 = await c.chat.completions.create(
                model=MODEL, messages=first, max_tokens=8, extra_body={"structured_outputs": {"regex": "482"}}
            )
            m1 = r1.choices[0].message.to_dict()
            r2 = await c.chat.completions.create(
                model=MODEL, messages=[*first, m1, {"role": "user", "content": "z"}], max_tokens=4
            )
            return m1, r2.choices[0].message.to_dict()

    m1, m2 = run(main)
    talk = [{"role": "user", "content": "q"}, {"role": "assistant", "content": m1["content"]}]
    talk.append({"role": "user", "content": "z"})

    def template(messages, **kw):
        out = tool_tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
        return out if isinstance(out, str) else list(out["input_ids"] if hasattr(out, "keys") else out)

    assert m1["prompt_token_ids"] == template(talk[:1])
    assert m2["prompt_token_ids"] == template(talk)
    assert m2["prompt_token_ids"][: len(m1["prompt_token_ids"]) + len(m1["generation_token_ids"])] == (
        m1["prompt_token_ids"] + m1["generation_token_ids"]
    )
    assert tool_tok.decode(m2["prompt_token_ids"]) == template(talk, tokenize=False) == "q=482<eos>z="


SPLICED_TOKENS = 40  # the sampled turn's first tokens: a call's key is its 36th (model_tool_call)
# The user turn after a whole episode, in the order tried. SFT never shows the toy a third turn, so what it does
# there depends on the build, which depends on the CPU that trained it: one build writes a call or guesses after
# "c=", another ends the turn at once. The tools header repeated makes the turn look like an episode's first,
# where SFT taught a choice (call, or guess a digit). The test samples the first turn on which transformers'
# temperature 1 and 0.7 differ: a turn with no randomness could not tell the server's sampling from anything.
SPLICE_USER_TURNS = ("c", "<tools>lookup</tools>c")


def _spliced_turn_samples(client, user: str, n: int, **sampling) -> tuple[list[int], list[list[int]]]:
    """The third model turn of an episode, after the user turn ``user``, sampled ``n`` times with seeds 0..n-1:
    turns 1 and 2 are forced (the call for "q", the answer), then ``user``; its prompt is spliced by the server
    from the model's own ids. Returns that prompt (the same for every sample) and the samples."""

    async def main():
        async with client() as c:
            msgs = [{"role": "user", "content": "q"}]
            for turn in (0, 1):  # the call, then (after the tool's result) the answer
                r = await c.chat.completions.create(
                    model=MODEL, messages=msgs, tools=[LOOKUP_TOOL], max_tokens=48, extra_body=forced("q", "482")(turn)
                )
                m = r.choices[0].message.to_dict()
                msgs.append(m)
                if turn == 0:
                    msgs.append({"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "482"})
            msgs.append({"role": "user", "content": user})
            gate = asyncio.Semaphore(32)

            async def one(seed: int):
                async with gate:
                    return await c.chat.completions.create(
                        model=MODEL, messages=msgs, tools=[LOOKUP_TOOL], seed=seed, **sampling
                    )

            return await asyncio.gather(*(one(i) for i in range(n)))

    msgs = [r.choices[0].message.to_dict() for r in run(main)]
    prompts = {tuple(m["prompt_token_ids"]) for m in msgs}
    assert len(prompts) == 1, "every sample's prompt is the same spliced history"
    return list(prompts.pop()), [m["generation_token_ids"] for m in msgs]


def _a_random_spliced_turn(client, hf) -> tuple[str, list[int], list[list[int]]]:
    """(user turn, its spliced prompt, transformers' temperature-1 samples) for the first of SPLICE_USER_TURNS
    whose turn the negative control can see: transformers at temperature 0.7 against 1.0 is rejected there."""
    seen = {}
    for user in SPLICE_USER_TURNS:
        prompt, _ = _spliced_turn_samples(client, user, 1, max_tokens=1, temperature=0.0)
        plain = hf_samples(hf, prompt, DIST_SAMPLES, SPLICED_TOKENS, seed=2000)
        cold = hf_samples(hf, prompt, DIST_SAMPLES, SPLICED_TOKENS, seed=2001, temperature=0.7)
        seen[user] = position_test(plain, cold, n_pos=SPLICED_TOKENS)[0] if len(set(map(tuple, plain))) > 1 else 1.0
        if seen[user] < 1e-4:
            return user, prompt, plain
    raise AssertionError(f"the test did not see temperature 0.7 against 1.0 after any user turn (adjusted p: {seen})")


def test_a_spliced_turn_at_temperature_one_is_distributed_as_transformers_samples(client, tool_toy, tool_tok):
    """Under draft_model speculation, a model turn whose prompt the server spliced (two earlier turns of the
    model's own ids and a tool result) is distributed as transformers' plain sampling from that prompt.
    Negative control: the same test, with the same sample sizes, rejects the policy sampled at temperature 0.7."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tool_toy.policy), dtype="float32").eval()
    user, prompt, plain = _a_random_spliced_turn(client, hf)
    served_prompt, served = _spliced_turn_samples(
        client, user, DIST_SAMPLES, max_tokens=SPLICED_TOKENS, temperature=1.0
    )
    assert served_prompt == prompt
    assert tool_tok.decode(prompt).endswith(f"</tool_response>482<eos>{user}=")
    p, per_pos = position_test(plain, served, n_pos=SPLICED_TOKENS)
    assert p > 1e-3, f"the server's spliced turn differs from transformers' (adjusted p={p:.2e}; {per_pos})"
