"""The engine arguments run-time k needs (``policy.generation.speculation_control``).

Modes:

* ``off``: vLLM runs ``speculative_config`` as written (a fixed k, or vLLM's
  static batch-size schedule); nothing of rl_specdec runs per step.
* ``fixed``: k is what ``speculative_config`` says at start (its k, or its
  schedule as the initial lookup) and changes only when asked
  (``RolloutEngine.set_speculation``); k=0 runs through the fast path.
  ``draft_below`` (a concurrency threshold) makes the lookup k below it and
  0 from it up, and keeps it so when k is set.
* ``adaptive``: the controller in each engine chooses k in 0..``k_max`` per
  batch-size bucket from live measurements (:mod:`.controller`), only below
  ``draft_below`` when it is set.

For ``fixed`` and ``adaptive`` each engine is started in vLLM's dynamic-k mode
(``num_speculative_tokens_per_batch_size``) with ``num_speculative_tokens =
k_max`` and rl_specdec's scheduler class (:func:`engine_kwargs`); after start it
installs the fast path and runs the start-up self-check. The load-time checks
are in :mod:`rl_specdec.config.speculation`.
"""

from __future__ import annotations

from typing import Any

from rl_specdec.config.generation import SpeculationControlConfig
from rl_specdec.config.speculation import configured_k

SCHEDULE_END = 1 << 16  # the dynamic-k schedule covers every batch size vLLM may run (it clips to max_num_seqs)


def is_on(control: SpeculationControlConfig | None) -> bool:
    return control is not None and control.mode != "off"


def engine_kwargs(vllm_kwargs: dict[str, Any], control: SpeculationControlConfig | None) -> dict[str, Any]:
    """``vllm_kwargs`` (validated) plus what run-time k needs: dynamic-k mode, k_max, the scheduler class."""
    from rl_specdec.vllm_ext.scheduler import SCHEDULER_QUALNAME

    if not is_on(control) or vllm_kwargs.get("speculative_config") is None:
        return dict(vllm_kwargs)
    spec = dict(vllm_kwargs["speculative_config"])
    k = configured_k(spec)
    spec["num_speculative_tokens"] = max(int(control.k_max or k), k)
    schedule = spec.get("num_speculative_tokens_per_batch_size") or [[1, SCHEDULE_END, k]]
    if control.draft_below is not None:  # the concurrency threshold: k below it, 0 (the fast path) from it up
        schedule = [[1, control.draft_below - 1, k], [control.draft_below, SCHEDULE_END, 0]]
    spec["num_speculative_tokens_per_batch_size"] = schedule
    return {**vllm_kwargs, "speculative_config": spec, "scheduler_cls": SCHEDULER_QUALNAME}
