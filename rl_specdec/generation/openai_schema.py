"""The OpenAI wire format of the generation server: request models, sampling, rendering.

What :mod:`~rl_specdec.generation.server` accepts and how it turns a request
into token ids and vLLM sampling parameters, kept apart from the HTTP app:
the server's config, the backend it serves (``ServerBackend``), the request
models (unknown fields are refused, so a typo is a 400, not a silent default),
the translation to sampling parameters, the OpenAI ``logprobs`` shape, and
chat rendering with on-policy token splicing.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field

from rl_specdec.errors import PrefixSpliceError
from rl_specdec.generation.prefix import replace_prefix_tokens

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


def sampling_params(req, prompt_len: int, backend: ServerBackend, cfg: ServerConfig, num_logprobs: int) -> dict[str, Any]:
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


def check_ids(ids: list[int], backend: ServerBackend, what: str) -> list[int]:
    vocab = getattr(backend, "vocab_size", None)
    for t in ids:
        if not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            raise RequestError(f"{what} contains {t!r}, not a token id of this model")
    return ids


def content_ids(tokenizer, ids: list[int], finish_reason: str) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if finish_reason == "stop" and ids and ids[-1] == eos:
        return ids[:-1]
    return ids


def openai_logprobs(tokenizer, sample: dict[str, Any], top: int) -> dict[str, Any]:
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
