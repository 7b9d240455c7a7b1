"""Run-time k (``policy.generation.speculation_control``): load-time checks and the engine arguments it needs.

Modes:

* ``off``: vLLM runs ``speculative_config`` as written (a fixed k, or vLLM's
  static batch-size schedule); nothing of rl_specdec runs per step.
* ``fixed``: k is what ``speculative_config`` says at start (its k, or its
  schedule as the initial lookup) and changes only when asked
  (``RolloutEngine.set_speculation``); k=0 runs through the fast path.
* ``adaptive``: the controller in each engine chooses k in 0..``k_max`` per
  batch-size bucket from live measurements (rl_specdec.generation.engine.controller).

For ``fixed`` and ``adaptive`` each engine is started in vLLM's dynamic-k mode
(``num_speculative_tokens_per_batch_size``) with ``num_speculative_tokens =
k_max`` and rl_specdec's scheduler class (:func:`engine_kwargs`); after start it
installs the fast path and runs the start-up self-check. Both are written for
``draft_model`` with a UniProc executor and no async scheduling; anything else
is refused here, with the key and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_specdec.errors import ConfigError
from rl_specdec.generation.config import GenerationConfig, SpeculationControlConfig

KEY = "policy.generation.speculation_control"
MODES = ("off", "fixed", "adaptive")
SCHEDULE_END = 1 << 16  # the dynamic-k schedule covers every batch size vLLM may run (it clips to max_num_seqs)


def as_dict(control: SpeculationControlConfig | dict[str, Any] | None) -> dict[str, Any]:
    """The settings as a plain dict (what crosses to the engine actors); {} or None means off."""
    if control is None:
        return dataclasses.asdict(SpeculationControlConfig())
    if dataclasses.is_dataclass(control):
        return dataclasses.asdict(control)
    return {**dataclasses.asdict(SpeculationControlConfig()), **control}


def is_on(control) -> bool:
    return as_dict(control)["mode"] != "off"


def configured_k(spec: dict[str, Any]) -> int:
    """The k speculative_config asks for: num_speculative_tokens, else its schedule's largest k."""
    if spec.get("num_speculative_tokens") is not None:
        return int(spec["num_speculative_tokens"])
    return max(int(e[2]) for e in spec.get("num_speculative_tokens_per_batch_size") or [[1, 1, 1]])


def engine_kwargs(vllm_kwargs: dict[str, Any], control) -> dict[str, Any]:
    """``vllm_kwargs`` (validated) plus what run-time k needs: dynamic-k mode, k_max, the scheduler class."""
    from rl_specdec.generation.engine.scheduler import SCHEDULER_QUALNAME

    c = as_dict(control)
    if c["mode"] == "off" or vllm_kwargs.get("speculative_config") is None:
        return dict(vllm_kwargs)
    spec = dict(vllm_kwargs["speculative_config"])
    k = configured_k(spec)
    spec["num_speculative_tokens"] = max(int(c["k_max"] or k), k)
    spec["num_speculative_tokens_per_batch_size"] = spec.get("num_speculative_tokens_per_batch_size") or [[1, SCHEDULE_END, k]]
    return {**vllm_kwargs, "speculative_config": spec, "scheduler_cls": SCHEDULER_QUALNAME}


def _check_numbers(c: SpeculationControlConfig, k: int) -> None:
    if c.k_max is not None and c.k_max < k:
        raise ConfigError(
            f"{KEY}.k_max={c.k_max} is below speculative_config's k ({k}); raise k_max to at least {k} "
            "or lower speculative_config.num_speculative_tokens."
        )
    b = list(c.buckets)
    if not b or b[0] != 1 or any(y <= x for x, y in zip(b, b[1:])):
        raise ConfigError(f"{KEY}.buckets={b} must be increasing batch sizes starting at 1, e.g. [1, 2, 4, 8, 16, 32, 64].")
    if not 0 <= c.explore <= 0.5:
        raise ConfigError(f"{KEY}.explore={c.explore} must be in [0, 0.5] (the fraction of steps that try another k; 0.03 is typical).")
    if not 0 <= c.min_gain <= 1:
        raise ConfigError(f"{KEY}.min_gain={c.min_gain} must be in [0, 1] (how much faster a k>0 must measure than k=0; 0.1 is the default).")
    for name, low in (("explore_steps", 1), ("memory_steps", 10), ("acceptance_memory", 10)):
        if getattr(c, name) < low:
            raise ConfigError(f"{KEY}.{name}={getattr(c, name)} must be >= {low}.")


def _check_engine(gen: GenerationConfig) -> None:
    kw, mode = gen.vllm_kwargs, gen.speculation_control.mode
    spec = kw.get("speculative_config")
    if spec is None:
        raise ConfigError(f"{KEY}.mode={mode} needs speculation: set policy.generation.vllm_kwargs.speculative_config (method: draft_model), or mode=off.")
    if spec.get("method") != "draft_model":
        raise ConfigError(
            f"{KEY}.mode={mode} with speculative_config.method={spec.get('method')!r}: run-time k, its k=0 fast path and "
            "the drafter catch-up are built for draft_model only. Use method: draft_model, or mode=off."
        )
    if kw.get("async_scheduling"):
        raise ConfigError(f"{KEY}.mode={mode} cannot run with vllm_kwargs.async_scheduling=true (its scheduler is the synchronous one); set async_scheduling=false or mode=off.")
    multi = int(kw.get("tensor_parallel_size") or 1) * int(kw.get("pipeline_parallel_size") or 1) > 1
    if multi or kw.get("distributed_executor_backend") not in (None, "uni"):
        raise ConfigError(
            f"{KEY}.mode={mode} needs the engine's worker in the engine core's process (a UniProc executor): remove "
            "tensor_parallel_size/pipeline_parallel_size/distributed_executor_backend from vllm_kwargs, or set mode=off."
        )


def validate(gen: GenerationConfig) -> None:
    """Load-time checks of ``speculation_control``."""
    c = gen.speculation_control
    if str(c.mode).lower() == "false":  # YAML 1.1 reads a bare `off` as false
        c.mode = "off"
    if c.mode not in MODES:
        raise ConfigError(f"{KEY}.mode={c.mode!r} must be one of {', '.join(MODES)}.")
    if c.mode == "off":
        return
    _check_engine(gen)
    _check_numbers(c, configured_k(gen.vllm_kwargs["speculative_config"]))
