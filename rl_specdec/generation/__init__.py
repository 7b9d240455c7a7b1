"""Rollout generation: token ids in, token ids, log-probs and spec-decode counters out.

This package knows nothing of GRPO. It offers a rollout engine (a group of
vLLM engines in Ray actors, :mod:`~rl_specdec.generation.group`), its
settings and their validation, the code that runs inside the engines
(:mod:`~rl_specdec.generation.engine_ext`), and the CPU fix that keeps
speculative sampling lossless.
"""

from rl_specdec.errors import ConfigError, GenerationEngineDied, PrefixSpliceError, SamplingSelfCheckFailed, SleepNotSupported
from rl_specdec.generation.config import ClusterConfig, GenerationConfig
from rl_specdec.generation.interfaces import GenerationOutput, RolloutEngine, SamplingSettings
from rl_specdec.generation.prefix import replace_prefix_tokens
from rl_specdec.generation.self_check import calibration_report
from rl_specdec.generation.spec_config import validate_speculative_config, validate_vllm_kwargs


def __getattr__(name):  # import Ray only when an engine group is asked for
    if name in ("VllmGeneration", "AsyncVllmGeneration"):
        from rl_specdec.generation import group

        return getattr(group, name)
    raise AttributeError(name)


__all__ = [
    "AsyncVllmGeneration",
    "ClusterConfig",
    "ConfigError",
    "GenerationConfig",
    "GenerationEngineDied",
    "GenerationOutput",
    "PrefixSpliceError",
    "RolloutEngine",
    "SamplingSelfCheckFailed",
    "SamplingSettings",
    "SleepNotSupported",
    "VllmGeneration",
    "calibration_report",
    "replace_prefix_tokens",
    "validate_speculative_config",
    "validate_vllm_kwargs",
]
