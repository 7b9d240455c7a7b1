"""Load-time checks of the speculation keys of ``policy.generation``: the acceptance canary, online
drafter training, and run-time k (``speculation_control``); and their resolution (:func:`resolved_speculation`),
which returns new settings and changes nothing it is given.

Each error names the key and the fix. Nothing here needs vLLM: the checks of ``vllm_kwargs`` against
vLLM's own declarations are in :mod:`rl_specdec.config.vllm_kwargs`.
"""

from __future__ import annotations

import dataclasses

from rl_specdec.config.generation import GenerationConfig, SpeculationControlConfig
from rl_specdec.errors import ConfigError
from rl_specdec.vllm_ext.methods import method as method_row
from rl_specdec.vllm_ext.methods import names

KEY = "policy.generation"
CONTROL_KEY = f"{KEY}.speculation_control"
CONTROL_MODES = ("off", "fixed", "adaptive", "auto")


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}={value} must be {'>= 0' if allow_zero else '> 0'}")


def resolved_speculation(gen: GenerationConfig) -> GenerationConfig:
    """``gen`` checked, with its speculation's nulls and ``auto`` resolved (run-time k's mode, start and fast
    path; the drafter's learning rate), as new settings: ``gen`` itself is left as it is."""
    c = gen.acceptance_canary
    if c.action not in ("warn", "disable", "fail"):
        raise ConfigError(f"{KEY}.acceptance_canary.action={c.action!r} must be warn, disable or fail")
    if not 0 < c.min_ratio < 1:
        raise ConfigError(
            f"{KEY}.acceptance_canary.min_ratio={c.min_ratio} must be in (0, 1); 0.5 trips at half the usual acceptance"
        )
    _positive(f"{KEY}.acceptance_canary.window", c.window)
    control = resolved_control(gen)
    return dataclasses.replace(gen, speculation_control=control, drafter_training=resolved_drafter_training(gen))


def resolved_drafter_training(gen: GenerationConfig):
    """``drafter_training`` checked, its learning rate's null resolved for the method (a new object)."""
    d = gen.drafter_training
    if not d.enabled:
        return d
    method = (gen.vllm_kwargs.get("speculative_config") or {}).get("method")
    d = dataclasses.replace(d, learning_rate=d.lr_for(method))
    for name in ("learning_rate", "steps_per_update", "every", "micro_batch_size"):
        _positive(f"{KEY}.drafter_training.{name}", getattr(d, name))
    if d.max_sequences < 0:
        raise ConfigError(
            f"{KEY}.drafter_training.max_sequences={d.max_sequences} must be >= 0 (0 trains on every rollout of the "
            "step)"
        )
    if not 1 <= d.top_k <= 20:
        raise ConfigError(
            f"{KEY}.drafter_training.top_k={d.top_k} must be in 1..20 (vLLM returns at most 20 log-probs per token)"
        )
    _positive(f"{KEY}.drafter_training.chain_steps", d.chain_steps)
    return d


def check_trainable_method(gen: GenerationConfig) -> None:
    """``drafter_training`` on a method it can train; run after vLLM's own check of the method's name."""
    spec = gen.vllm_kwargs.get("speculative_config") or {}
    method = spec.get("method")
    if not gen.drafter_training.enabled:
        return
    if method is None:
        raise ConfigError(
            f"{KEY}.drafter_training.enabled=true needs speculation: set {KEY}.vllm_kwargs.speculative_config "
            "(method: draft_model)"
        )
    row = method_row(method)
    if not row.trains_online:
        why = row.why_not_trained or "is not a draft_model drafter nor an EAGLE-3 head"
        raise ConfigError(
            f"{KEY}.drafter_training.enabled=true with speculative_config.method={method!r}: {method} {why}. "
            f"Online drafter training needs method: draft_model or eagle3; set {KEY}.drafter_training.enabled=false "
            f"for {method}."
        )


def resolved_control(gen: GenerationConfig) -> SpeculationControlConfig:
    """Run-time k: its numbers, and an engine it can run in (draft_model, eagle3 or ngram, a UniProc executor, no
    async scheduling); ``k0_fast_path`` null resolves to true.

    ``auto`` resolves here: where run-time k can run with a drafter (draft_model, eagle3), ``fixed`` when
    ``draft_below`` is set (a rule: nothing to measure) and ``adaptive`` otherwise; elsewhere ``off`` (vLLM's own
    k), so that switching speculation off or to another method stays one key. ``off`` ignores ``draft_below``, as
    it ignores the controller's keys. Returns the resolved settings, a new object."""
    c = gen.speculation_control
    mode = "off" if str(c.mode).lower() == "false" else c.mode  # YAML 1.1 reads a bare `off` as false
    if mode not in CONTROL_MODES:
        raise ConfigError(f"{CONTROL_KEY}.mode={mode!r} must be one of {', '.join(CONTROL_MODES)}.")
    problem = _control_engine_problem(gen) if mode != "off" else None
    method = (gen.vllm_kwargs.get("speculative_config") or {}).get("method")
    if mode == "auto":
        off = problem or not method_row(method).controller
        mode = "off" if off else "fixed" if c.draft_below is not None else "adaptive"
    c = dataclasses.replace(c, mode=mode, k0_fast_path=c.fast_path)
    if mode == "off":
        return c
    if problem:
        raise ConfigError(problem)
    _check_control_numbers(c, gen.speculation.k)
    _check_draft_below(c, gen.vllm_kwargs["speculative_config"])
    return dataclasses.replace(c, start=_resolved_start(c, gen.vllm_kwargs["speculative_config"]))


def _resolved_start(c: SpeculationControlConfig, spec: dict) -> str | None:
    """Where the controller starts: null resolves to ``schedule`` when speculative_config has one, else ``zero``."""
    key = f"{CONTROL_KEY}.start"
    if c.start not in (None, "zero", "schedule"):
        raise ConfigError(
            f"{key}={c.start!r} must be zero (warm up, then k=0 until a k>0 measures faster), schedule (start "
            "from speculative_config's k or num_speculative_tokens_per_batch_size), or null (schedule if one is set)."
        )
    if c.mode != "adaptive":
        if c.start is not None:
            raise ConfigError(
                f"{key}={c.start} applies to the controller only, and mode is {c.mode}: remove {key}, or set "
                f"{CONTROL_KEY}.mode=adaptive."
            )
        return None
    if c.start is None:
        return "schedule" if spec.get("num_speculative_tokens_per_batch_size") else "zero"
    return c.start


def _check_draft_below(c: SpeculationControlConfig, spec: dict) -> None:
    if c.draft_below is None:
        return
    key = f"{CONTROL_KEY}.draft_below"
    if isinstance(c.draft_below, bool) or not isinstance(c.draft_below, int) or c.draft_below < 2:
        raise ConfigError(
            f"{key}={c.draft_below!r} must be a whole number >= 2 (drafting happens while fewer requests than it run; "
            "32 drafts at 1 to 31), or null for no threshold."
        )
    if spec.get("num_speculative_tokens_per_batch_size"):
        raise ConfigError(
            f"{key}={c.draft_below} and speculative_config.num_speculative_tokens_per_batch_size both say where to "
            "draft: keep one (remove the schedule, or set draft_below=null)."
        )


def _check_control_numbers(c: SpeculationControlConfig, k: int) -> None:
    key = CONTROL_KEY
    if c.k_max is not None and c.k_max < k:
        raise ConfigError(
            f"{key}.k_max={c.k_max} is below speculative_config's k ({k}); raise k_max to at least {k} "
            "or lower speculative_config.num_speculative_tokens."
        )
    b = list(c.buckets)
    if not b or b[0] != 1 or any(y <= x for x, y in zip(b, b[1:])):
        raise ConfigError(
            f"{key}.buckets={b} must be increasing batch sizes starting at 1, e.g. [1, 2, 4, 8, 16, 32, 64]."
        )
    if not 0 <= c.explore <= 0.5:
        raise ConfigError(
            f"{key}.explore={c.explore} must be in [0, 0.5] (the fraction of steps that try another k; 0.03 is "
            "typical)."
        )
    if not 0 <= c.min_gain <= 1:
        raise ConfigError(
            f"{key}.min_gain={c.min_gain} must be in [0, 1] "
            "(how much faster a k>0 must measure than k=0; 0.1 is the default)."
        )
    for name, low in (("explore_steps", 1), ("memory_steps", 10), ("acceptance_memory", 10)):
        if getattr(c, name) < low:
            raise ConfigError(f"{key}.{name}={getattr(c, name)} must be >= {low}.")


def _control_engine_problem(gen: GenerationConfig) -> str | None:
    """Why run-time k cannot run in this engine (the error, with its fix), or None."""
    kw, mode, key = gen.vllm_kwargs, gen.speculation_control.mode, CONTROL_KEY
    spec = kw.get("speculative_config")
    if spec is None:
        return (
            f"{key}.mode={mode} needs speculation: set {KEY}.vllm_kwargs.speculative_config (method: draft_model), "
            "or mode=off."
        )
    method = spec.get("method")
    row = method_row(method)
    if not row.runtime_k:
        return (
            f"{key}.mode={mode} with speculative_config.method={method!r}: run-time k is built for "
            f"{' and '.join(names(lambda m: m.runtime_k))} only. Use one of them, or mode=off."
        )
    if not row.controller and mode == "adaptive":
        return (
            f"{key}.mode=adaptive with speculative_config.method={method!r}: the controller's model of a step's cost "
            f"and acceptance is built for drafters. Run {method}'s k from a schedule with {key}.mode=fixed "
            "(speculative_config.num_speculative_tokens_per_batch_size, or draft_below), or mode=off."
        )
    if kw.get("async_scheduling"):
        return (
            f"{key}.mode={mode} cannot run with vllm_kwargs.async_scheduling=true (its scheduler is the synchronous "
            "one); set async_scheduling=false or mode=off."
        )
    multi = int(kw.get("tensor_parallel_size") or 1) * int(kw.get("pipeline_parallel_size") or 1) > 1
    if multi or kw.get("distributed_executor_backend") not in (None, "uni"):
        return (
            f"{key}.mode={mode} needs the engine's worker in the engine core's process (a UniProc executor): remove "
            "tensor_parallel_size/pipeline_parallel_size/distributed_executor_backend from vllm_kwargs, or set "
            "mode=off."
        )
    return None
