"""Rollouts: token ids in; token ids, log-probs and spec-decode counters out.

This package knows nothing of GRPO. It offers the rollout contract
(:mod:`~rl_specdec.rollout.interfaces`: ``RolloutEngine``, ``SamplingSettings``,
``GenerationOutput``), a group of vLLM engines in Ray actors that fulfils it
(:mod:`~rl_specdec.rollout.group`, its workers and placement), the code that runs
inside the engines (:mod:`~rl_specdec.rollout.engine_ext`), the weight wire
format and its verification, the start-up sampling guard, what the engines
really run, run-time k (:mod:`~rl_specdec.rollout.runtime_k`) and vLLM's OpenAI
server on the async engines (:mod:`~rl_specdec.rollout.serving`).
"""

from rl_specdec.rollout.interfaces import GenerationOutput, RolloutEngine, SamplingSettings
from rl_specdec.rollout.sampling_guard import calibration_report
from rl_specdec.rollout.serving.prefix import replace_prefix_tokens


def __getattr__(name):  # import Ray only when an engine group is asked for
    if name in ("VllmGeneration", "AsyncVllmGeneration"):
        from rl_specdec.rollout import group

        return getattr(group, name)
    raise AttributeError(name)


__all__ = [
    "AsyncVllmGeneration",
    "GenerationOutput",
    "RolloutEngine",
    "SamplingSettings",
    "VllmGeneration",
    "calibration_report",
    "replace_prefix_tokens",
]
