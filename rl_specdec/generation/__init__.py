"""Rollout generation: token ids in, token ids and log-probs out.

This package knows nothing of GRPO: it offers a rollout engine (a group of
vLLM engines in Ray actors), its settings and their validation, and the CPU
fix that keeps speculative sampling lossless.
"""

from rl_specdec.generation.config import ClusterConfig, GenerationConfig
from rl_specdec.generation.interfaces import GenerationOutput, RolloutEngine, SamplingSettings
from rl_specdec.generation.prefix import PrefixSpliceError, replace_prefix_tokens
from rl_specdec.generation.self_check import SamplingSelfCheckFailed, calibration_report
from rl_specdec.generation.spec_config import ConfigError, validate_speculative_config, validate_vllm_kwargs


def __getattr__(name):  # import Ray/vLLM only when the engine is asked for
    if name in ("VllmGeneration", "GenerationEngineDied"):
        from rl_specdec.generation import vllm_generation

        return getattr(vllm_generation, name)
    raise AttributeError(name)


__all__ = [
    "ClusterConfig",
    "ConfigError",
    "GenerationConfig",
    "GenerationEngineDied",
    "GenerationOutput",
    "PrefixSpliceError",
    "RolloutEngine",
    "SamplingSelfCheckFailed",
    "SamplingSettings",
    "VllmGeneration",
    "calibration_report",
    "replace_prefix_tokens",
    "validate_speculative_config",
    "validate_vllm_kwargs",
]
