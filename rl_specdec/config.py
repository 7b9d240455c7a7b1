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
   models (built and cached the first time), a local-looking path must exist.

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

from rl_specdec.generation.config import ClusterConfig, GenerationConfig
from rl_specdec.generation.spec_config import ConfigError

TOY_PREFIX = "toy:"


@dataclass
class PolicyConfig:
    model_name: str = "toy:policy"  # "toy:policy", a local HF folder, or a hub id
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 64  # sequences per forward/backward (per worker); gradients accumulate to one step
    num_threads: Optional[int] = None  # torch threads per worker on CPU (default: the host's cores shared by its workers)
    device: str = "auto"  # auto (cuda where the loading process sees CUDA, else cpu) | cpu | cuda; resolved at load
    # Data parallelism: num_workers Ray actors train one model with torch.distributed (gloo on CPU,
    # NCCL on GPU). ddp replicates the model; fsdp2 shards parameters, gradients and AdamW state.
    num_workers: int = 1
    strategy: str = "ddp"  # ddp | fsdp2
    gpus_per_worker: float = 1.0  # with device=cuda; 0 = reserve none and share the engines' GPUs (cuda:<local rank>)
    cpus_per_worker: float = 0.0  # CPUs each worker reserves; 0 = none (the trainer and the engines take turns on the cores)
    placement_strategy: str = "PACK"  # Ray placement of the workers' bundles: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    refit_bucket_bytes: int = 256 * 2**20  # refit streams the weights to the engines in dicts of at most this size
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
    resolve_device_and_dtype(cfg.policy)
    if resolve_models:
        resolve_model_paths(cfg)
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
    validate_policy_parallel(p)
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
    if cfg.logger.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r} must be offline, online or disabled")
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    from rl_specdec.environments import TASKS

    if cfg.env.name not in TASKS:
        raise ConfigError(f"env.name={cfg.env.name!r} is not a known task; choose one of {sorted(TASKS)}")
    if cfg.cluster.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"cluster.placement_strategy={cfg.cluster.placement_strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
    if p.device == "cuda" and not cfg.cluster.address and not _cuda_available():
        raise ConfigError(
            "policy.device=cuda but this machine sees no CUDA device and cluster.address is not set (the local Ray instance has no GPU); "
            "set policy.device=auto or cpu, or join a GPU cluster with cluster.address"
        )


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def validate_policy_parallel(p: PolicyConfig) -> None:
    """The data-parallel keys of ``policy``: worker count, strategy, resources, refit bucket."""
    _positive("policy.num_workers", p.num_workers)
    if p.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"policy.device={p.device!r} must be auto, cpu or cuda")
    if p.strategy not in ("ddp", "fsdp2"):
        raise ConfigError(f"policy.strategy={p.strategy!r} must be ddp (replicated data parallel) or fsdp2 (sharded: FSDP2 fully_shard)")
    _positive("policy.gpus_per_worker", p.gpus_per_worker, allow_zero=True)
    _positive("policy.cpus_per_worker", p.cpus_per_worker, allow_zero=True)
    _positive("policy.refit_bucket_bytes", p.refit_bucket_bytes)
    if p.num_threads is not None:
        _positive("policy.num_threads", p.num_threads)
    if p.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"policy.placement_strategy={p.placement_strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
    if p.gpus_per_worker > 1:
        raise ConfigError(f"policy.gpus_per_worker={p.gpus_per_worker}: a worker trains on one GPU; use policy.num_workers for more GPUs")
    if p.num_workers > 1 or p.strategy == "fsdp2":
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigError(f"policy.num_workers={p.num_workers}, policy.strategy={p.strategy} need torch.distributed, which this torch build lacks; use policy.num_workers=1 with ddp")
    if p.strategy == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
        except ImportError as e:
            raise ConfigError(f"policy.strategy=fsdp2 needs torch.distributed.fsdp.fully_shard (torch >= 2.6): {e}; use policy.strategy=ddp") from e


def _resolve_one(name: str, key: str, toy_paths) -> str:
    if name.startswith(TOY_PREFIX):
        which = name[len(TOY_PREFIX):]
        if which not in ("policy", "drafter"):
            raise ConfigError(f"{key}={name!r}: the embedded models are 'toy:policy' and 'toy:drafter'")
        return str(getattr(toy_paths(), which))
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
    if "dtype" not in kw or kw["dtype"] in (None, "auto"):
        # The engine samples in the trainer's precision, so generation and training log-probs agree.
        kw["dtype"] = cfg.policy.dtype
    cfg.policy.generation.vllm_kwargs = validate_vllm_kwargs(kw, cfg.policy.model_name, training=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device_and_dtype(p: PolicyConfig, cuda_available: bool | None = None) -> None:
    """Replace 'auto' once, at load: device cuda where the loading process sees CUDA, else cpu;
    dtype bfloat16 on cuda, float32 on cpu. Workers and engines use what this leaves.

    On a Ray cluster whose head has no GPU but whose workers do, set ``policy.device=cuda``.
    """
    if p.device == "auto":
        p.device = "cuda" if (_cuda_available() if cuda_available is None else cuda_available) else "cpu"
    if p.dtype == "auto":
        p.dtype = "bfloat16" if p.device == "cuda" else "float32"


def check_cluster_resources(cfg: RunConfig, resources: dict[str, float]) -> None:
    """Fail before any actor starts if the run asks for more GPUs or CPUs than the Ray cluster has.

    ``resources`` is ``ray.cluster_resources()``. Engines count as the engine
    group reserves them (generation/vllm_generation.py ``reserve_engine_bundles``):
    ``tensor_parallel_size`` GPUs + 1 CPU each on a GPU cluster, ``cpus_per_engine``
    CPUs each otherwise. Policy workers reserve ``gpus_per_worker`` (with
    device=cuda) and ``cpus_per_worker`` each.
    """
    p, gen = cfg.policy, cfg.policy.generation
    have_gpu, have_cpu = float(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    if p.device == "cuda" and have_gpu == 0:
        raise ConfigError(f"policy.device=cuda but the Ray cluster has no GPU (resources: CPU {have_cpu:g}); set policy.device=cpu or join a GPU cluster")
    tp = int(gen.vllm_kwargs.get("tensor_parallel_size") or 1)
    engine_gpu = gen.num_engines * tp if have_gpu > 0 else 0
    engine_cpu = gen.num_engines * (1 if have_gpu > 0 else gen.cpus_per_engine)
    policy_gpu = p.num_workers * p.gpus_per_worker if p.device == "cuda" else 0.0
    policy_cpu = p.num_workers * p.cpus_per_worker
    per_engine_cpu = "1 per GPU engine" if have_gpu > 0 else "cpus_per_engine"
    for what, have, pol, eng, pol_how, eng_how, fix in (
        ("GPUs", have_gpu, policy_gpu, engine_gpu,
         f"{p.num_workers} x {p.gpus_per_worker:g} (policy.num_workers x policy.gpus_per_worker)",
         f"{gen.num_engines} x {tp} (policy.generation.num_engines x tensor_parallel_size)",
         "policy.gpus_per_worker=0 shares the engines' GPUs"),
        ("CPUs", have_cpu, policy_cpu, engine_cpu,
         f"{p.num_workers} x {p.cpus_per_worker:g} (policy.num_workers x policy.cpus_per_worker)",
         f"{gen.num_engines} x {engine_cpu // max(gen.num_engines, 1)} (policy.generation.num_engines x {per_engine_cpu})",
         "policy.cpus_per_worker=0 reserves none"),
    ):
        if pol + eng > have:
            raise ConfigError(
                f"the run asks for {pol + eng:g} {what} but the Ray cluster has {have:g}: policy {pol_how} = {pol:g}, "
                f"engines {eng_how} = {eng:g}. Lower these ({fix}), or add nodes to the cluster."
            )


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
