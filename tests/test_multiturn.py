"""The async engine and its OpenAI-compatible server, end to end on the toy models.

One async engine (draft_model speculation, k=3, probabilistic drafting) with
its HTTP server is started for the whole module and shared by every test.
Request loops are bounded in count and in time (client timeouts); nothing
here asserts a duration.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import CPU_VLLM_KWARGS, HOST_CORES, assert_failed_start_leaves_nothing, draft_spec
from rl_specdec.generation import GenerationConfig, SamplingSettings, validate_vllm_kwargs
from rl_specdec.errors import SleepNotSupported
from rl_specdec.spec_decode import compute_spec_decode_metrics
from rl_specdec.spec_decode.counters import NAMES
from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE

pytestmark = pytest.mark.integration

MODEL_NAME = "toy-policy"
HTTP_TIMEOUT = 120.0  # per request, seconds: a bound, not an assertion
GREEDY = SamplingSettings(max_tokens=30, temperature=0.0)


@pytest.fixture(scope="module")
def srv(request, local_ray, toy):
    from rl_specdec.generation.group import AsyncVllmGeneration

    kw = validate_vllm_kwargs({**CPU_VLLM_KWARGS, "speculative_config": draft_spec(toy.drafter)}, str(toy.policy))
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
        [SamplingSettings(max_tokens=60, temperature=0.0), SamplingSettings(max_tokens=2, temperature=0.0), SamplingSettings(max_tokens=60, temperature=1.0, seed=7)],
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


# ---- the HTTP server ------------------------------------------------------------------------------


def test_models_endpoint(url):
    import httpx

    r = httpx.get(url + "/models", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL_NAME]


def test_32_concurrent_requests_are_all_answered(srv, url, task_prompts, tokenizer):
    import httpx

    prompts = [tokenizer.decode(p) for p in task_prompts] * 2  # 32 "digits=" prompts

    async def main():
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=httpx.Limits(max_connections=64)) as client:
            reqs = [
                client.post(url + "/completions", json={"model": MODEL_NAME, "prompt": p, "max_tokens": 30, "temperature": 0})
                for p in prompts
            ]
            return await asyncio.wait_for(asyncio.gather(*reqs), timeout=4 * HTTP_TIMEOUT)

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 32
    want = srv.generate([tokenizer.encode(p) for p in prompts], GREEDY).token_ids
    for r, p, w in zip(responses, prompts, want):
        (c,) = r.json()["choices"]
        assert c["prompt_token_ids"] == tokenizer.encode(p)
        assert c["generation_token_ids"] == w, "HTTP greedy output differs from the batch API's"
        assert len(c["generation_log_probs"]) == len(w) and all(lp <= 0 for lp in c["generation_log_probs"])


def test_three_turn_conversation_keeps_the_models_tokens(url, tokenizer):
    """Turn 1 ends with EOS, turn 2 stops at max_tokens. The client sends turn 1 back with its text
    cleared (as templates that drop earlier reasoning do: the re-rendered history gets shorter and
    every later position shifts). The final prompt must still start with exactly the tokens of every
    earlier turn."""
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


def test_short_request_is_answered_while_a_long_one_runs(url):
    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            body = {"model": MODEL_NAME, "prompt": "31415=", "temperature": 0}
            long = asyncio.ensure_future(client.post(url + "/completions", json={**body, "max_tokens": 60, "ignore_eos": True}))
            await asyncio.sleep(0)  # the long request goes out first
            short = await client.post(url + "/completions", json={**body, "max_tokens": 2})
            long_done_first = long.done()
            long_r = await asyncio.wait_for(long, HTTP_TIMEOUT)
            return short, long_done_first, long_r

    short, long_done_first, long_r = asyncio.run(main())
    assert short.status_code == 200 and long_r.status_code == 200
    assert len(short.json()["choices"][0]["generation_token_ids"]) == 2
    assert len(long_r.json()["choices"][0]["generation_token_ids"]) == 60
    assert not long_done_first


BAD_REQUESTS = [
    ("/chat/completions", b"{not json", 400),
    ("/chat/completions", {"model": MODEL_NAME}, 400),  # no messages
    ("/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
    ("/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "1"}]}, 400),
    ("/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "system", "content": "1"}]}, 400),  # template refuses
    ("/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}], "temperature": "hot"}, 400),
    ("/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}], "stream": True}, 400),
    ("/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "1"}]}, 404),
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "1", "prompt_token_ids": [3, 12]}, {"role": "user", "content": "2"}]},
        400,
    ),
    ("/completions", {"model": MODEL_NAME, "prompt": 5}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": [3, 99]}, 400),  # not a token id of the model
    ("/completions", {"model": MODEL_NAME, "prompt": "1" * 200}, 400),  # longer than max_model_len
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "max_tokens": 500}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "max_tokens": 0}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "stop": ["5"]}, 400),
]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(srv, url):
    import httpx
    import ray

    before = ray.get(srv.workers[0].server_stats.remote(), timeout=HTTP_TIMEOUT)
    for path, body, status in BAD_REQUESTS:
        r = _post(url, path, body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        assert r.json()["error"]["message"], (path, body)
    r = httpx.post(url + "/nowhere", json={}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 404
    ok = _post(url, "/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "31415"}], "max_tokens": 30, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    after = ray.get(srv.workers[0].server_stats.remote(), timeout=HTTP_TIMEOUT)
    assert after["num_errors"] - before["num_errors"] == len(BAD_REQUESTS)


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
    from rl_specdec.generation.group import AsyncVllmGeneration

    kw = validate_vllm_kwargs({**CPU_VLLM_KWARGS, "max_model_len": 4096}, str(toy.policy))  # > the toy's 128 positions
    cfg = GenerationConfig(num_engines=1, cpus_per_engine=1, vllm_kwargs=kw, self_check=False)
    assert_failed_start_leaves_nothing(lambda: AsyncVllmGeneration(str(toy.policy), cfg), "AsyncVllmWorker")


def test_sleep_is_refused_on_cpu(srv):
    with pytest.raises(SleepNotSupported, match="cpu platform"):
        srv.sleep()
    with pytest.raises(SleepNotSupported):
        srv.wake_up()
