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

__all__ = ["SCHEDULE_END", "Speculation", "engine_args"]  # the flow from the config to an engine, in one module


def engine_args(gen: GenerationConfig, model: str, seed: int, extension: str, quiet: bool = False) -> dict[str, Any]:
    """Every keyword argument of an engine of ``gen``'s group: ``vllm_kwargs`` (validated), the speculative config
    (with run-time k's settings when it is on), and what rl_specdec sets itself (``RL_SPECDEC_OWNED``).

    ``extension``: vLLM's ``worker_extension_cls`` (rl_specdec's engine extension, or a test's subclass of it);
    ``quiet``: no weight-loading bars (a console above INFO)."""
    from rl_specdec.vllm_ext.scheduler import SCHEDULER_QUALNAME

    kw = {k: v for k, v in gen.vllm_kwargs.items() if k != "speculative_config"}
    kw.update(model=model, seed=seed, disable_log_stats=False, worker_extension_cls=extension)  # stats: the metrics
    if quiet:
        kw.setdefault("use_tqdm_on_load", False)
    spec = gen.speculation
    if spec is None:
        return kw
    control = gen.speculation_control if gen.runtime_k_on() else None
    kw["speculative_config"] = spec.to_vllm(control)
    kw["per_request_spec_decode_metrics"] = "summary"  # each call's counters, free of other traffic
    if control is not None:
        kw["scheduler_cls"] = SCHEDULER_QUALNAME
    return kw
