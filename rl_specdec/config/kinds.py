"""A value against the kind of the field it sets (``rl_specdec.vllm_ext.declarations.kind_of``): vLLM's engine
arguments and speculative config, and a task's arguments, checked when the config loads, before any engine starts."""

from __future__ import annotations

import math
from typing import Any

from rl_specdec.errors import ConfigError

FIX = {
    "bool": "must be true or false",
    "int": "must be an integer",
    "float": "must be a finite number",
    "str": "must be a string",
}


def kind_problem(kind: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for a field of ``kind`` (None: nothing, or a kind not checked here)."""
    if value is None or kind is None:
        return None
    if isinstance(kind, list):
        return None if value in kind else f"must be one of {', '.join(map(str, kind))}"
    fits = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        "str": isinstance(value, str),
    }.get(kind, True)
    return None if fits else FIX[kind]


def check_kinds(values: dict[str, Any], kinds: dict[str, Any], key: str, sizes: dict[str, tuple] | None = None) -> None:
    """Every value of the kind its field declares, and each of ``sizes`` >= 1 or one of the values it names
    (``max_model_len: (-1,)``, vLLM's fit-to-memory), or a ConfigError naming ``<key>.<name>``."""
    sizes = sizes or {}
    for name, value in values.items():
        problem = kind_problem(kinds.get(name), value)
        if problem is None and name in sizes and value is not None and value < 1 and value not in sizes[name]:
            problem = "must be >= 1" + "".join(f" or {v}" for v in sizes[name])
        if problem:
            raise ConfigError(f"{key}.{name}={value!r} {problem}; fix it in the config or on the command line.")
