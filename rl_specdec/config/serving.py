"""The ``server:`` settings of an async engine group: vLLM's own OpenAI app on each engine
(rl_specdec.rollout.serving.server; docs/multi_turn.md lists every option)."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any

from rl_specdec.errors import ConfigError
from rl_specdec.vllm_ext import declarations


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
        if not self.allow_remote and not _is_loopback(self.host):
            raise ConfigError(
                f"server.host {self.host!r} is not a loopback address; set server.allow_remote: true to serve other "
                "hosts, on a trusted network only (vLLM's app has routes that server.api_key does not guard)"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("server.enable_auto_tool_choice needs server.tool_call_parser (e.g. hermes)")
        tools = declarations.tool_call_parsers()
        if self.tool_call_parser and self.tool_call_parser not in tools:
            raise ConfigError(
                f"server.tool_call_parser {self.tool_call_parser!r} is not one of vLLM's: {', '.join(sorted(tools))}"
            )
        reasoners = declarations.reasoning_parsers()
        if self.reasoning_parser and self.reasoning_parser not in reasoners:
            raise ConfigError(
                f"server.reasoning_parser {self.reasoning_parser!r} is not one of vLLM's: "
                f"{', '.join(sorted(reasoners))}"
            )
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
