"""Typed run configuration, validated when it is loaded (see :mod:`rl_specdec.config.load`).

Every config dataclass lives here, one per idea: ``schema`` (the run: policy,
GRPO, task, logger, checkpoints), ``generation`` (the engines, the cluster,
speculation's companions), ``serving`` (vLLM's OpenAI server on async engines).
``checks``, ``speculation`` and ``vllm_kwargs`` check values when a config
loads (the last one against vLLM's own declarations, with no model file);
``load`` reads YAML and overrides, validates, and resolves device and dtype;
``models`` checks model names (building them is rl_specdec.toy.resolve's step);
``engine_args`` is the typed speculation object and what an engine receives.
"""

from rl_specdec.config.checks import validate
from rl_specdec.config.engine_args import Speculation, engine_args, generation_config
from rl_specdec.config.generation import (
    CanaryConfig,
    ClusterConfig,
    DrafterTrainingConfig,
    EngineRestartConfig,
    GenerationConfig,
    SpeculationControlConfig,
)
from rl_specdec.config.layers import parse_overrides
from rl_specdec.config.load import (
    check_cluster_resources,
    check_engine_args,
    check_runs_here,
    load_config,
    load_config_as_written,
    resolve_device_and_dtype,
    to_dict,
    to_yaml,
)
from rl_specdec.config.schema import (
    CheckpointConfig,
    GRPOConfig,
    LoggerConfig,
    PolicyConfig,
    RestartConfig,
    RunConfig,
    TaskConfig,
    WandbConfig,
)
from rl_specdec.config.serving import ServerConfig
from rl_specdec.config.vllm_kwargs import validate_speculative_config, validate_vllm_kwargs
from rl_specdec.errors import ConfigError

__all__ = [
    "CanaryConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DrafterTrainingConfig",
    "EngineRestartConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggerConfig",
    "PolicyConfig",
    "RestartConfig",
    "RunConfig",
    "ServerConfig",
    "Speculation",
    "SpeculationControlConfig",
    "TaskConfig",
    "WandbConfig",
    "check_cluster_resources",
    "check_engine_args",
    "check_runs_here",
    "engine_args",
    "generation_config",
    "load_config",
    "load_config_as_written",
    "parse_overrides",
    "resolve_device_and_dtype",
    "to_dict",
    "to_yaml",
    "validate",
    "validate_speculative_config",
    "validate_vllm_kwargs",
]
