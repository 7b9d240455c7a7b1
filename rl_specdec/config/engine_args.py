"""From the loaded config to an engine, in one place: the typed speculation object and the one function that
builds an engine's keyword arguments.

``policy.generation.vllm_kwargs.speculative_config`` keeps vLLM's shape in YAML and in the printed config. Once
it is validated (:mod:`rl_specdec.config.vllm_kwargs`), every reader outside ``config/`` takes it as
:class:`Speculation` (``GenerationConfig.speculation``): frozen, typed, with k worked out once.
:func:`engine_args` is everything ``vllm.LLM`` / ``AsyncEngineArgs`` receive, the arguments rl_specdec sets
itself included; ``--print-config --resolved`` prints what it returns.

Run-time k (``policy.generation.speculation_control``):

* ``off``: vLLM runs ``speculative_config`` as written (a fixed k, or vLLM's static batch-size schedule);
  nothing of rl_specdec runs per step.
* ``fixed``: k is what ``speculative_config`` says at start (its k, or its schedule as the initial lookup) and
  changes only when asked (``RolloutEngine.set_speculation``); k=0 runs through the fast path.
  ``draft_below`` (a concurrency threshold) makes the lookup k below it and 0 from it up.
* ``adaptive``: the controller in each engine chooses k in 0..``k_max`` per batch-size bucket from live
  measurements (:mod:`rl_specdec.rollout.runtime_k.controller`), only below ``draft_below`` when it is set.

For ``fixed`` and ``adaptive`` the engine starts in vLLM's dynamic-k mode (``num_speculative_tokens_per_batch_size``)
with ``num_speculative_tokens = k_max`` and rl_specdec's scheduler class (:meth:`Speculation.to_vllm`).
"""

from __future__ import annotations

from typing import Any

from rl_specdec.config.generation import SCHEDULE_END, GenerationConfig, Speculation

# the flow from the config to an engine, in one module
__all__ = ["SCHEDULE_END", "Speculation", "engine_args", "generation_config"]


def generation_config(policy_model: str, vllm_kwargs: dict[str, Any] | None = None, **fields: Any) -> GenerationConfig:
    """Generation settings made in code (an example, a benchmark), checked as a loaded config's are: ``vllm_kwargs``
    against vLLM's declarations (a draft model's vocabulary against ``policy_model``'s), then speculation's
    companions (run-time k, the canary, drafter training), ``auto`` resolved. ``fields``: any other field of
    :class:`GenerationConfig`; a :class:`~rl_specdec.errors.ConfigError` names what is wrong."""
    from rl_specdec.config.speculation import resolved_speculation
    from rl_specdec.config.vllm_kwargs import validate_vllm_kwargs

    return resolved_speculation(GenerationConfig(vllm_kwargs=validate_vllm_kwargs(vllm_kwargs, policy_model), **fields))


def engine_args(
    gen: GenerationConfig,
    model: str,
    seed: int,
    extension: str,
    quiet: bool = False,
    asynchronous: bool = False,
    on_cpu: bool | None = None,
) -> dict[str, Any]:
    """Every keyword argument of an engine of ``gen``'s group: ``vllm_kwargs`` (validated), the speculative config
    (with run-time k's settings when it is on), and what rl_specdec sets itself (``RL_SPECDEC_OWNED``).

    ``extension``: vLLM's ``worker_extension_cls`` (rl_specdec's engine extension, or a test's subclass of it);
    ``quiet``: no weight-loading bars (a console above INFO); ``asynchronous``: an ``AsyncLLM`` engine (the async
    worker's), which on CPU (``on_cpu``; None: vLLM's platform is asked) runs rl_specdec's executor."""
    from rl_specdec.vllm_ext.scheduler import SCHEDULER_QUALNAME

    kw = {k: v for k, v in gen.vllm_kwargs.items() if k != "speculative_config"}
    kw.update(model=model, seed=seed, disable_log_stats=False, worker_extension_cls=extension)  # stats: the metrics
    if quiet:
        kw.setdefault("use_tqdm_on_load", False)
    if asynchronous:
        _async_executor(kw, on_cpu)
    spec = gen.speculation
    if spec is None:
        return kw
    control = gen.speculation_control if gen.runtime_k_on() else None
    kw["speculative_config"] = spec.to_vllm(control)
    kw["per_request_spec_decode_metrics"] = "summary"  # each call's counters, free of other traffic
    if control is not None:
        kw["scheduler_cls"] = SCHEDULER_QUALNAME
    return kw


def _async_executor(kw: dict[str, Any], on_cpu: bool | None) -> None:
    """``AsyncLLM`` always runs its engine core in a process of its own, spawned, which a fix applied in the actor
    never reaches; on CPU the executor named here applies the CPU fixes (sampling, compile cache) in that process,
    so it must be the only worker there."""
    from rl_specdec.errors import ConfigError
    from rl_specdec.vllm_ext.worker import EXECUTOR_QUALNAME

    if on_cpu is None:
        from rl_specdec.vllm_ext.platform import is_cpu

        on_cpu = is_cpu()
    if not on_cpu:
        return
    world = int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))
    if world > 1 or kw.get("distributed_executor_backend") not in (None, "uni"):
        raise ConfigError(
            "the async engine on CPU runs one worker in the engine-core process (so the CPU sampling fix reaches "
            "it): remove tensor_parallel_size/pipeline_parallel_size/distributed_executor_backend from "
            "policy.generation.vllm_kwargs, or use the synchronous engine."
        )
    kw["distributed_executor_backend"] = EXECUTOR_QUALNAME
