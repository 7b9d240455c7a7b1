"""What the OpenAI server logs, on a real async engine and server: a client's mistake (4xx) is one INFO line with
the request id, never an ERROR or a WARNING; a server fault (5xx) is an ERROR with the traceback, once.

The engine actor here is the async worker plus two test hooks (:class:`LogCapturingWorker`): one returns the
log records the actor emitted (every logger, every level), one makes the next chat request fail inside the app.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from conftest import CPU_VLLM_KWARGS, HOST_CORES, wait_until
from rl_specdec.rollout.group import AsyncVllmGeneration
from rl_specdec.rollout.serving.async_worker import AsyncVllmWorker
from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE

pytestmark = pytest.mark.integration

MODEL = "toy-policy"
TIMEOUT = 120.0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(
            {
                "logger": record.name,
                "level": record.levelname,
                "message": record.getMessage(),
                "traceback": self.format(record) if record.exc_info else None,
            }
        )


class LogCapturingWorker(AsyncVllmWorker):
    """The async worker, plus: the log records it emitted since the last call, and a chat handler that fails."""

    async def take_log_records(self) -> list[dict[str, Any]]:
        if not hasattr(self, "_records"):
            self._records = _Records()
            for name in ("", "vllm", "uvicorn"):  # vLLM's and uvicorn's loggers do not propagate to the root
                logging.getLogger(name).addHandler(self._records)
        out, self._records.records = self._records.records, []
        return out

    async def break_chat(self) -> None:
        chat = self.server.app.state.openai_serving_chat

        async def fails(request, raw_request=None):
            raise RuntimeError("injected server fault")

        chat.create_chat_completion = fails


class LogCapturingGeneration(AsyncVllmGeneration):
    worker_cls = LogCapturingWorker


@pytest.fixture(scope="module")
def srv(request, local_ray, toy):
    from rl_specdec.config import GenerationConfig, validate_vllm_kwargs

    kw = validate_vllm_kwargs({**CPU_VLLM_KWARGS, "speculative_config": None}, str(toy.policy))
    cfg = GenerationConfig(num_engines=1, cpus_per_engine=HOST_CORES, vllm_kwargs=kw, self_check=False)
    g = LogCapturingGeneration(
        str(toy.policy), cfg, server={"chat_template": TOY_CHAT_TEMPLATE, "served_model_name": MODEL}
    )
    request.addfinalizer(g.shutdown)
    return g


def records(srv) -> list[dict[str, Any]]:
    import ray

    return ray.get(srv.workers[0].take_log_records.remote())


def post(srv, path: str, body, headers: dict[str, str] | None = None):
    import httpx

    (url,) = srv.base_urls()
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(url + path, content=body, headers=headers, timeout=TIMEOUT)
    return httpx.post(url + path, json=body, headers=headers, timeout=TIMEOUT)


USER = [{"role": "user", "content": "31"}]
CLIENT_MISTAKES = [  # (path, body, status, what vLLM's message says)
    ("/chat/completions", {"model": "gpt-9", "messages": USER}, 404, "NotFoundError: The model `gpt-9` does not exist"),
    ("/completions", {"model": "gpt-9", "prompt": "31="}, 404, "The model `gpt-9` does not exist"),
    ("/chat/completions", {"model": MODEL, "messages": USER, "frobnicate": 1}, 400, "unknown request field(s)"),
    ("/chat/completions", b"{not json", 400, "validation error"),
    ("/chat/completions", {"model": MODEL, "messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "1"}]}, 400, "wizard"),
    ("/completions", {"model": MODEL, "prompt": "31=", "max_tokens": 500}, 400, "BadRequestError"),
]


def test_a_clients_mistake_is_one_info_line_with_the_request_id(srv):
    records(srv)  # start capturing
    answers = []
    for i, (path, body, status, says) in enumerate(CLIENT_MISTAKES):
        r = post(srv, path, body, headers={"X-Request-Id": f"mistake-{i}"} if i % 2 else None)
        assert r.status_code == status, (path, body, r.text)
        rid = r.headers["x-request-id"]
        assert rid == f"mistake-{i}" if i % 2 else len(rid) == 32, rid  # the client's id, or a new one
        answers.append((rid, path, status, says))
    got = records(srv)
    # RequestLog writes a request's line once the app returns, which can be after the client has its answer
    wait_until(
        lambda: all(any(f"request {a[0]}: " in r["message"] for r in got) for a in answers) or got.extend(records(srv))
    )
    loud = [r for r in got if r["level"] in ("WARNING", "ERROR", "CRITICAL")]
    assert loud == [], loud
    for rid, path, status, says in answers:
        lines = [r for r in got if f"request {rid}: " in r["message"]]
        assert len(lines) == 1, (rid, lines)
        assert lines[0]["level"] == "INFO" and f"POST /v1{path} -> {status} " in lines[0]["message"], lines[0]
        assert says in lines[0]["message"], lines[0]
    # vLLM's own ERROR for the unknown model and WARNING for the template's refusal are still there, at DEBUG
    assert any(r["message"].startswith("Error with model") and r["level"] == "DEBUG" for r in got), got
    assert any(r["message"].startswith("Chat template rejected") and r["level"] == "DEBUG" for r in got), got


def test_a_server_fault_is_one_error_with_the_traceback_and_the_server_goes_on(srv):
    import ray

    records(srv)
    ray.get(srv.workers[0].break_chat.remote())
    r = post(srv, "/chat/completions", {"model": MODEL, "messages": USER}, headers={"X-Request-Id": "fault-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "fault-1", r.text
    got = records(srv)
    errors = [r for r in got if r["level"] == "ERROR"]
    assert len(errors) == 1, errors  # uvicorn's own "Exception in ASGI application" is not a second one
    assert errors[0]["message"].startswith("request fault-1: POST /v1/chat/completions -> 500: RuntimeError")
    assert "Traceback" in errors[0]["traceback"] and "injected server fault" in errors[0]["traceback"]
    ok = post(srv, "/completions", {"model": MODEL, "prompt": "31=", "max_tokens": 3})
    assert ok.status_code == 200, ok.text
