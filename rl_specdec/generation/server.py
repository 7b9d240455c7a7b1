"""A small OpenAI-compatible HTTP server in front of one async vLLM engine.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /health``. The server runs on the
engine actor's own event loop (:class:`~rl_specdec.generation.async_worker.AsyncVllmWorker`
starts it), binds a loopback address by default, and takes a free port that
the worker reports (``report_base_url()``).

What an RL trainer needs beyond the OpenAI schema, on every choice of every
response (on the ``message`` for chat, so it travels back with the history):

* ``prompt_token_ids``: the exact ids the engine was prompted with;
* ``generation_token_ids``: the ids it generated (final EOS included when it stopped on one);
* ``generation_log_probs``: the log-prob of each generated id under the policy.

Multi-turn token splicing (stateless): when a chat request's ``messages``
contain an assistant message that carries ``prompt_token_ids`` and
``generation_token_ids`` (the server put them there; OpenAI clients keep
unknown fields when the message is sent back as a dict), the server renders
the history with the chat template as usual and then replaces the rendered
prefix up to the end of the *last such* assistant turn with those exact ids
(:func:`~rl_specdec.generation.prefix.replace_prefix_tokens`). The new prompt
therefore starts with every token of the previous turns, and a whole
conversation is one monotonic token sequence. Nothing is stored on the
server, so any engine of a group can serve any turn.

Why not vLLM's own OpenAI server: in vLLM 0.32 it is built for its own
process (an argparse namespace, app state, a renderer pipeline), and splicing
tokens into a chat prompt means overriding internals of its chat serving
class that change between releases. This module uses only AsyncLLM's public
``generate`` and keeps the wire format of the fields it supports.

Errors: a malformed request (bad JSON, a wrong type, an unknown model, a
prompt longer than the context, a template that fails) gets a 4xx with an
OpenAI-style ``{"error": {"message", "type", "code"}}`` body; the server keeps
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field

from rl_specdec.errors import PrefixSpliceError
from rl_specdec.generation.prefix import replace_prefix_tokens

logger = logging.getLogger(__name__)

MAX_N = 64
MAX_TOP_LOGPROBS = 20

@dataclass
class ServerConfig:
    """Settings of the per-engine HTTP server."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, reported by the worker's report_base_url()
    chat_template: str | None = None  # a Jinja chat template; None: the tokenizer's own
    served_model_name: str | None = None  # the name /v1/models lists; default: the model path
    default_max_tokens: int | None = None  # when a request gives none; None: the rest of the context
    allow_remote: bool = False  # bind a non-loopback address (reachable from other hosts)

    def check(self) -> None:
        if self.allow_remote:
            return
        host = "127.0.0.1" if self.host == "localhost" else self.host
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"server host {self.host!r} is not a loopback address; the server has no authentication, so it "
                "binds 127.0.0.1 by default. Set allow_remote=True to serve other hosts (e.g. environments on "
                "other nodes of a Ray cluster), on a trusted network only."
            )


class ServerBackend(Protocol):
    """What the server needs from an engine (the async worker implements it)."""

    model_name: str
    tokenizer: Any
    max_model_len: int

    async def generate_tokens(self, prompt_token_ids: list[int], params: dict[str, Any]) -> list[dict[str, Any]]:
        """One dict per sample (``params["n"]``): token_ids, logprobs, finish_reason, top_logprobs."""
        ...


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.type = type_


# ---- request schema ------------------------------------------------------------------


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # extension (vLLM): -1 is off
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)

class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # set by this server on assistant messages; sent back to continue a conversation on-policy
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"only text content parts are supported, got {p.get('type')!r}")
            parts.append(p["text"])
        return "".join(parts)

class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False



# ---- helpers --------------------------------------------------------------------------


def _sampling_params(req, prompt_len: int, backend: ServerBackend, cfg: ServerConfig, num_logprobs: int) -> dict[str, Any]:
    if req.stream:
        raise RequestError("stream=true is not supported by this server; send stream=false")
    if req.stop:
        raise RequestError("stop strings are not supported (the engine does not detokenize); use stop_token_ids")
    room = backend.max_model_len - prompt_len
    if room < 1:
        raise RequestError(f"the prompt has {prompt_len} tokens; this model's context is {backend.max_model_len} tokens")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = min(room, cfg.default_max_tokens or room)
    if max_tokens > room:
        raise RequestError(
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the context of "
            f"{backend.max_model_len} tokens; ask for at most {room}"
        )
    vocab = getattr(backend, "vocab_size", None)
    for t in req.stop_token_ids or []:
        if t < 0 or (vocab is not None and t >= vocab):
            raise RequestError(f"stop_token_ids contains {t}, not a token id of this model")
    return {
        "n": req.n,
        "max_tokens": int(max_tokens),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "logprobs": num_logprobs,
    }


def _check_ids(ids: list[int], backend: ServerBackend, what: str) -> list[int]:
    vocab = getattr(backend, "vocab_size", None)
    for t in ids:
        if not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            raise RequestError(f"{what} contains {t!r}, not a token id of this model")
    return ids


def _content_ids(tokenizer, ids: list[int], finish_reason: str) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if finish_reason == "stop" and ids and ids[-1] == eos:
        return ids[:-1]
    return ids


def _openai_logprobs(tokenizer, sample: dict[str, Any], top: int) -> dict[str, Any]:
    """The chat ``logprobs`` object; tokens are written as their decoded text."""
    content = []
    tops = sample.get("top_logprobs") or [None] * len(sample["token_ids"])
    for tok, lp, step in zip(sample["token_ids"], sample["logprobs"], tops):
        entry = {"token": tokenizer.decode([tok]), "logprob": lp, "bytes": None, "top_logprobs": []}
        if step and top:
            ranked = sorted(step.items(), key=lambda kv: -kv[1])[:top]
            entry["top_logprobs"] = [{"token": tokenizer.decode([t]), "logprob": v, "bytes": None} for t, v in ranked]
        content.append(entry)
    return {"content": content}


class ChatRenderer:
    """Chat messages -> prompt token ids, with the model's own tokens spliced in."""

    def __init__(self, tokenizer, chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def render_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError(
                "this model's tokenizer has no chat template and the server was started without one "
                "(ServerConfig.chat_template); use /v1/completions or start the server with a template",
                status=400,
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja errors, raise_exception() in the template
            raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list["ChatMessage"]) -> tuple[list[int], int | None]:
        """(prompt ids, index of the assistant message whose tokens were spliced in, or None)."""
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        template_ids = self.render_ids(plain, add_generation_prompt=True)
        last = None
        for j, m in enumerate(messages):
            if m.role == "assistant" and (m.generation_token_ids is not None or m.prompt_token_ids is not None):
                if m.generation_token_ids is None or m.prompt_token_ids is None:
                    raise RequestError(
                        f"messages[{j}] carries only one of prompt_token_ids / generation_token_ids; send both "
                        "(as this server returned them) or neither"
                    )
                last = j
        if last is None:
            return template_ids, None
        m = messages[last]
        template_prefix = self.render_ids(plain[: last + 1], add_generation_prompt=False)
        try:
            ids = replace_prefix_tokens(
                self.tokenizer, list(m.prompt_token_ids) + list(m.generation_token_ids), template_prefix, template_ids
            )
        except PrefixSpliceError as e:
            raise RequestError(str(e)) from e
        return ids, last


# ---- the app --------------------------------------------------------------------------


def build_app(backend: ServerBackend, cfg: ServerConfig):
    """The FastAPI app serving ``backend``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="rl_specdec generation server", docs_url=None, redoc_url=None, openapi_url=None)
    renderer = ChatRenderer(backend.tokenizer, cfg.chat_template)
    tok = backend.tokenizer
    app.state.num_requests = 0
    app.state.num_errors = 0

    def error(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
        app.state.num_errors += 1
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "code": status}})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return error(400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError):
        return error(exc.status, str(exc), exc.type)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):  # the engine failed: report, keep serving
        logger.exception("request failed")
        return error(500, f"{type(exc).__name__}: {exc}", "internal_error")

    def check_model(name: str) -> None:
        if name not in (backend.model_name, getattr(backend, "model_path", None)):
            raise RequestError(f"model {name!r} is not served here; this server serves {backend.model_name!r}", status=404, type_="not_found_error")

    async def run(prompt_ids: list[int], params: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            return await backend.generate_tokens(prompt_ids, params)
        except (ValueError, TypeError) as e:  # vLLM's validation of the request
            raise RequestError(f"the engine rejected the request: {e}") from e

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": backend.model_name, "object": "model", "created": 0, "owned_by": "rl_specdec", "max_model_len": backend.max_model_len}],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        app.state.num_requests += 1
        check_model(req.model)
        prompt_ids, spliced = renderer.prompt_ids(req.messages)
        _check_ids(prompt_ids, backend, "the prompt (with the spliced token ids)")
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = _sampling_params(req, len(prompt_ids), backend, cfg, top)
        samples = await run(prompt_ids, params)
        choices = []
        for i, s in enumerate(samples):
            content = tok.decode(_content_ids(tok, s["token_ids"], s["finish_reason"]), skip_special_tokens=True)
            choices.append(
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "prompt_token_ids": prompt_ids,
                        "generation_token_ids": s["token_ids"],
                        "generation_log_probs": s["logprobs"],
                    },
                    "logprobs": _openai_logprobs(tok, s, top) if req.logprobs else None,
                    "finish_reason": s["finish_reason"],
                }
            )
        n_out = sum(len(s["token_ids"]) for s in samples)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": backend.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out, "total_tokens": len(prompt_ids) + n_out},
            "prompt_token_ids": prompt_ids,
            "spliced_message_index": spliced,
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        app.state.num_requests += 1
        check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [tok.encode(p, add_special_tokens=False)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [_check_ids(list(p), backend, "prompt")]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tok.encode(x, add_special_tokens=False) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [_check_ids(list(x), backend, f"prompt[{i}]") for i, x in enumerate(p)]
        else:
            raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
        if any(len(x) == 0 for x in prompts):
            raise RequestError("empty prompt")
        top = req.logprobs or 0
        all_params = [_sampling_params(req, len(x), backend, cfg, top) for x in prompts]
        results = await asyncio.gather(*(run(x, prm) for x, prm in zip(prompts, all_params)))
        choices, n_in, n_out = [], 0, 0
        for x, samples in zip(prompts, results):
            n_in += len(x)
            for s in samples:
                text = tok.decode(_content_ids(tok, s["token_ids"], s["finish_reason"]), skip_special_tokens=True)
                if req.echo:
                    text = tok.decode(x, skip_special_tokens=True) + text
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "logprobs": (
                            {"tokens": [tok.decode([t]) for t in s["token_ids"]], "token_logprobs": s["logprobs"]}
                            if req.logprobs is not None
                            else None
                        ),
                        "finish_reason": s["finish_reason"],
                        "prompt_token_ids": x,
                        "generation_token_ids": s["token_ids"],
                        "generation_log_probs": s["logprobs"],
                    }
                )
                n_out += len(s["token_ids"])
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": backend.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
        }

    return app


# ---- running it on the current event loop ------------------------------------------------


@dataclass
class RunningServer:
    base_url: str
    server: Any  # uvicorn.Server
    task: asyncio.Task
    app: Any

    async def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, timeout)
        if not self.task.done():
            self.task.cancel()


async def start_server(backend: ServerBackend, cfg: ServerConfig, start_timeout: float = 30.0) -> RunningServer:
    """Serve ``backend`` on the running event loop; returns once the socket accepts connections."""
    import uvicorn

    cfg.check()

    class _Server(uvicorn.Server):
        def capture_signals(self):  # the host process (a Ray actor) owns its signals
            return contextlib.nullcontext()

    app = build_app(backend, cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    port = sock.getsockname()[1]
    server = _Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30, backlog=1024)
    )
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError("the HTTP server stopped during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the HTTP server did not start within {start_timeout:.0f}s")
        await asyncio.sleep(0.05)
    host = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    base_url = f"http://{host}:{port}/v1"
    logger.info("OpenAI-compatible server for %s at %s", backend.model_name, base_url)
    return RunningServer(base_url, server, task, app)
