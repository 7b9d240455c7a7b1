"""The server engine the OpenAI-server tests share: one async engine (draft_model, k=SPEC_K, probabilistic
drafting) with vLLM's OpenAI app on the toy policy, and a raw-HTTP helper. Not a test module: the modules that
start it (tests/test_multiturn.py, tests/test_openai_wire.py) each hold one for their tests."""

from __future__ import annotations

from conftest import CPU_VLLM_KWARGS, HOST_CORES, draft_spec
from rl_specdec.config import GenerationConfig, validate_vllm_kwargs
from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE

MODEL_NAME = "toy-policy"
HTTP_TIMEOUT = 120.0  # per request, seconds: a bound, not an assertion
SPEC_K = 3  # the server engine's drafted tokens per step


def start_server(request, toy):
    """The server engine, shut down when the requesting (module-scoped) fixture ends."""
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


def base_url(srv) -> str:
    (u,) = srv.base_urls()
    assert u.startswith("http://127.0.0.1:") and u.endswith("/v1")
    return u


def post(url: str, path: str, body, timeout: float = HTTP_TIMEOUT):
    import httpx

    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)
