"""vLLM's own OpenAI app, mounted on a running ``AsyncLLM``, with rl_specdec's hooks (vLLM 0.32).

The app is vLLM's (``build_app`` + ``init_app_state``); our glue is installed by
swapping the classes of two objects of the app's state:

* ``RLOnlineRenderer`` (the app's one ``OnlineRenderer``): stateless on-policy
  splicing in ``preprocess_chat`` (the ``splice`` function the caller passes:
  :func:`~rl_specdec.rollout.serving.prefix.replace_prefix_tokens`), and a 400
  naming any request field vLLM would drop or ignore;
* ``RLServingChat``: ``return_token_ids``/``logprobs`` on unless a request sets
  them, and ``prompt_token_ids``/``generation_token_ids``/``generation_log_probs``
  copied onto each returned assistant message, so the message goes back as is
  and splices;
* :func:`quiet_client_errors`: vLLM's own log lines for a client's mistake go
  down to DEBUG (the server's request log restates each 4xx at INFO).

:func:`check_vllm_hooks` (a probe of :mod:`rl_specdec.vllm_ext`) fails when a
vLLM upgrade moves what we override. See docs/multi_turn.md for why the splice
sits where it does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable

from rl_specdec.errors import ConfigError, PrefixSpliceError

RL_MESSAGE_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def serve_args(model: str, cfg: Any, engine_reasoning_parser: str | None = None):
    """The ``argparse.Namespace`` that ``vllm serve`` would build for ``cfg`` (a ``ServerConfig``), validated."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model, "--host", cfg.host, "--port", str(cfg.port)]
    argv += [
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        "--disable-fastapi-docs",
    ]
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
    args.structured_outputs_config.reasoning_parser = cfg.reasoning_parser or engine_reasoning_parser or ""
    validate_parsed_serve_args(args)
    validate_api_server_args(args)
    return args


# ---- the hooks ---------------------------------------------------------------------------


def _rl_classes(splice: Callable[..., list[int]]):
    """Build the subclasses on first use (importing this module does not import vLLM); ``splice`` is the
    on-policy splice (model prefix ids, template prefix ids, template ids -> prompt ids)."""
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
                raise VLLMValidationError(
                    f"unknown request field(s): {', '.join(bad)} (not part of vLLM's request schema; remove them)",
                    parameter=bad[0],
                )
            for name, why in _unhonoured(request, self.speculative):
                raise VLLMValidationError(f"{name} is not supported by this engine: {why}", parameter=name)

        async def preprocess_chat(self, request, messages, *args, **kwargs):
            self._check_request(request)
            j = _spliced_turn(messages, VLLMValidationError)
            prefix = copy.deepcopy(list(messages[: j + 1])) if j is not None else None
            conversation, engine_inputs = await super().preprocess_chat(request, messages, *args, **kwargs)
            if j is None:
                return conversation, engine_inputs
            prefix_request = request.model_copy(
                update={"add_generation_prompt": False, "continue_final_message": False}
            )
            _, (prefix_input,) = await super().preprocess_chat(prefix_request, prefix, *args, **kwargs)
            (engine_input,) = engine_inputs
            m = messages[j]
            try:
                ids = splice(
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
            raise error(
                f"messages[{j}] carries only one of prompt_token_ids/generation_token_ids; send both or neither",
                parameter=f"messages[{j}]",
            )
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
                found += [
                    f"{path}messages[{i}].{k}"
                    for i, m in enumerate(value)
                    if isinstance(m, dict)
                    for k in m
                    if k not in allowed and m[k] is not None
                ]
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
        out.append(
            ("logit_bias", "vLLM ignores it under speculative decoding (no logits processors in the rejection sampler)")
        )
    if (getattr(request, "min_p", None) or 0.0) > 0.0:
        out.append(("min_p", "vLLM ignores it under speculative decoding"))
    return out


def check_vllm_hooks() -> None:
    """Fail loudly if a vLLM upgrade moved what this module overrides (call at start-up and in a test)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.renderers.online_renderer import OnlineRenderer

    expected = {
        (OnlineRenderer, "preprocess_chat"): [
            "self",
            "request",
            "messages",
            "default_template",
            "default_template_content_format",
            "default_template_kwargs",
            "tool_dicts",
            "parser",
            "skip_mm_cache",
        ],
        (OnlineRenderer, "preprocess_completion"): [
            "self",
            "request",
            "prompt_input",
            "prompt_embeds",
            "skip_mm_cache",
        ],
        (OpenAIServingChat, "create_chat_completion"): ["self", "request", "raw_request"],
        (OpenAIServingChat, "chat_completion_full_generator"): [
            "self",
            "request",
            "result_generator",
            "request_id",
            "model_name",
            "conversation",
            "tokenizer",
            "request_metadata",
            "parser",
            "mm_token_counts",
        ],
    }
    for (cls, name), params in expected.items():
        fn = getattr(cls, name, None)
        got = list(inspect.signature(fn).parameters) if fn is not None else None
        if got != params or not inspect.iscoroutinefunction(fn):
            raise RuntimeError(
                f"vLLM moved {cls.__name__}.{name}: expected async ({', '.join(params)}), found {got}; "
                "update rl_specdec/vllm_ext/openai_app.py"
            )


def install_rl_hooks(state: Any, cfg: Any, splice: Callable[..., list[int]]) -> None:
    """Swap the classes of the app's renderer and chat handler for ours (same objects, so every holder sees them)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.renderers.online_renderer import OnlineRenderer

    check_vllm_hooks()
    RLOnlineRenderer, RLServingChat = _rl_classes(splice)
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


async def build_app(engine: Any, cfg: Any, splice: Callable[..., list[int]], wrap: Callable[[Any], Any] | None = None):
    """vLLM's OpenAI app on ``engine`` (a running ``AsyncLLM``) with our hooks, and its listening socket.

    Returns ``(app, uvicorn server, socket)``; the caller serves it on its own event loop. ``wrap``: an ASGI
    wrapper the server runs around the whole app (the request log).
    """
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app as vllm_build_app
    from vllm.entrypoints.launchers.launcher import NoSignalServer, create_server_socket

    reasoning = engine.vllm_config.structured_outputs_config.reasoning_parser or None
    args = serve_args(engine.model_config.model, cfg, reasoning)
    tasks = await engine.get_supported_tasks()
    app = vllm_build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    install_rl_hooks(app.state, cfg, splice)
    sock = create_server_socket((cfg.host, cfg.port), reuse_port=False)
    config = uvicorn.Config(
        wrap(app) if wrap else app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        backlog=2048,
    )
    server = NoSignalServer(config)  # the host process (a Ray actor) owns its signals
    app.state.server = server  # vLLM's engine-dead handler stops the server through it
    return app, server, sock


# vLLM's own lines for a client's mistake, which the server's request log restates at INFO with the request id:
# (logger = module, format string, the function of that module that logs it). quiet_client_errors() makes them DEBUG.
CLIENT_ERROR_LINES = (
    ("vllm.entrypoints.openai.chat_completion.serving", "Error with model %s", "OpenAIServingChat.render_chat_request"),
    ("vllm.renderers.hf", "Chat template rejected the request: %s", "safe_apply_chat_template"),
)


class _ClientErrorsToDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if (record.name, record.msg) in {(name, msg) for name, msg, _ in CLIENT_ERROR_LINES}:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def quiet_client_errors() -> None:
    """vLLM's ERROR for an unknown model and WARNING for a chat template's refusal (both 4xx) become DEBUG."""
    _probe_client_error_lines()
    for name, _, _ in CLIENT_ERROR_LINES:
        if not any(isinstance(f, _ClientErrorsToDebug) for f in logging.getLogger(name).filters):
            logging.getLogger(name).addFilter(_ClientErrorsToDebug())


def _probe_client_error_lines() -> None:
    import importlib

    for name, msg, where in CLIENT_ERROR_LINES:
        module = importlib.import_module(name)
        code = inspect.getsource(functools.reduce(getattr, where.split("."), module))
        if getattr(module, "logger", None) is None or module.logger.name != name or f'"{msg}"' not in code:
            raise RuntimeError(f"vLLM no longer logs {msg!r} in {name}.{where}; update CLIENT_ERROR_LINES")


def _probe_launcher() -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app as vllm_build_app
    from vllm.entrypoints.launchers.launcher import NoSignalServer, create_server_socket

    for fn in (init_app_state, vllm_build_app, NoSignalServer, create_server_socket):
        if not callable(fn):
            raise RuntimeError(f"{fn!r} is not callable")


def _probe_serve_args() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args  # noqa: F401
    from vllm.entrypoints.launchers.launcher import validate_api_server_args  # noqa: F401
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: F401


PROBES = {
    "OnlineRenderer / OpenAIServingChat overrides": check_vllm_hooks,
    "api_server app and launcher": _probe_launcher,
    "serve argument parser": _probe_serve_args,
    "client-error log lines": _probe_client_error_lines,
}
