"""The async engine and vLLM's OpenAI server mounted on it, end to end on the digit toy.

One async engine (draft_model speculation, k=3, probabilistic drafting) with
its HTTP server is started for the whole module and shared by every test;
requests go through the real ``openai`` client where a client would use it,
and raw HTTP where the test is about the wire (malformed bodies).
Request loops are bounded in count and in time (client timeouts); nothing
here asserts a duration.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import (
    CPU_VLLM_KWARGS,
    DIST_PROMPT,
    DIST_SAMPLES,
    DIST_TOKENS,
    HOST_CORES,
    assert_failed_start_leaves_nothing,
    dist_samples,
    draft_spec,
    position_test,
)
from rl_specdec.config import GenerationConfig, validate_vllm_kwargs
from rl_specdec.errors import SleepNotSupported
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.metrics.counters import NAMES
from rl_specdec.rollout import SamplingSettings
from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE

pytestmark = pytest.mark.integration

MODEL_NAME = "toy-policy"
HTTP_TIMEOUT = 120.0  # per request, seconds: a bound, not an assertion
GREEDY = SamplingSettings(max_tokens=30, temperature=0.0)
SPEC_K = 3  # the server engine's drafted tokens per step


@pytest.fixture(scope="module")
def srv(request, local_ray, toy):
    from rl_specdec.rollout.group import AsyncVllmGeneration

    kw = validate_vllm_kwargs(
        {**CPU_VLLM_KWARGS, "speculative_config": draft_spec(toy.drafter, SPEC_K)}, str(toy.policy)
    )
    cfg = GenerationConfig(num_engines=1, cpus_per_engine=HOST_CORES, vllm_kwargs=kw, self_check=False)
    g = AsyncVllmGeneration(
        str(toy.policy), cfg, server={"chat_template": TOY_CHAT_TEMPLATE, "served_model_name": MODEL_NAME}
    )
    request.addfinalizer(g.shutdown)
    return g


@pytest.fixture(scope="module")
def url(srv):
    (u,) = srv.base_urls()
    assert u.startswith("http://127.0.0.1:") and u.endswith("/v1")
    return u


def _post(url: str, path: str, body, timeout: float = HTTP_TIMEOUT):
    import httpx

    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


# ---- the engine -------------------------------------------------------------------------------


def test_cpu_fix_reaches_the_engine_core_process(srv):
    info = srv.engine_info[0]
    assert info["platform"] == "cpu"
    assert info["engine_pid"] != info["actor_pid"], "AsyncLLM's engine core runs in its own process"
    assert info["cpu_expand_patched"] is True, "the expand fix was not applied in the engine-core process"
    assert info["expand_path_ok"] is True


def test_temperature_one_sampling_follows_the_policy(srv, tokenizer):
    """Speculative sampling at temperature 1 emits tokens as the policy's top-5 log-probs say.

    Without the fix in the engine-core process this fails (chi2 in the tens of
    thousands, most tokens are 0); check_sampling raises on p < 1e-6.
    """
    report = srv.check_sampling([tokenizer.encode("31")] * 200, max_tokens=12, top_k=5, seed=3)
    out = srv.generate([tokenizer.encode("31")] * 64, SamplingSettings(max_tokens=12, temperature=1.0, seed=4))
    m = compute_spec_decode_metrics(None, out.spec_counters)
    assert report.num_tokens > 1000
    assert m["spec_decode/num_draft_tokens"] > 0 and m["spec_decode/acceptance_rate"] > 0.2, m


def test_call_counters_exclude_other_traffic(srv, url, task_prompts, tokenizer):
    """A call's counters are its own requests', even while the server answers HTTP requests.

    Greedy drafting and verification are deterministic per request, so the same
    call gives the same counters alone and under traffic; the engine's
    process-wide counters do count the traffic (which is what the test would see
    if counters were read around the call).
    """
    import threading

    import httpx

    alone = srv.generate(task_prompts[:8], GREEDY).spec_counters
    assert set(alone) == set(NAMES) and len(alone["vllm:spec_decode_num_accepted_tokens_per_pos"]) == 3
    stop = threading.Event()

    def traffic():
        body = {"model": MODEL_NAME, "prompt": "31415=", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        while not stop.is_set():
            httpx.post(url + "/completions", json=body, timeout=HTTP_TIMEOUT)

    before = srv.engine_counters()[0]
    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        busy = srv.generate(task_prompts[:8], GREEDY).spec_counters
    finally:
        stop.set()
        thread.join(timeout=HTTP_TIMEOUT)
    after = srv.engine_counters()[0]
    assert busy == alone
    engine_wide = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    assert engine_wide > busy["vllm:spec_decode_num_drafts"], "no HTTP traffic was served during the call"


def test_generate_async_yields_each_sample_when_it_finishes(srv, tokenizer):
    """A 2-token request is handed out while a 60-token one is still running."""
    import ray

    w = srv.workers[0]
    p = tokenizer.encode("31415=")
    stream = w.generate_async.options(num_returns="streaming").remote(
        [p, p, p],
        [
            SamplingSettings(max_tokens=60, temperature=0.0),
            SamplingSettings(max_tokens=2, temperature=0.0),
            SamplingSettings(max_tokens=60, temperature=1.0, seed=7),
        ],
        10,
        [{"ignore_eos": True}, {}, {"ignore_eos": True}],
    )
    first_index, first = ray.get(next(stream), timeout=HTTP_TIMEOUT)
    still_running = ray.get(w.num_inflight.remote(), timeout=HTTP_TIMEOUT)
    rest = [ray.get(ref, timeout=HTTP_TIMEOUT) for ref in stream]
    assert first_index == 11 and len(first["token_ids"]) == 2 and first["finish_reason"] == "length"
    assert still_running == 2, "the short sample was held back until the long ones finished"
    assert sorted(i for i, _ in rest) == [10, 12]
    for _, s in rest:
        assert len(s["token_ids"]) == len(s["logprobs"]) == 60 and s["finish_reason"] == "length"


def test_iter_generate_covers_every_prompt_once(srv, task_prompts):
    got = dict(srv.iter_generate(task_prompts[:6], GREEDY))
    assert sorted(got) == list(range(6))
    batch = srv.generate(task_prompts[:6], GREEDY)
    assert [got[i]["token_ids"] for i in range(6)] == batch.token_ids
    # the long tail: each sample's finish time as it streamed back, inside its engine's call
    assert len(batch.finish_time_s) == 6
    assert all(0.0 < t <= max(batch.per_engine_time_s) for t in batch.finish_time_s), batch.finish_time_s
    assert min(batch.finish_time_s) < max(batch.finish_time_s)  # shorter answers came back first


# ---- the HTTP server: vLLM's OpenAI app with the RL contract ------------------------------------------


def test_models_endpoint(url):
    import httpx

    r = httpx.get(url + "/models", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL_NAME]


def test_64_concurrent_chat_requests_are_all_answered(srv, url, task_prompts, tokenizer):
    """Through the openai client; each answer carries its ids and log-probs, equal to the batch API's greedy output."""
    from openai import AsyncOpenAI

    prompts = [tokenizer.decode(p)[:-1] for p in task_prompts] * 4  # 64 chats; the template adds the "="

    async def main():
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT) as client:
            reqs = [
                client.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": p}], max_tokens=30, temperature=0
                )
                for p in prompts
            ]
            return await asyncio.wait_for(asyncio.gather(*reqs), timeout=4 * HTTP_TIMEOUT)

    responses = asyncio.run(main())
    assert len(responses) == 64
    want = srv.generate([tokenizer.encode(p + "=") for p in prompts], GREEDY).token_ids
    for r, p, w in zip(responses, prompts, want):
        m = r.choices[0].message.to_dict()
        assert m["prompt_token_ids"] == tokenizer.encode(p + "=")
        assert m["generation_token_ids"] == w, "HTTP greedy output differs from the batch API's"
        assert len(m["generation_log_probs"]) == len(w) and all(lp <= 0 for lp in m["generation_log_probs"])
        assert m["content"] == tokenizer.decode(w, skip_special_tokens=True)


def test_temperature_one_samples_through_the_server_follow_the_batch_api(srv, url, tokenizer):
    """400 samples through /v1/completions are distributed as 400 samples of the batch API (same engine)."""
    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            body = {
                "model": MODEL_NAME,
                "prompt": DIST_PROMPT,
                "max_tokens": DIST_TOKENS,
                "temperature": 1.0,
                "n": 8,
                "return_token_ids": True,
            }
            return await asyncio.wait_for(
                asyncio.gather(*(client.post(url + "/completions", json=body) for _ in range(DIST_SAMPLES // 8))),
                4 * HTTP_TIMEOUT,
            )

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    served = [c["token_ids"] for r in responses for c in r.json()["choices"]]
    assert len(served) == DIST_SAMPLES and responses[0].json()["choices"][0]["prompt_token_ids"] == tokenizer.encode(
        DIST_PROMPT
    )
    assert len({tuple(s) for s in served}) > DIST_SAMPLES // 4, (
        "the server's samples are not random (temperature ignored?)"
    )
    p, per_pos = position_test(dist_samples(srv, tokenizer, seed=5000), served)
    assert p > 1e-3, f"the server's samples differ from the batch API's (adjusted p={p:.2e}; per position {per_pos})"


def _stream_chat(url, body):
    """(content, token ids, log-probs, prompt ids, finish reason, usage) assembled from a streamed chat."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    text, ids, lps, prompt, finish, usage, chunks = "", [], [], None, None, None, 0
    for ch in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        d = ch.model_dump()
        chunks += 1
        prompt = prompt or d.get("prompt_token_ids")
        usage = d.get("usage") or usage
        for c in d["choices"]:
            text += c["delta"].get("content") or ""
            ids += c.get("token_ids") or []
            lps += [x["logprob"] for x in ((c.get("logprobs") or {}).get("content") or [])]
            finish = c.get("finish_reason") or finish
    return text, ids, lps, prompt, finish, usage, chunks


def test_streaming_chat_gives_what_the_full_response_gives(url):
    from openai import OpenAI

    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "9081726354"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    full = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT).chat.completions.create(**body)
    m = full.choices[0].message.to_dict()
    text, ids, lps, prompt, finish, usage, chunks = _stream_chat(url, body)
    assert chunks > 3, "not streamed"
    assert (text, ids, prompt, finish) == (
        m["content"],
        m["generation_token_ids"],
        m["prompt_token_ids"],
        full.choices[0].finish_reason,
    )
    assert len(lps) == len(ids) and usage["completion_tokens"] == len(ids)


def test_streaming_completions_give_what_the_full_response_gives(url):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    body = {
        "model": MODEL_NAME,
        "prompt": "9081726354=",
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    full = client.completions.create(**body).model_dump()["choices"][0]
    text, ids, per_chunk = "", [], []
    for ch in client.completions.create(**body, stream=True):
        for c in ch.model_dump()["choices"]:
            text += c.get("text") or ""
            ids += c.get("token_ids") or []
            per_chunk.append(len(c.get("token_ids") or []))
    assert text == full["text"] and ids == full["token_ids"] and len(ids) > 3
    # Streaming sends what each engine step emitted: a step emits at most k + 1 tokens per request
    # (k drafts and the bonus token), so there is at least one chunk per k + 1 tokens.
    k = SPEC_K
    assert max(per_chunk) <= k + 1 and sum(1 for n in per_chunk if n) >= -(-len(ids) // (k + 1)), per_chunk


def test_stop_strings(url, tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "9081726354"}], max_tokens=20, temperature=0, stop=["5"]
    )
    c = r.model_dump()["choices"][0]
    assert c["message"]["content"] == "01234" and c["finish_reason"] == "stop" and c["stop_reason"] == "5"
    # the ids run up to and include the stop string
    assert tokenizer.decode(c["message"]["generation_token_ids"]) == "012345"
    r = client.completions.create(model=MODEL_NAME, prompt="9081726354=", max_tokens=20, temperature=0, stop=["3"])
    assert r.choices[0].text == "012" and r.choices[0].finish_reason == "stop"


def test_structured_outputs_under_speculation(url):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    msgs = [{"role": "user", "content": "9081726354"}]
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 700, "maximum": 799}},
    }
    txt = (
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, seed=5, response_format=rf)
        .choices[0]
        .message.content
    )
    assert txt.isdigit() and 700 <= int(txt) <= 799, txt  # the sorted answer would start with 0
    txt = (
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=msgs,
            max_tokens=8,
            seed=5,
            extra_body={"structured_outputs": {"regex": "9[0-9]9"}},
        )
        .choices[0]
        .message.content
    )
    assert len(txt) == 3 and txt[0] == txt[2] == "9", txt


def test_three_turn_conversation_keeps_the_models_tokens(url, tokenizer):
    """Turn 1 ends with EOS, turn 2 stops at max_tokens. The client sends turn 1 back with its text
    cleared (as templates that drop earlier reasoning do: the re-rendered history gets shorter and
    every later position shifts). The final prompt must still start with exactly the tokens of every
    earlier turn; /tokenize of the same history gives the same spliced ids."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)

    def turn(messages, **kw):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **kw)
        msg = r.choices[0].message.to_dict()  # the extra fields come back with the message
        return msg, r.choices[0].finish_reason

    m1, f1 = turn([{"role": "user", "content": "31415"}], max_tokens=30)
    assert f1 == "stop" and m1["generation_token_ids"][-1] == tokenizer.eos_token_id
    assert m1["prompt_token_ids"] == tokenizer.encode("31415=")
    assert len(m1["generation_token_ids"]) > 1 and m1["content"]

    history = [{"role": "user", "content": "31415"}, dict(m1, content=""), {"role": "user", "content": "27"}]
    m2, f2 = turn(history, max_tokens=3)
    assert f2 == "length" and len(m2["generation_token_ids"]) == 3
    turn1 = m1["prompt_token_ids"] + m1["generation_token_ids"]
    assert m2["prompt_token_ids"] == turn1 + tokenizer.encode("27=")

    history += [m2, {"role": "user", "content": "9"}]
    m3, _ = turn(history, max_tokens=10)
    turn2 = m2["prompt_token_ids"] + m2["generation_token_ids"]
    final = m3["prompt_token_ids"]
    assert final[: len(turn1)] == turn1
    assert final[: len(turn2)] == turn2
    assert final[len(turn2)] == tokenizer.eos_token_id  # the template closes the truncated turn
    assert final[len(turn2) + 1 :] == tokenizer.encode("9=")
    root = url.removesuffix("/v1")
    t = httpx.post(
        root + "/tokenize",
        json={"model": MODEL_NAME, "messages": history, "add_generation_prompt": True},
        timeout=HTTP_TIMEOUT,
    )
    assert t.json()["tokens"] == final
    plain = [{"role": m["role"], "content": m["content"]} for m in history]  # without the ids: the template's rendering
    t = httpx.post(
        root + "/tokenize",
        json={"model": MODEL_NAME, "messages": plain, "add_generation_prompt": True},
        timeout=HTTP_TIMEOUT,
    )
    assert t.json()["tokens"] != final


def test_short_request_is_answered_while_a_long_one_runs(url):
    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            body = {"model": MODEL_NAME, "prompt": "31415=", "temperature": 0, "return_token_ids": True}
            long = asyncio.ensure_future(
                client.post(url + "/completions", json={**body, "max_tokens": 60, "ignore_eos": True})
            )
            await asyncio.sleep(0)  # the long request goes out first
            short = await client.post(url + "/completions", json={**body, "max_tokens": 2})
            long_done_first = long.done()
            long_r = await asyncio.wait_for(long, HTTP_TIMEOUT)
            return short, long_done_first, long_r

    short, long_done_first, long_r = asyncio.run(main())
    assert short.status_code == 200 and long_r.status_code == 200
    assert len(short.json()["choices"][0]["token_ids"]) == 2
    assert len(long_r.json()["choices"][0]["token_ids"]) == 60
    assert not long_done_first


UNKNOWN_FIELDS = [  # (path, body additions, the field the 400 must name)
    ("/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "zzz": 1}}, "stream_options.zzz"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "31", "foo": 1}]}, "messages[0].foo"),
    ("/completions", {"prompt": "31=", "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("path, extra, name", UNKNOWN_FIELDS)
def test_an_unknown_field_is_refused_with_its_name(url, path, extra, name):
    import httpx

    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "31"}], "max_tokens": 3, **extra}
    if path == "/completions":
        body.pop("messages")
    r = httpx.post(url + path, json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 400 and name in r.json()["error"]["message"], r.text


def test_the_openai_client_sees_unknown_and_unhonoured_fields_refused(url):
    """extra_body with a typo, and fields vLLM ignores under speculation; vLLM's own extras, top_k and
    echoed response-only message keys (null) are accepted."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    msgs = [{"role": "user", "content": "31"}]
    for extra, name in [({"top_kk": 5}, "top_kk"), ({"logit_bias": {"3": 5}}, "logit_bias"), ({"min_p": 0.2}, "min_p")]:
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=3, extra_body=extra)
    ok = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "31", "annotations": None}],
        max_tokens=5,
        temperature=1.0,
        extra_body={"top_k": 3, "min_tokens": 1, "repetition_penalty": 1.0},
    )
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.choices[0].message.to_dict()["generation_token_ids"]


BAD_REQUESTS = [
    ("/chat/completions", b"{not json", 400),
    ("/chat/completions", {"model": MODEL_NAME}, 400),  # no messages
    ("/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "1"}]}, 400),
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "system", "content": "1"}]},
        400,
    ),  # template refuses
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}], "temperature": "hot"},
        400,
    ),
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}], "logprobs": True, "top_logprobs": 50},
        400,
    ),
    ("/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "1"}]}, 404),
    (
        "/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [
                {"role": "user", "content": "1"},
                {"role": "assistant", "content": "1", "prompt_token_ids": [3, 12]},
                {"role": "user", "content": "2"},
            ],
        },
        400,
    ),
    (
        "/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [
                {"role": "user", "content": "1"},
                {"role": "assistant", "content": "1", "prompt_token_ids": [3, 12], "generation_token_ids": [3, 99999]},
                {"role": "user", "content": "2"},
            ],
        },
        400,
    ),
    ("/completions", {"model": MODEL_NAME, "prompt": 5}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": [3, 99]}, 400),  # not a token id of the model
    ("/completions", {"model": MODEL_NAME, "prompt": "1" * 200}, 400),  # longer than max_model_len
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "max_tokens": 500}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "max_tokens": 0}, 400),
]


def _client_errors(url: str) -> int:
    """4xx answers the app counted so far (vLLM's Prometheus middleware, /metrics)."""
    import httpx

    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=HTTP_TIMEOUT).text
    return sum(
        int(float(ln.rsplit(" ", 1)[1]))
        for ln in text.splitlines()
        if ln.startswith("http_requests_total{") and 'status="4xx"' in ln
    )


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(url):
    import httpx

    before = _client_errors(url)
    for path, body, status in BAD_REQUESTS:
        r = _post(url, path, body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        assert r.json()["error"]["message"], (path, body)
    r = httpx.post(url + "/nowhere", json={}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 404
    ok = _post(
        url,
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "31415"}], "max_tokens": 30, "temperature": 0},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert _client_errors(url) - before >= len(BAD_REQUESTS)


# ---- refit and lifecycle (last: changes the weights, then restores them) -------------------------------


def test_refit_changes_what_the_engine_generates(srv, toy, tokenizer):
    import torch
    from safetensors.torch import load_file

    prompts = [tokenizer.encode("31415="), tokenizer.encode("2718=")]
    original = load_file(str(toy.policy / "model.safetensors"))
    base = srv.generate(prompts, GREEDY).token_ids
    srv.update_weights({k: torch.zeros_like(v) for k, v in original.items()})
    zeroed = srv.generate(prompts, SamplingSettings(max_tokens=5, temperature=0.0)).token_ids
    assert zeroed == [[0] * 5, [0] * 5], "all-zero weights give all-zero logits: greedy picks token 0"
    srv.update_weights(original)
    assert srv.generate(prompts, GREEDY).token_ids == base
    srv.reset_prefix_cache()


def test_failed_async_start_leaves_nothing_behind(srv, toy):
    """As for the synchronous group: a failed start releases its actor and its placement group."""
    from rl_specdec.rollout.group import AsyncVllmGeneration

    kw = validate_vllm_kwargs({**CPU_VLLM_KWARGS, "max_model_len": 4096}, str(toy.policy))  # > the toy's 128 positions
    cfg = GenerationConfig(num_engines=1, cpus_per_engine=1, vllm_kwargs=kw, self_check=False)
    assert_failed_start_leaves_nothing(lambda: AsyncVllmGeneration(str(toy.policy), cfg), "AsyncVllmWorker")


def test_sleep_is_refused_on_cpu(srv):
    with pytest.raises(SleepNotSupported, match="cpu platform"):
        srv.sleep()
    with pytest.raises(SleepNotSupported):
        srv.wake_up()
