"""The async engine and vLLM's OpenAI server mounted on it, end to end on the digit toy: the engine side.

One async engine (draft_model speculation, k=3, probabilistic drafting) with
its HTTP server (tests/openai_server.py) is started for the whole module and
shared by every test; requests go through the real ``openai`` client where a
client would use it. The wire protocol (streaming, stop strings, structured
outputs, turns, refused fields, malformed bodies) is in tests/test_openai_wire.py.
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
    assert_failed_start_leaves_nothing,
    dist_samples,
    position_test,
)
from openai_server import HTTP_TIMEOUT, MODEL_NAME, base_url, start_server
from rl_specdec.config import GenerationConfig, validate_vllm_kwargs
from rl_specdec.errors import SleepNotSupported
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.metrics.counters import NAMES
from rl_specdec.rollout import SamplingSettings

pytestmark = pytest.mark.integration

GREEDY = SamplingSettings(max_tokens=30, temperature=0.0)


@pytest.fixture(scope="module")
def srv(request, local_ray, toy):
    return start_server(request, toy)


@pytest.fixture(scope="module")
def url(srv):
    return base_url(srv)


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
