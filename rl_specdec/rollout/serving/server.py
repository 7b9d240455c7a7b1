"""vLLM's own OpenAI server, served on the event loop of the async engine actor that runs its ``AsyncLLM``.

The app and our hooks in it (on-policy splicing, unknown-field refusal, the RL
fields on each chat message) are built by :mod:`rl_specdec.vllm_ext.openai_app`;
this module serves the app with uvicorn on the actor's loop, loopback by
default, on a free port, and stops it. The settings are
:class:`~rl_specdec.config.serving.ServerConfig`; docs/multi_turn.md has the
options, the fields and why the splice sits where it does.

:class:`RequestLog` wraps the app: every request has an id (the client's
``X-Request-Id``, or a new one, which vLLM then uses and the response carries).
A client's mistake (4xx) is one INFO line with that id, the status and vLLM's
message; a server fault (5xx) is an ERROR, with the traceback when an exception
left the app. vLLM's own lines for a client's mistake (an ERROR for an unknown
model) go down to DEBUG (:func:`~rl_specdec.vllm_ext.openai_app.quiet_client_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rl_specdec.config.serving import ServerConfig, check_reasoning_parser
from rl_specdec.rollout.serving.prefix import replace_prefix_tokens
from rl_specdec.vllm_ext import openai_app

logger = logging.getLogger(__name__)
# The request log is a child of vLLM's logger: the server's lines, vLLM's and ours, share its handler, its level
# (the console's, VLLM_LOGGING_LEVEL) and its format. A Ray actor's own root logger shows nothing below WARNING.
requests_log = logging.getLogger("vllm.rl_specdec.requests")


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
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except asyncio.TimeoutError:
            pass  # forced below
        except Exception as e:  # noqa: BLE001  the server failed while serving: say so, and stop anyway
            logger.warning("the HTTP server ended with %s: %s", type(e).__name__, e)
        if not self.task.done():
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


LOGGED = "_rl_specdec_logged"  # set on an exception RequestLog logged, so uvicorn does not log it again
BODY_LIMIT = 4096  # bytes of an error response kept for its log line


class RequestLog:
    """ASGI wrapper around the whole app: a request id for every request, a log line for every error answer."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        if b"x-request-id" not in headers:  # vLLM names its request after this header
            scope = {**scope, "headers": [*scope["headers"], (b"x-request-id", rid.encode())]}
        answer = {"status": 0, "body": b""}

        async def send_logged(message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                if not any(k.lower() == b"x-request-id" for k, _ in message.get("headers", [])):
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            elif message["type"] == "http.response.body" and answer["status"] >= 400:
                answer["body"] = (answer["body"] + message.get("body", b""))[:BODY_LIMIT]
            await send(message)

        where = f"request {rid}: {scope.get('method', '')} {scope.get('path', '')}"
        try:
            await self.app(scope, receive, send_logged)
        except Exception as e:
            requests_log.error("%s -> 500: %s: %s", where, type(e).__name__, e, exc_info=e)
            setattr(e, LOGGED, True)
            raise  # uvicorn closes the connection; its own log line of it is dropped (_LoggedOnce)
        if answer["status"] >= 400:
            log = requests_log.info if answer["status"] < 500 else requests_log.error
            log("%s -> %d %s", where, answer["status"], _error_text(answer["body"]))


def _error_text(body: bytes) -> str:
    """vLLM's error body ``{"error": {"type", "message"}}`` (or FastAPI's ``{"detail"}``) on one line."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        text = f"{err.get('type', '')}: {err.get('message', '')}"
    else:
        text = str(payload.get("detail", payload) if isinstance(payload, dict) else payload)
    return " ".join(text.split())[:500]


class _LoggedOnce(logging.Filter):
    """uvicorn logs an exception that leaves the app ("Exception in ASGI application"): not when RequestLog did."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record.exc_info[1] if record.exc_info else None, LOGGED, False)


async def start_openai_server(engine: Any, cfg: ServerConfig, start_timeout: float = 60.0) -> RunningServer:
    """Mount vLLM's OpenAI app on ``engine`` (a running ``AsyncLLM``) and serve it on this event loop."""
    t0 = time.monotonic()
    cfg.check()
    check_reasoning_parser(cfg, engine.vllm_config.structured_outputs_config.reasoning_parser or None)
    if not cfg.log_tool_parse_errors:  # a malformed call comes back as content; vLLM also logs a traceback
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
    openai_app.quiet_client_errors()
    if not any(isinstance(f, _LoggedOnce) for f in logging.getLogger("uvicorn.error").filters):
        logging.getLogger("uvicorn.error").addFilter(_LoggedOnce())
    app, server, sock = await openai_app.build_app(engine, cfg, replace_prefix_tokens, RequestLog)
    port = sock.getsockname()[1]
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
    return RunningServer(
        base_url=f"http://{host}:{port}/v1", server=server, task=task, app=app, start_s=time.monotonic() - t0
    )
