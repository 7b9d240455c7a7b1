"""Typed run configuration, validated when it is loaded (see :mod:`rl_specdec.config.load`).

``schema``: the dataclasses (every key and its default); ``checks``: value checks;
``load``: YAML, overrides, resolution of models, device and dtype.
"""

from rl_specdec.config.checks import validate
from rl_specdec.config.load import (
    check_cluster_resources,
    load_config,
    parse_overrides,
    resolve_device_and_dtype,
    resolve_model_paths,
    to_dict,
    to_yaml,
)
from rl_specdec.config.schema import (
    CheckpointConfig,
    EnvConfig,
    GRPOSettings,
    LoggerConfig,
    PolicyConfig,
    RunConfig,
    WandbConfig,
)
from rl_specdec.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "EnvConfig",
    "GRPOSettings",
    "LoggerConfig",
    "PolicyConfig",
    "RunConfig",
    "WandbConfig",
    "check_cluster_resources",
    "load_config",
    "parse_overrides",
    "resolve_device_and_dtype",
    "resolve_model_paths",
    "to_dict",
    "to_yaml",
    "validate",
]
