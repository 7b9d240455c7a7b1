"""The platform vLLM runs on (``vllm.platforms.current_platform``) and what rl_specdec reads off its outputs."""

from __future__ import annotations

import dataclasses
from typing import Any


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def sleep_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def last_token_time(request_output) -> float | None:
    """When the request's last token was made (``time.monotonic()`` in the engine core); None without stats."""
    stats = request_output.metrics
    return None if stats is None or not stats.last_token_ts else float(stats.last_token_ts)


def spec_decode_metrics(completion) -> Any:
    """The request's own spec-decode histogram (engine argument ``per_request_spec_decode_metrics``), or None."""
    return completion.spec_decode_metrics


def metrics_snapshot() -> list[Any]:
    """This process's vLLM metrics (the async engine's counters; ``LLM.get_metrics()`` for the sync one)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return get_metrics_snapshot()


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _probe_outputs() -> None:
    from vllm.outputs import CompletionOutput
    from vllm.v1.metrics.stats import RequestStateStats

    missing = {"spec_decode_metrics", "token_ids", "logprobs", "finish_reason"} - _fields(CompletionOutput)
    missing |= {"last_token_ts"} - _fields(RequestStateStats)
    if missing:
        raise RuntimeError(f"vLLM's outputs lack {sorted(missing)}")


def _probe_platform() -> None:
    from vllm.platforms import current_platform

    for name in ("is_cpu", "device_type", "is_sleep_mode_available"):
        if not hasattr(current_platform, name):
            raise RuntimeError(f"current_platform has no {name}")


def _probe_reader() -> None:
    from vllm.v1.metrics.reader import get_metrics_snapshot

    if not callable(get_metrics_snapshot):
        raise RuntimeError("vllm.v1.metrics.reader.get_metrics_snapshot is not callable")


PROBES = {
    "CompletionOutput/RequestStateStats fields": _probe_outputs,
    "current_platform": _probe_platform,
    "v1.metrics.reader.get_metrics_snapshot": _probe_reader,
}
