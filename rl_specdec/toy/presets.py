"""Settings for running the embedded toy models on this project's CPU machines.

One place for what tests, examples and benchmarks would otherwise repeat:
the engine settings that work on vLLM's CPU backend, the toy chat template,
and the number of cores this process may use.
"""

from __future__ import annotations

import os
from typing import Any

# vLLM engine settings for the toy on CPU:
# * kv_cache_memory_bytes instead of gpu_memory_utilization (a fraction of host RAM on CPU);
# * max_model_len: the toy's context (its position embeddings stop at 128);
# * dtype float32: vLLM otherwise runs a float32 checkpoint in bfloat16 on CPU, and the
#   tests compare with transformers in float32 token for token;
# * enforce_eager: skips torch.compile (15-40 s per engine here); benchmarks that measure
#   speed turn it off.
TOY_ENGINE_KWARGS: dict[str, Any] = {
    "kv_cache_memory_bytes": 2**28,
    "max_model_len": 128,
    "dtype": "float32",
    "enforce_eager": True,
}

# A chat template for the toy digit vocabulary: a user turn is its content followed by
# "=", an assistant turn its content followed by the EOS token, so turn boundaries are
# EOS tokens and turn 1 renders exactly as the task prompt ("31415" -> "31415=").
# System messages are not part of the toy language.
TOY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ m['content'] }}="
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] }}{{ eos_token }}"
    "{%- else -%}{{ raise_exception('the toy chat template has no ' + m['role'] + ' role') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def toy_engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """``TOY_ENGINE_KWARGS`` with ``overrides`` (e.g. ``speculative_config=...``)."""
    return {**TOY_ENGINE_KWARGS, **overrides}
