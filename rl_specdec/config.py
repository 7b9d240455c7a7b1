"""Typed run configuration: OmegaConf YAML, validated when it is loaded.

``load_config(path, overrides)`` does, in order:

1. reads the YAML (and, recursively, the files named in its ``defaults:`` list,
   relative to it; later files override earlier ones, the file itself last);
2. applies command-line ``key=value`` overrides (any key, ``null`` allowed);
3. merges onto the typed schema below, so an unknown key or a wrong type fails
   with the key's full name and the closest valid names;
4. checks values (ranges, combinations) and the speculative config against
   vLLM's own declarations (:mod:`rl_specdec.generation.spec_config`);
5. resolves model names: ``toy:policy`` / ``toy:drafter`` are the embedded toy
   models (built and cached the first time), a local-looking path must exist;
6. resolves ``dtype: auto`` once, for the trainer and the engines together
   (:func:`resolve_dtype`): here for a local run, and in ``setup`` from the Ray
   cluster's resources when the run joins a cluster (``cluster.address``),
   whose workers may have GPUs that the driver lacks.

Everything happens before any Ray actor starts, so a bad config costs seconds.
``${...}`` interpolation works as in any OmegaConf file.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rl_specdec.errors import ConfigError
from rl_specdec.generation import speculation_control
from rl_specdec.generation.config import ClusterConfig, GenerationConfig

TOY_PREFIX = "toy:"
LOG_LEVELS = ("debug", "info", "warning", "error")
# toy:<name> -> the ToyModels attribute holding its folder
TOY_MODELS = {"policy": "policy", "drafter": "drafter", "drafter-untrained": "drafter_untrained"}


@dataclass
class PolicyConfig:
    model_name: str = "toy:policy"  # "toy:policy", a local HF folder, or a hub id
    dtype: str = "auto"  # auto (bf16 where the run has GPUs, fp32 on CPU) | float32 | bfloat16; engines use the same
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 64  # sequences per forward/backward; gradients accumulate to one step
    num_threads: Optional[int] = None  # torch threads on CPU (default: all cores)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class GRPOSettings:
    max_steps: int = 60
    num_prompts_per_step: int = 16
    num_generations_per_prompt: int = 8  # G: samples per prompt; advantages are normalised within each group
    clip_eps: float = 0.2  # clip range of the importance ratio against the generation log-probs
    kl_coef: float = 0.0  # > 0 adds a k3 KL penalty to a frozen reference copy of the initial policy
    log_kl: bool = True  # keep the reference to log train/kl even when kl_coef = 0 (one extra forward)
    normalize_std: bool = True  # divide advantages by the group's reward std (GRPO); false: mean-centre only
    # Train only on samples with a non-zero advantage when kl_coef = 0: the others add nothing to the
    # gradient (their group all scored the same), only compute. The loss is averaged over the kept tokens.
    skip_zero_advantage: bool = True
    val_every: int = 10  # validation every N steps (0: never)
    val_num_prompts: int = 64
    self_check_prompts: int = 32  # prompts for the start-up sampling self-check (0: skip)


@dataclass
class EnvConfig:
    name: str = "sorting"
    kwargs: dict[str, Any] = field(default_factory=lambda: {"min_len": 4, "max_len": 24})


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str = "offline"  # offline | online | disabled
    project: str = "rl_specdec"
    name: Optional[str] = None


@dataclass
class LoggerConfig:
    log_dir: str = "logs/grpo"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = True
    # vLLM's, Ray's and transformers' log level on the console (engines included); rl_specdec's
    # own lines (start-up summary, validation, errors) always show. "info" brings back every log.
    level: str = "error"


@dataclass
class CheckpointConfig:
    enabled: bool = True
    dir: Optional[str] = None  # default: <log_dir>/checkpoints
    every: int = 10  # save every N steps; a killed run loses at most N steps
    keep: int = 2


@dataclass
class RunConfig:
    seed: int = 0
    resume: bool = False
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    env: EnvConfig = field(default_factory=EnvConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# ---- loading ------------------------------------------------------------------
def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'defaults' forms a cycle through {[str(p) for p in seen]}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML, e.g. --config configs/grpo_spec.yaml")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in several types
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    defaults = cfg.pop("defaults", None) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged = OmegaConf.create()
    for base in defaults:
        merged = OmegaConf.merge(merged, _read_yaml(path.parent / str(base), seen + (path,)))
    _apply_replace_markers(merged, cfg)
    return OmegaConf.merge(merged, cfg)


def _apply_replace_markers(base: DictConfig, child: DictConfig, prefix: str = "") -> None:
    """A mapping with ``_replace_: true`` replaces the inherited one instead of merging into it."""
    for k in list(child.keys()):
        node = child._get_node(k)
        if isinstance(node, DictConfig):
            if node.get("_replace_", False):
                del node["_replace_"]
                if k in base:
                    base[k] = None
            elif isinstance(base.get(k), DictConfig):
                _apply_replace_markers(base[k], node, f"{prefix}{k}.")


def _all_keys(node, prefix="") -> list[str]:
    out = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            out.append(full)
            try:
                out += _all_keys(node._get_node(k), full + ".")
            except Exception:
                pass
    return out


def _wrap_omegaconf_error(e: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, ConfigKeyError) or "not in" in str(e):
        valid = _all_keys(schema)
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return ConfigError(f"unknown config key '{key}'.{hint} Remove it or fix its name (see docs/grpo.md for every key).")
    if isinstance(e, ValidationError):
        return ConfigError(f"config key '{key}' has a value of the wrong type: {str(e).splitlines()[0]}")
    return ConfigError(f"config key '{key}': {e}")


def parse_overrides(overrides: list[str]) -> DictConfig:
    for o in overrides:
        if "=" not in o or o.startswith("="):
            raise ConfigError(f"override {o!r} is not of the form key=value (e.g. grpo.max_steps=5)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"could not parse overrides {overrides}: {e}") from e


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, *, resolve_models: bool = True) -> RunConfig:
    """Load, merge, type-check, validate and resolve a run config. See module doc."""
    schema = OmegaConf.structured(RunConfig)
    raw = _read_yaml(Path(path)) if path else OmegaConf.create()
    raw = OmegaConf.merge(raw, parse_overrides(overrides or []))
    try:
        merged = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(merged)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _wrap_omegaconf_error(e, schema) from e
    validate(cfg)
    if resolve_models:
        resolve_model_paths(cfg)
    if cfg.cluster.address is None:  # a local run: this machine is where it trains and generates
        import torch

        resolve_dtype(cfg, torch.cuda.is_available())
    return cfg


# ---- validation -----------------------------------------------------------------
def _positive(name: str, value, allow_zero: bool = False):
    if value is None or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name}={value} must be {bound}")


def validate(cfg: RunConfig) -> None:
    """Value checks that need no model files."""
    g, gen, p = cfg.grpo, cfg.policy.generation, cfg.policy
    _positive("grpo.max_steps", g.max_steps)
    _positive("grpo.num_prompts_per_step", g.num_prompts_per_step)
    _positive("grpo.val_every", g.val_every, allow_zero=True)
    _positive("grpo.val_num_prompts", g.val_num_prompts, allow_zero=True)
    _positive("grpo.self_check_prompts", g.self_check_prompts, allow_zero=True)
    if g.num_generations_per_prompt < 2:
        raise ConfigError(
            f"grpo.num_generations_per_prompt={g.num_generations_per_prompt}: GRPO normalises rewards within a group, "
            "so it needs at least 2 samples per prompt (8 is typical)."
        )
    if not 0 < g.clip_eps < 1:
        raise ConfigError(f"grpo.clip_eps={g.clip_eps} must be in (0, 1); 0.2 is standard.")
    _positive("grpo.kl_coef", g.kl_coef, allow_zero=True)
    _positive("policy.learning_rate", p.learning_rate)
    _positive("policy.max_grad_norm", p.max_grad_norm)
    _positive("policy.micro_batch_size", p.micro_batch_size)
    if p.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"policy.dtype={p.dtype!r} must be one of auto, float32, bfloat16, float16")
    _positive("policy.generation.num_engines", gen.num_engines)
    _positive("policy.generation.cpus_per_engine", gen.cpus_per_engine)
    _positive("policy.generation.max_new_tokens", gen.max_new_tokens)
    if gen.temperature < 0:
        raise ConfigError(f"policy.generation.temperature={gen.temperature} must be >= 0")
    if gen.temperature == 0:
        raise ConfigError(
            "policy.generation.temperature=0 makes every sample in a GRPO group identical, so all advantages are 0; "
            "use temperature 1.0 for training (greedy is used for validation)."
        )
    if not 0 < gen.top_p <= 1:
        raise ConfigError(f"policy.generation.top_p={gen.top_p} must be in (0, 1]")
    if cfg.logger.level.lower() not in LOG_LEVELS:
        raise ConfigError(f"logger.level={cfg.logger.level!r} must be one of {', '.join(LOG_LEVELS)}")
    if cfg.logger.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r} must be offline, online or disabled")
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    validate_speculation_care(gen)
    from rl_specdec.environments import TASKS

    if cfg.env.name not in TASKS:
        raise ConfigError(f"env.name={cfg.env.name!r} is not a known task; choose one of {sorted(TASKS)}")
    if cfg.cluster.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise ConfigError(f"cluster.placement_strategy={cfg.cluster.placement_strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")


# Why online drafter training covers draft_model only (docs/speculative_decoding.md, "The drafter's lifecycle").
NOT_TRAINABLE = {
    "ngram": "proposes from the prompt and history: there is no drafter model to train",
    "ngram_gpu": "proposes from the prompt and history: there is no drafter model to train",
    "suffix": "proposes from a suffix tree of past outputs: there is no drafter model to train",
    "eagle": "trains on the target's hidden states, which vLLM's rollouts do not return; refit a head trained elsewhere",
    "eagle3": "trains on the target's hidden states, which vLLM's rollouts do not return; refit a head trained elsewhere",
    "mtp": "its heads are part of the policy checkpoint and are refit with the policy",
}


def validate_speculation_care(gen: GenerationConfig) -> None:
    """drafter_training, acceptance_canary and speculation_control: values, and what the speculation method allows."""
    d, c, key = gen.drafter_training, gen.acceptance_canary, "policy.generation"
    if c.action not in ("warn", "disable", "fail"):
        raise ConfigError(f"{key}.acceptance_canary.action={c.action!r} must be warn, disable or fail")
    if not 0 < c.min_ratio < 1:
        raise ConfigError(f"{key}.acceptance_canary.min_ratio={c.min_ratio} must be in (0, 1); 0.5 trips at half the usual acceptance")
    _positive(f"{key}.acceptance_canary.window", c.window)
    speculation_control.validate(gen)
    if not d.enabled:
        return
    for name in ("learning_rate", "steps_per_update", "every", "micro_batch_size"):
        _positive(f"{key}.drafter_training.{name}", getattr(d, name))
    if not 1 <= d.top_k <= 20:
        raise ConfigError(f"{key}.drafter_training.top_k={d.top_k} must be in 1..20 (vLLM returns at most 20 log-probs per token)")
    spec = gen.vllm_kwargs.get("speculative_config") or {}
    method = spec.get("method")
    if method is None:
        raise ConfigError(f"{key}.drafter_training.enabled=true needs speculation: set {key}.vllm_kwargs.speculative_config (method: draft_model)")
    if method != "draft_model":
        why = NOT_TRAINABLE.get(method, "is not a draft_model drafter")
        raise ConfigError(
            f"{key}.drafter_training.enabled=true with speculative_config.method={method!r}: {method} {why}. "
            f"Online drafter training needs method: draft_model; set {key}.drafter_training.enabled=false for {method}."
        )


def _resolve_one(name: str, key: str, toy_paths) -> str:
    if name.startswith(TOY_PREFIX):
        which = name[len(TOY_PREFIX):]
        if which not in TOY_MODELS:
            raise ConfigError(f"{key}={name!r}: the embedded models are {', '.join('toy:' + m for m in TOY_MODELS)}")
        return str(getattr(toy_paths(), TOY_MODELS[which]))
    looks_local = name.startswith(("/", "./", "../", "~")) or os.path.exists(name)
    if looks_local and not Path(os.path.expanduser(name)).is_dir():
        raise ConfigError(f"{key}={name!r} is not a directory; give a local Hugging Face model folder or a hub id")
    return os.path.expanduser(name) if looks_local else name


def resolve_model_paths(cfg: RunConfig) -> None:
    """Replace toy:* names with built folders and check local paths; then validate vllm_kwargs."""
    from rl_specdec.generation.spec_config import validate_vllm_kwargs

    cache: dict[str, Any] = {}

    def toy_paths():
        if "m" not in cache:
            from rl_specdec.toy.build import build_toy_models

            cache["m"] = build_toy_models()
        return cache["m"]

    cfg.policy.model_name = _resolve_one(cfg.policy.model_name, "policy.model_name", toy_paths)
    kw = cfg.policy.generation.vllm_kwargs
    spec = kw.get("speculative_config")
    if spec and spec.get("model"):
        spec["model"] = _resolve_one(spec["model"], "policy.generation.vllm_kwargs.speculative_config.model", toy_paths)
    cfg.policy.generation.vllm_kwargs = validate_vllm_kwargs(kw, cfg.policy.model_name, training=True)


def resolve_dtype(cfg: RunConfig, has_gpu: bool) -> None:
    """The one place ``dtype: auto`` is decided, for the trainer and the engines together.

    ``auto`` is bfloat16 where the run has GPUs and float32 on CPU. The engines
    sample in the trainer's precision (unless ``vllm_kwargs.dtype`` says
    otherwise), so generation and training log-probs agree. Idempotent.
    """
    if cfg.policy.dtype == "auto":
        cfg.policy.dtype = "bfloat16" if has_gpu else "float32"
    kw = cfg.policy.generation.vllm_kwargs
    if kw.get("dtype") in (None, "auto"):
        kw["dtype"] = cfg.policy.dtype


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
