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

The request models and their translation live in
:mod:`~rl_specdec.generation.openai_schema`.

Errors: a malformed request (bad JSON, a wrong type, an unknown model, a
prompt longer than the context, a template that fails) gets a 4xx with an
OpenAI-style ``{"error": {"message", "type", "code"}}`` body; the server keeps
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rl_specdec.generation.openai_schema import (  # noqa: F401  (ChatMessage: re-exported for clients)
    ChatCompletionRequest,
    ChatMessage,
    ChatRenderer,
    CompletionRequest,
    RequestError,
    ServerBackend,
    ServerConfig,
    check_ids,
    content_ids,
    openai_logprobs,
    sampling_params,
)

logger = logging.getLogger(__name__)

# ---- the app --------------------------------------------------------------------------


class Handlers:
    """What each endpoint does, apart from FastAPI's routing (see :func:`build_app`)."""

    def __init__(self, backend: ServerBackend, cfg: ServerConfig):
        self.backend, self.cfg, self.tok = backend, cfg, backend.tokenizer
        self.renderer = ChatRenderer(backend.tokenizer, cfg.chat_template)

    def check_model(self, name: str) -> None:
        b = self.backend
        if name not in (b.model_name, getattr(b, "model_path", None)):
            raise RequestError(f"model {name!r} is not served here; this server serves {b.model_name!r}", status=404, type_="not_found_error")

    async def run(self, prompt_ids: list[int], params: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            return await self.backend.generate_tokens(prompt_ids, params)
        except (ValueError, TypeError) as e:  # vLLM's validation of the request
            raise RequestError(f"the engine rejected the request: {e}") from e

    def models(self) -> dict[str, Any]:
        b = self.backend
        return {
            "object": "list",
            "data": [{"id": b.model_name, "object": "model", "created": 0, "owned_by": "rl_specdec", "max_model_len": b.max_model_len}],
        }

    def _text(self, s: dict[str, Any]) -> str:
        return self.tok.decode(content_ids(self.tok, s["token_ids"], s["finish_reason"]), skip_special_tokens=True)

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        prompt_ids, spliced = self.renderer.prompt_ids(req.messages)
        check_ids(prompt_ids, self.backend, "the prompt (with the spliced token ids)")
        top = (req.top_logprobs or 0) if req.logprobs else 0
        samples = await self.run(prompt_ids, sampling_params(req, len(prompt_ids), self.backend, self.cfg, top))
        choices = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": self._text(s),
                    "prompt_token_ids": prompt_ids,
                    "generation_token_ids": s["token_ids"],
                    "generation_log_probs": s["logprobs"],
                },
                "logprobs": openai_logprobs(self.tok, s, top) if req.logprobs else None,
                "finish_reason": s["finish_reason"],
            }
            for i, s in enumerate(samples)
        ]
        n_out = sum(len(s["token_ids"]) for s in samples)
        return self._response("chatcmpl", "chat.completion", choices, len(prompt_ids), n_out, prompt_token_ids=prompt_ids, spliced_message_index=spliced)

    def _response(self, id_prefix: str, kind: str, choices: list[dict[str, Any]], n_in: int, n_out: int, **extra: Any) -> dict[str, Any]:
        return {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.backend.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            **extra,
        }

    def completion_prompts(self, p: Any) -> list[list[int]]:
        """A completions ``prompt`` (text, ids, or a list of either) as token-id prompts."""
        tok, backend = self.tok, self.backend
        if isinstance(p, str):
            prompts = [tok.encode(p, add_special_tokens=False)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [check_ids(list(p), backend, "prompt")]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tok.encode(x, add_special_tokens=False) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [check_ids(list(x), backend, f"prompt[{i}]") for i, x in enumerate(p)]
        else:
            raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
        if any(len(x) == 0 for x in prompts):
            raise RequestError("empty prompt")
        return prompts

    def _completion_choice(self, req: CompletionRequest, index: int, prompt: list[int], s: dict[str, Any]) -> dict[str, Any]:
        text = (self.tok.decode(prompt, skip_special_tokens=True) if req.echo else "") + self._text(s)
        lp = {"tokens": [self.tok.decode([t]) for t in s["token_ids"]], "token_logprobs": s["logprobs"]}
        return {
            "index": index,
            "text": text,
            "logprobs": lp if req.logprobs is not None else None,
            "finish_reason": s["finish_reason"],
            "prompt_token_ids": prompt,
            "generation_token_ids": s["token_ids"],
            "generation_log_probs": s["logprobs"],
        }

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        prompts = self.completion_prompts(req.prompt)
        top = req.logprobs or 0
        results = await asyncio.gather(*(self.run(x, sampling_params(req, len(x), self.backend, self.cfg, top)) for x in prompts))
        choices = [self._completion_choice(req, 0, x, s) for x, samples in zip(prompts, results) for s in samples]
        for i, c in enumerate(choices):
            c["index"] = i
        n_in = sum(len(x) for x in prompts)
        n_out = sum(len(s["token_ids"]) for samples in results for s in samples)
        return self._response("cmpl", "text_completion", choices, n_in, n_out)


def build_app(backend: ServerBackend, cfg: ServerConfig):
    """The FastAPI app serving ``backend``: routes and error bodies; the work is in :class:`Handlers`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="rl_specdec generation server", docs_url=None, redoc_url=None, openapi_url=None)
    h = Handlers(backend, cfg)
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

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return h.models()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        app.state.num_requests += 1
        return await h.chat(req)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        app.state.num_requests += 1
        return await h.completions(req)

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
