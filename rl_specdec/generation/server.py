"""vLLM's own OpenAI server, mounted on the ``AsyncLLM`` an engine actor already runs (vLLM 0.32).

The app is vLLM's (``build_app`` + ``init_app_state``), served by uvicorn on the
actor's event loop, loopback by default, on a free port: chat, completions,
streaming, stop strings, tools, structured outputs, ``/tokenize``, ``/metrics``.
Our glue is installed by swapping the classes of two objects of the app's state:

* ``RLOnlineRenderer`` (the app's one ``OnlineRenderer``): stateless on-policy
  splicing in ``preprocess_chat`` (:func:`~rl_specdec.generation.prefix.replace_prefix_tokens`),
  and a 400 naming any request field vLLM would drop or ignore;
* ``RLServingChat``: ``return_token_ids``/``logprobs`` on unless a request sets
  them, and ``prompt_token_ids``/``generation_token_ids``/``generation_log_probs``
  copied onto each returned assistant message, so the message goes back as is
  and splices.

:func:`check_vllm_hooks` fails when a vLLM upgrade moves what we override.
See docs/multi_turn.md for the options, the fields and why the splice sits where it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import inspect
import ipaddress
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from rl_specdec.errors import ConfigError, PrefixSpliceError
from rl_specdec.generation.prefix import replace_prefix_tokens

RL_MESSAGE_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@dataclass
class ServerConfig:
    """The ``server:`` settings of an async engine group (vLLM serve options that matter here)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (see base_url)
    allow_remote: bool = False  # bind a non-loopback host
    chat_template: str | None = None  # a Jinja string or a file; None: the tokenizer's
    served_model_name: str | None = None  # default: the model path
    tool_call_parser: str | None = None  # e.g. "hermes"
    enable_auto_tool_choice: bool = False  # tool_choice="auto" (needs tool_call_parser)
    reasoning_parser: str | None = None  # must match the engine's, if it has one
    api_key: str | None = None  # required on /v1 when set
    rl_defaults: bool = True  # return_token_ids/logprobs on unless a request sets them
    reject_unknown_fields: bool = True  # 400 on request fields vLLM's schema does not know
    log_tool_parse_errors: bool = False  # vLLM logs a traceback per malformed tool call; off: silenced
    extra_args: list[str] = field(default_factory=list)  # any other `vllm serve` flags, verbatim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ServerConfig":
        """From the ``server:`` mapping; an unknown key is a ``ConfigError`` that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"unknown server key(s) {bad}; known: {', '.join(sorted(known))}")
        cfg = cls(**d)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raise ``ConfigError`` naming the key and the fix on a bad setting (at load time, before any engine)."""
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        if not self.allow_remote and not _is_loopback(self.host):
            raise ConfigError(
                f"server.host {self.host!r} is not a loopback address; set server.allow_remote: true to serve other "
                "hosts, on a trusted network only (vLLM's app has routes that server.api_key does not guard)"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("server.enable_auto_tool_choice needs server.tool_call_parser (e.g. hermes)")
        tools = ToolParserManager.list_registered()
        if self.tool_call_parser and self.tool_call_parser not in tools:
            raise ConfigError(f"server.tool_call_parser {self.tool_call_parser!r} is not one of vLLM's: {', '.join(sorted(tools))}")
        reasoners = ReasoningParserManager.list_registered()
        if self.reasoning_parser and self.reasoning_parser not in reasoners:
            raise ConfigError(f"server.reasoning_parser {self.reasoning_parser!r} is not one of vLLM's: {', '.join(sorted(reasoners))}")
        t = self.chat_template
        if t is not None and not any(c in t for c in "{}\n") and not os.path.isfile(t):
            raise ConfigError(f"server.chat_template {t!r} is neither a Jinja template nor an existing file")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address("127.0.0.1" if host == "localhost" else host).is_loopback
    except ValueError:
        return False


def check_reasoning_parser(cfg: ServerConfig, engine_reasoning_parser: str | None) -> None:
    if cfg.reasoning_parser and engine_reasoning_parser and cfg.reasoning_parser != engine_reasoning_parser:
        raise ConfigError(
            f"server.reasoning_parser {cfg.reasoning_parser!r} differs from the engine's {engine_reasoning_parser!r} "
            "(vllm_kwargs.reasoning_parser); make them equal or leave server.reasoning_parser unset"
        )


def serve_args(model: str, cfg: ServerConfig, engine_reasoning_parser: str | None = None):
    """The ``argparse.Namespace`` that ``vllm serve`` would build for these settings (validated)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model, "--host", cfg.host, "--port", str(cfg.port)]
    argv += ["--disable-log-stats", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--disable-fastapi-docs"]
    if cfg.chat_template is not None:
        argv += ["--chat-template", cfg.chat_template]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.tool_call_parser:
        argv += ["--tool-call-parser", cfg.tool_call_parser]
    if cfg.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice"]
    if cfg.api_key:
        argv += ["--api-key", cfg.api_key]
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(argv + list(cfg.extra_args))
    if cfg.extra_args:  # engine flags there would be silently ignored: the engine is built already
        from vllm.engine.arg_utils import AsyncEngineArgs

        base, engine = parser.parse_args(argv), {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        changed = sorted(k for k, v in vars(args).items() if k in engine and v != getattr(base, k, None))
        if changed:
            raise ConfigError(f"server.extra_args sets engine arguments {changed}; put them in vllm_kwargs")
    # `vllm serve` sets this as a side effect of building the engine; here the engine exists already.
    check_reasoning_parser(cfg, engine_reasoning_parser)
    args.structured_outputs_config.reasoning_parser = cfg.reasoning_parser or engine_reasoning_parser or ""
    validate_parsed_serve_args(args)
    validate_api_server_args(args)
    return args


# ---- the hooks ---------------------------------------------------------------------------


def _rl_classes():
    """Build the subclasses on first use (importing this module does not import vLLM)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.online_renderer import OnlineRenderer

    class RLOnlineRenderer(OnlineRenderer):
        """The app's renderer, plus on-policy splicing and unknown-field rejection."""

        reject_unknown = True
        speculative = False  # the engine speculates: vLLM ignores min_p/logit_bias

        def _check_request(self, request):
            bad = unknown_fields(request) if self.reject_unknown else []
            if bad:
                raise VLLMValidationError(f"unknown request field(s): {', '.join(bad)} (not part of vLLM's request schema; remove them)", parameter=bad[0])
            for name, why in _unhonoured(request, self.speculative):
                raise VLLMValidationError(f"{name} is not supported by this engine: {why}", parameter=name)

        async def preprocess_chat(self, request, messages, *args, **kwargs):
            self._check_request(request)
            j = _spliced_turn(messages, VLLMValidationError)
            prefix = copy.deepcopy(list(messages[: j + 1])) if j is not None else None
            conversation, engine_inputs = await super().preprocess_chat(request, messages, *args, **kwargs)
            if j is None:
                return conversation, engine_inputs
            prefix_request = request.model_copy(update={"add_generation_prompt": False, "continue_final_message": False})
            _, (prefix_input,) = await super().preprocess_chat(prefix_request, prefix, *args, **kwargs)
            (engine_input,) = engine_inputs
            m = messages[j]
            try:
                ids = replace_prefix_tokens(
                    self.renderer.get_tokenizer(),
                    list(m["prompt_token_ids"]) + list(m["generation_token_ids"]),
                    prefix_input["prompt_token_ids"],
                    engine_input["prompt_token_ids"],
                )
            except PrefixSpliceError as e:
                raise VLLMValidationError(str(e), parameter=f"messages[{j}].generation_token_ids") from e
            self.renderer.validate_token_ids(ids, parameter=f"messages[{j}]")
            engine_input["prompt_token_ids"] = ids
            engine_input.pop("prompt_token_offsets", None)  # offsets into the template's text, no longer true
            if "prompt" in engine_input:  # the text that echo/return_prompt_text report
                engine_input["prompt"] = self.renderer.get_tokenizer().decode(ids)
            return conversation, engine_inputs

        async def preprocess_completion(self, request, *args, **kwargs):
            self._check_request(request)
            return await super().preprocess_completion(request, *args, **kwargs)

    class RLServingChat(OpenAIServingChat):
        """RL defaults on the request; the RL fields copied onto each returned message."""

        async def create_chat_completion(self, request, raw_request=None):
            given = request.model_fields_set
            if "return_token_ids" not in given:
                request.return_token_ids = True
            if "logprobs" not in given and "top_logprobs" not in given:
                request.logprobs = True
            return await super().create_chat_completion(request, raw_request)

        async def chat_completion_full_generator(self, request, *args, **kwargs):
            response = await super().chat_completion_full_generator(request, *args, **kwargs)
            if getattr(response, "prompt_token_ids", None) is None:
                return response  # an ErrorResponse, or return_token_ids=false
            for choice in response.choices:
                msg = choice.message
                msg.prompt_token_ids = response.prompt_token_ids
                msg.generation_token_ids = choice.token_ids
                if choice.logprobs is not None and choice.logprobs.content is not None:
                    msg.generation_log_probs = [c.logprob for c in choice.logprobs.content]
            return response

    return RLOnlineRenderer, RLServingChat


def _spliced_turn(messages: list[Any], error: type[Exception]) -> int | None:
    """Index of the last assistant message that carries its token ids, checked; None if none."""
    last = None
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        has = [m.get(k) is not None for k in RL_MESSAGE_FIELDS[:2]]
        if any(has) and not all(has):
            raise error(f"messages[{j}] carries only one of prompt_token_ids/generation_token_ids; send both or neither", parameter=f"messages[{j}]")
        if all(has):
            for k in RL_MESSAGE_FIELDS[:2]:
                v = m[k]
                if not isinstance(v, list) or not all(type(t) is int and t >= 0 for t in v):
                    raise error(f"messages[{j}].{k} must be a list of token ids", parameter=f"messages[{j}].{k}")
            last = j
    return last


@functools.lru_cache(maxsize=1)
def _message_keys() -> frozenset[str]:
    """Every key some chat message type of vLLM's request schema declares, plus ours."""
    import typing

    from vllm.renderers.chat_utils import ChatCompletionMessageParam

    keys: set[str] = set(RL_MESSAGE_FIELDS)
    for t in typing.get_args(ChatCompletionMessageParam):
        keys |= set(getattr(t, "__annotations__", {})) | set(getattr(t, "model_fields", {}))
    return frozenset(keys)


def unknown_fields(obj: Any, path: str = "") -> list[str]:
    """Dotted paths of the fields in a parsed request that its schema does not declare.

    vLLM's request models are ``extra="allow"`` (``OpenAIBaseModel``): an unknown field
    is kept in ``model_extra`` and otherwise ignored (logged at DEBUG). Messages are
    TypedDicts (kept whole); an unknown message key counts when its value is not None
    (clients echo response-only keys such as ``annotations: null``).
    """
    from pydantic import BaseModel

    found: list[str] = []
    if isinstance(obj, BaseModel):
        found += [f"{path}{k}" for k in (obj.model_extra or {})]
        for name, value in obj.__dict__.items():  # field values, without tripping deprecated-field warnings
            if name == "messages" and isinstance(value, list):
                allowed = _message_keys()
                found += [f"{path}messages[{i}].{k}" for i, m in enumerate(value) if isinstance(m, dict) for k in m if k not in allowed and m[k] is not None]
            elif isinstance(value, (BaseModel, list)):
                found += unknown_fields(value, f"{path}{name}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, BaseModel):
                found += unknown_fields(v, f"{path[:-1]}[{i}].")
    return found


def _unhonoured(request: Any, speculative: bool) -> list[tuple[str, str]]:
    """Schema fields this engine would silently ignore, with the reason."""
    if not speculative:
        return []
    out = []
    if getattr(request, "logit_bias", None):
        out.append(("logit_bias", "vLLM ignores it under speculative decoding (no logits processors in the rejection sampler)"))
    if (getattr(request, "min_p", None) or 0.0) > 0.0:
        out.append(("min_p", "vLLM ignores it under speculative decoding"))
    return out


def check_vllm_hooks() -> None:
    """Fail loudly if a vLLM upgrade moved what this module overrides (call at start-up and in a test)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.renderers.online_renderer import OnlineRenderer

    expected = {
        (OnlineRenderer, "preprocess_chat"): ["self", "request", "messages", "default_template", "default_template_content_format", "default_template_kwargs", "tool_dicts", "parser", "skip_mm_cache"],
        (OnlineRenderer, "preprocess_completion"): ["self", "request", "prompt_input", "prompt_embeds", "skip_mm_cache"],
        (OpenAIServingChat, "create_chat_completion"): ["self", "request", "raw_request"],
        (OpenAIServingChat, "chat_completion_full_generator"): ["self", "request", "result_generator", "request_id", "model_name", "conversation", "tokenizer", "request_metadata", "parser", "mm_token_counts"],
    }
    for (cls, name), params in expected.items():
        fn = getattr(cls, name, None)
        got = list(inspect.signature(fn).parameters) if fn is not None else None
        if got != params or not inspect.iscoroutinefunction(fn):
            raise RuntimeError(f"vLLM moved {cls.__name__}.{name}: expected async ({', '.join(params)}), found {got}; update rl_specdec/generation/server.py")


def install_rl_hooks(state: Any, cfg: ServerConfig) -> None:
    """Swap the classes of the app's renderer and chat handler for ours (same objects, so every holder sees them)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.renderers.online_renderer import OnlineRenderer

    check_vllm_hooks()
    RLOnlineRenderer, RLServingChat = _rl_classes()
    renderer = state.online_renderer
    if type(renderer) is not OnlineRenderer or type(state.openai_serving_chat) is not OpenAIServingChat:
        raise RuntimeError(f"unexpected app state: {type(renderer)}, {type(state.openai_serving_chat)}")
    for name, obj in state._state.items():  # every handler must render through the one renderer
        held = getattr(obj, "online_renderer", None)
        if held is not None and held is not renderer:
            raise RuntimeError(f"app.state.{name} holds its own OnlineRenderer; the splice would not reach it")
    renderer.__class__ = RLOnlineRenderer
    renderer.reject_unknown = cfg.reject_unknown_fields
    renderer.speculative = state.vllm_config.speculative_config is not None
    if cfg.rl_defaults:
        state.openai_serving_chat.__class__ = RLServingChat


# ---- serving on the running event loop -----------------------------------------------------


@dataclass
class RunningServer:
    base_url: str
    server: Any  # uvicorn server
    task: asyncio.Task
    app: Any
    start_s: float = 0.0  # building the app + state + serving, on a running engine

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish open responses (up to ``timeout``), close the socket. The engine stays."""
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        if not self.task.done():
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


async def start_openai_server(engine: Any, cfg: ServerConfig, start_timeout: float = 60.0) -> RunningServer:
    """Mount vLLM's OpenAI app on ``engine`` (a running ``AsyncLLM``) and serve it on this event loop."""
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import NoSignalServer, create_server_socket

    t0 = time.monotonic()
    cfg.check()
    if not cfg.log_tool_parse_errors:  # a malformed call comes back as content; vLLM also logs a traceback
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
    reasoning = engine.vllm_config.structured_outputs_config.reasoning_parser or None
    args = serve_args(engine.model_config.model, cfg, reasoning)
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    install_rl_hooks(app.state, cfg)

    sock = create_server_socket((cfg.host, cfg.port), reuse_port=False)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30, backlog=2048)
    server = NoSignalServer(config)  # the host process (a Ray actor) owns its signals
    app.state.server = server  # vLLM's engine-dead handler stops the server through it
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the HTTP server stopped during start-up")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the HTTP server did not start within {start_timeout:.0f}s")
        await asyncio.sleep(0.02)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    return RunningServer(base_url=f"http://{host}:{port}/v1", server=server, task=task, app=app, start_s=time.monotonic() - t0)
