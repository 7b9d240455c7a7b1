"""vLLM's own OpenAI server, served on the event loop of the async engine actor that runs its ``AsyncLLM``.

The app and our hooks in it (on-policy splicing, unknown-field refusal, the RL
fields on each chat message) are built by :mod:`rl_specdec.vllm_ext.openai_app`;
this module serves the app with uvicorn on the actor's loop, loopback by
default, on a free port, and stops it. The settings are
:class:`~rl_specdec.config.serving.ServerConfig`; docs/multi_turn.md has the
options, the fields and why the splice sits where it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from rl_specdec.config.serving import ServerConfig, check_reasoning_parser
from rl_specdec.rollout.serving.prefix import replace_prefix_tokens
from rl_specdec.vllm_ext import openai_app

logger = logging.getLogger(__name__)


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


async def start_openai_server(engine: Any, cfg: ServerConfig, start_timeout: float = 60.0) -> RunningServer:
    """Mount vLLM's OpenAI app on ``engine`` (a running ``AsyncLLM``) and serve it on this event loop."""
    t0 = time.monotonic()
    cfg.check()
    check_reasoning_parser(cfg, engine.vllm_config.structured_outputs_config.reasoning_parser or None)
    if not cfg.log_tool_parse_errors:  # a malformed call comes back as content; vLLM also logs a traceback
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
    app, server, sock = await openai_app.build_app(engine, cfg, replace_prefix_tokens)
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
