"""The server glue without an engine (seconds): the vLLM hooks it relies on, its config, its field checks.

A vLLM upgrade that moves what rl_specdec/vllm_ext/openai_app.py overrides must
fail here, before any engine test runs. The behaviour through a running
server is tested in test_multiturn.py and test_openai_wire.py (digit toy) and test_agent.py (tools).
"""

from __future__ import annotations

import pytest

from rl_specdec.config.serving import ServerConfig, check_reasoning_parser
from rl_specdec.errors import ConfigError
from rl_specdec.vllm_ext import openai_app as srv


def test_hooks_are_where_we_expect_them():
    """OnlineRenderer.preprocess_chat/_completion and OpenAIServingChat's two methods have the signatures we
    override."""
    from rl_specdec import vllm_ext

    vllm_ext.probe_failures.cache_clear()
    assert vllm_ext.probe_failures("server") == ()


def test_hook_check_fails_when_a_hook_moves(monkeypatch):
    from vllm.renderers.online_renderer import OnlineRenderer

    async def moved(self, request, messages, template):  # a different signature
        pass

    monkeypatch.setattr(OnlineRenderer, "preprocess_chat", moved)
    with pytest.raises(RuntimeError, match="vLLM moved OnlineRenderer.preprocess_chat"):
        srv.check_vllm_hooks()


def test_hook_check_fails_when_a_hook_is_no_longer_a_coroutine(monkeypatch):
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    def sync(self, request, raw_request=None):
        pass

    monkeypatch.setattr(OpenAIServingChat, "create_chat_completion", sync)
    with pytest.raises(RuntimeError, match="vLLM moved OpenAIServingChat.create_chat_completion"):
        srv.check_vllm_hooks()


def test_app_state_wires_one_renderer_into_every_handler():
    """init_app_state builds one OnlineRenderer and hands it to chat, completions and tokenize (read from
    source, since building the state needs an engine): the class swap relies on that. At start-up
    install_rl_hooks checks the same on the real state."""
    import inspect

    from vllm.entrypoints.generate import api_router
    from vllm.entrypoints.launchers.api_server import app_state

    src = inspect.getsource(app_state.init_app_state)
    assert src.count("OnlineRenderer(") == 1 and "state.online_renderer = OnlineRenderer(" in src
    assert "online_renderer=state.online_renderer" in inspect.getsource(api_router.init_generate_state)


def test_rl_fields_survive_vllm_request_schema():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    m = {
        "role": "assistant",
        "content": "12",
        "prompt_token_ids": [5, 3],
        "generation_token_ids": [3, 1],
        "generation_log_probs": [-0.1, -0.2],
    }
    r = ChatCompletionRequest.model_validate({"model": "x", "messages": [{"role": "user", "content": "21"}, m]})
    assert r.messages[1] == m  # TypedDict messages keep unknown keys whole


def test_unknown_fields_are_found_with_their_paths():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    r = ChatCompletionRequest.model_validate(
        {
            "model": "x",
            "stream": True,
            "stream_options": {"include_usage": True, "zzz": 1},
            "frob": 1,
            "messages": [
                {"role": "user", "content": "1", "foo": 2, "annotations": None},
                {"role": "assistant", "content": "2", "prompt_token_ids": [1], "generation_token_ids": [2]},
            ],
        }
    )
    assert sorted(srv.unknown_fields(r)) == ["frob", "messages[0].foo", "stream_options.zzz"]
    ok = ChatCompletionRequest.model_validate(
        {"model": "x", "messages": [{"role": "user", "content": "1"}], "top_k": 5, "return_token_ids": True}
    )
    assert srv.unknown_fields(ok) == []
    assert srv.unknown_fields(CompletionRequest.model_validate({"model": "x", "prompt": "1", "frob": 1})) == ["frob"]


def test_tools_with_strict_are_known():
    """The openai client sends function.strict (pydantic_function_tool); it must not be refused."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    r = ChatCompletionRequest.model_validate(
        {"model": "x", "messages": [{"role": "user", "content": "1"}], "tools": [tool]}
    )
    assert srv.unknown_fields(r) == []


def test_a_half_token_record_is_refused():
    class Refused(Exception):
        def __init__(self, msg, parameter):
            super().__init__(msg)
            self.parameter = parameter

    user = {"role": "user", "content": "1"}
    with pytest.raises(Refused, match="only one of") as e:
        srv._spliced_turn([user, {"role": "assistant", "content": "2", "generation_token_ids": [3]}], Refused)
    assert e.value.parameter == "messages[1]"
    with pytest.raises(Refused, match="list of token ids"):
        srv._spliced_turn([user, {"role": "assistant", "prompt_token_ids": [1], "generation_token_ids": [-3]}], Refused)
    both = {"role": "assistant", "prompt_token_ids": [1], "generation_token_ids": [2]}
    assert srv._spliced_turn([user, both, user, {"role": "assistant", "content": "x"}, user], Refused) == 1
    assert srv._spliced_turn([user], Refused) is None


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"host": "0.0.0.0"}, "server.allow_remote"),
        ({"enable_auto_tool_choice": True}, "needs server.tool_call_parser"),
        ({"tool_call_parser": "hermez"}, "server.tool_call_parser 'hermez' is not one of vLLM's"),
        ({"reasoning_parser": "nope"}, "server.reasoning_parser 'nope' is not one of vLLM's"),
        ({"chat_template": "/no/such/file.jinja"}, "neither a Jinja template nor an existing file"),
        ({"chat_tempate": "{{ x }}"}, r"unknown server key\(s\) \['chat_tempate'\]"),
    ],
)
def test_server_config_errors_name_the_key(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ServerConfig.from_dict(kw)


def test_server_binds_loopback_only_by_default():
    for host in ("127.0.0.1", "localhost", "::1"):
        assert ServerConfig(host=host).check() is None
    for host in ("0.0.0.0", "192.168.1.5", "::", "example.org"):
        with pytest.raises(ConfigError, match=f"server.host '{host}' is not a loopback address.*allow_remote"):
            ServerConfig(host=host).check()
    assert ServerConfig(host="0.0.0.0", allow_remote=True).check() is None


def test_serve_args():
    cfg = ServerConfig(
        chat_template="{{ messages }}",
        served_model_name="toy",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        api_key="k",
    )
    cfg.check()
    a = srv.serve_args("/m", cfg)
    assert (
        a.served_model_name == ["toy"]
        and a.tool_call_parser == "hermes"
        and a.enable_auto_tool_choice
        and a.api_key == ["k"]
    )
    assert a.model == "/m" and a.disable_log_stats and a.chat_template == "{{ messages }}"
    with pytest.raises(ConfigError, match="differs from the engine"):
        check_reasoning_parser(ServerConfig(reasoning_parser="deepseek_r1"), "qwen3")


def test_group_refuses_a_reasoning_parser_that_differs_from_the_engines():
    """Before any actor starts (no Ray needed: the check comes first)."""
    from rl_specdec.config import GenerationConfig
    from rl_specdec.rollout.group import AsyncVllmGeneration

    cfg = GenerationConfig(
        num_engines=1, cpus_per_engine=1, vllm_kwargs={"reasoning_parser": "qwen3"}, self_check=False
    )
    with pytest.raises(ConfigError, match="server.reasoning_parser 'deepseek_r1' differs"):
        AsyncVllmGeneration("/no/model", cfg, server={"reasoning_parser": "deepseek_r1"})


def test_extra_args_refuse_engine_flags():
    assert srv.serve_args("/m", ServerConfig(extra_args=["--return-tokens-as-token-ids"])).return_tokens_as_token_ids
    with pytest.raises(ConfigError, match="sets engine arguments"):
        srv.serve_args("/m", ServerConfig(extra_args=["--max-model-len", "64"]))


def test_fields_vllm_ignores_under_speculation_are_refused():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    base = {"model": "x", "messages": [{"role": "user", "content": "1"}]}
    r = ChatCompletionRequest.model_validate({**base, "logit_bias": {"3": 5}, "min_p": 0.1, "top_k": 5})
    assert [n for n, _ in srv._unhonoured(r, speculative=True)] == ["logit_bias", "min_p"]  # top_k works (cpu_patches)
    assert srv._unhonoured(r, speculative=False) == []
