"""Load-time value checks: ranges, combinations, and whether the cluster can hold the run.

Each error names the key and the fix. None of these needs a model file.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import typing

from rl_specdec.config import precision
from rl_specdec.config.kinds import check_kinds
from rl_specdec.config.schema import LOG_LEVELS, GRPOConfig, PolicyConfig, RunConfig
from rl_specdec.errors import ConfigError
from rl_specdec.vllm_ext.declarations import kind_of


def validate_sampling(gen) -> None:
    """The trainer scores tokens under the policy's own distribution (temperature 1, no truncation), so the engines
    must sample from that distribution too; anything else would train off-policy without saying so."""
    if gen.temperature == 0:
        raise ConfigError(
            "policy.generation.temperature=0 makes every sample in a GRPO group identical, so all advantages are 0; "
            "use temperature 1.0 for training (greedy is used for validation)."
        )
    scored_as = (
        "the trainer scores log-probs under the unmodified policy, so sampling any other distribution is "
        "silently off-policy"
    )
    if gen.temperature != 1.0:
        raise ConfigError(f"policy.generation.temperature={gen.temperature}: {scored_as}; set it to 1.0.")
    if gen.top_p != 1.0:
        raise ConfigError(f"policy.generation.top_p={gen.top_p}: {scored_as}; set it to 1.0.")
    if gen.top_k != -1:
        raise ConfigError(f"policy.generation.top_k={gen.top_k}: {scored_as}; set it to -1 (no truncation).")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def positive(name: str, value, allow_zero: bool = False):
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value} must be a finite number")
    if value is None or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name}={value} must be {bound}")


SIGNED = {"seed", "policy.generation.top_k"}  # numbers that mean something below 0 (top_k: -1 is "no top-k")


def check_numbers(obj, prefix: str = "") -> None:
    """Every number of rl_specdec's own settings finite and, but for :data:`SIGNED`, not below 0, whether or not
    the feature it belongs to is on (a run that turns it on later meets it): the key and the fix, or nothing."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_numbers(value, f"{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in SIGNED:
            positive(key, value, allow_zero=True)


def validate(cfg: RunConfig) -> None:
    """Value checks that need no model files (the specific ones first: their messages say more)."""
    g, gen, p = cfg.grpo, cfg.policy.generation, cfg.policy
    positive("grpo.max_steps", g.max_steps)
    positive("grpo.num_prompts_per_step", g.num_prompts_per_step)
    positive("grpo.val_every", g.val_every, allow_zero=True)
    positive("grpo.val_num_prompts", g.val_num_prompts, allow_zero=True)
    positive("grpo.self_check_prompts", g.self_check_prompts, allow_zero=True)
    if g.num_generations_per_prompt < 2:
        raise ConfigError(
            f"grpo.num_generations_per_prompt={g.num_generations_per_prompt}: GRPO normalises rewards within a group, "
            "so it needs at least 2 samples per prompt (8 is typical)."
        )
    if not 0 < g.clip_eps < 1:
        raise ConfigError(f"grpo.clip_eps={g.clip_eps} must be in (0, 1); 0.2 is standard.")
    positive("grpo.kl_coef", g.kl_coef, allow_zero=True)
    validate_off_policy(g)
    positive("policy.learning_rate", p.learning_rate)
    positive("policy.max_grad_norm", p.max_grad_norm)
    positive("policy.micro_batch_size", p.micro_batch_size)
    precision.validate(p.precision)
    validate_policy_parallel(p)
    positive("policy.generation.num_engines", gen.num_engines)
    positive("policy.generation.cpus_per_engine", gen.cpus_per_engine)
    positive("policy.generation.max_new_tokens", gen.max_new_tokens)
    positive("policy.generation.engine_restart.max_restarts", gen.engine_restart.max_restarts, allow_zero=True)
    positive("policy.generation.engine_restart.max_per_hour", gen.engine_restart.max_per_hour, allow_zero=True)
    validate_sampling(gen)
    if cfg.logger.level.lower() not in LOG_LEVELS:
        raise ConfigError(f"logger.level={cfg.logger.level!r} must be one of {', '.join(LOG_LEVELS)}")
    validate_wandb(cfg.logger.wandb)
    positive("checkpoint.every", cfg.checkpoint.every)
    positive("checkpoint.keep", cfg.checkpoint.keep)
    positive("checkpoint.grace_s", cfg.checkpoint.grace_s)
    if cfg.checkpoint.on_error not in ("stop", "warn"):
        raise ConfigError(
            f"checkpoint.on_error={cfg.checkpoint.on_error!r} must be stop (a checkpoint that cannot be written "
            "stops the run) or warn (a warning, and training goes on)"
        )
    validate_restarts(cfg)  # speculation is checked as it is resolved (config/load.py::resolve), once
    from rl_specdec.tasks import TASKS

    if cfg.task.name not in TASKS:
        raise ConfigError(f"task.name={cfg.task.name!r} is not a known task; choose one of {sorted(TASKS)}")
    check_task_kwargs(cfg.task.name, TASKS[cfg.task.name], cfg.task.kwargs)
    TASKS[cfg.task.name](**cfg.task.kwargs)  # a task that checks its values raises ConfigError here, at load
    validate_episodes(cfg, TASKS[cfg.task.name])
    if cfg.cluster.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(
            f"cluster.placement_strategy={cfg.cluster.placement_strategy!r} must be PACK, SPREAD, STRICT_PACK or "
            "STRICT_SPREAD"
        )
    if p.device == "cuda" and not cfg.cluster.address and not cuda_available():
        raise ConfigError(
            "policy.device=cuda but this machine sees no CUDA device and cluster.address is not set (the local Ray "
            "instance has no GPU); "
            "set policy.device=auto or cpu, or join a GPU cluster with cluster.address"
        )
    check_numbers(cfg)


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def validate_episodes(cfg: RunConfig, task_cls) -> None:
    """A multi-turn task plays its episodes through the engines' OpenAI servers; a draft model may learn from
    them, an EAGLE-3 head not yet. A server's own settings are checked for any task."""
    from rl_specdec.tasks import is_episodic

    gen = cfg.policy.generation
    if gen.server is not None:
        gen.server.check()
    positive("task.max_turns", cfg.task.max_turns)
    positive("task.max_episode_tokens", cfg.task.max_episode_tokens)
    if not is_episodic(task_cls):
        return
    name = f"task.name={cfg.task.name}"
    if gen.server is None:
        raise ConfigError(
            f"{name} is multi-turn: its episodes run through the engines' OpenAI servers; set "
            "policy.generation.server (e.g. {tool_call_parser: hermes, enable_auto_tool_choice: true})"
        )
    if gen.drafter_training.enabled and gen.speculation is not None and gen.speculation.is_head:
        raise ConfigError(
            f"{name} is multi-turn, and an EAGLE-3 head does not train on episodes yet (a draft model does): set "
            "policy.generation.drafter_training.enabled=false, or speculate with method: draft_model"
        )


def validate_restarts(cfg: RunConfig) -> None:
    positive("run.max_restarts", cfg.run.max_restarts, allow_zero=True)
    positive("run.max_per_hour", cfg.run.max_per_hour)
    if cfg.run.max_restarts and not cfg.checkpoint.enabled:
        raise ConfigError(
            f"run.max_restarts={cfg.run.max_restarts} restarts the run from its newest checkpoint, but "
            "checkpoint.enabled=false writes none: set checkpoint.enabled=true, or run.max_restarts=0"
        )


def validate_off_policy(g: GRPOConfig) -> None:
    """``grpo.max_staleness`` and ``grpo.behaviour_is_cap``: how far the rollouts may lag, and their weight's cap."""
    if g.max_staleness not in (0, 1):
        raise ConfigError(
            f"grpo.max_staleness={g.max_staleness}: only 0 (generate, then train) and 1 (step t+1's rollouts are "
            "generated while step t trains) are supported; the engines hold one version of the weights, and a refit "
            "never happens during a generation. Set grpo.max_staleness=1 or 0."
        )
    cap = g.behaviour_is_cap
    if cap is not None and not (math.isfinite(cap) and cap >= 1):
        raise ConfigError(
            f"grpo.behaviour_is_cap={cap}: the cap of the importance weight against the generation log-probs must be "
            ">= 1 (a cap below 1 would shrink the weight of on-policy tokens too), e.g. 2; null turns it off."
        )


def validate_wandb(w) -> None:
    """``logger.wandb``: the mode, and names within wandb's limits (group 128 characters, tags 64)."""
    if w.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb.mode={w.mode!r} must be offline, online or disabled")
    for key, value, most in (("entity", w.entity, 128), ("group", w.group, 128), ("name", w.name, 128)):
        if value is not None and not 0 < len(str(value).strip()) <= most:
            raise ConfigError(f"logger.wandb.{key}={value!r} must be 1 to {most} characters, or null")
    for i, tag in enumerate(w.tags):
        if not 0 < len(str(tag).strip()) <= 64 or "," in str(tag):
            raise ConfigError(
                f"logger.wandb.tags[{i}]={tag!r}: a tag is 1 to 64 characters without a comma; "
                "write tags as a list, e.g. logger.wandb.tags=[spec,qwen3]"
            )


def check_task_kwargs(name: str, task_cls, kwargs: dict) -> None:
    """Every key of ``task.kwargs`` is an argument of the task's constructor (checked against its signature)."""
    params = inspect.signature(task_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for k in kwargs:
        if k not in valid:
            close = difflib.get_close_matches(k, valid, n=1, cutoff=0.6)
            hint = f" Did you mean task.kwargs.{close[0]}?" if close else ""
            raise ConfigError(
                f"task.kwargs.{k} is not an argument of task {name!r} ({task_cls.__name__}).{hint} "
                f"Its arguments: {', '.join(valid)}."
            )
    kinds = (
        {n: kind_of(t) for n, t in typing.get_type_hints(task_cls).items()}
        if dataclasses.is_dataclass(task_cls)
        else {}
    )
    check_kinds(kwargs, kinds, "task.kwargs")
    for k, v in kwargs.items():  # a task's counts and bounds: none means anything below 0
        if kinds.get(k) in ("int", "float") and isinstance(v, (int, float)) and not isinstance(v, bool):
            positive(f"task.kwargs.{k}", v, allow_zero=True)
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n in valid and n not in kwargs]
    if missing:
        raise ConfigError(f"task {name!r} ({task_cls.__name__}) needs task.kwargs.{missing[0]}; set it.")


def validate_policy_parallel(p: PolicyConfig) -> None:
    """The data-parallel keys of ``policy``: worker count, strategy, resources, refit bucket."""
    positive("policy.num_workers", p.num_workers)
    if p.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"policy.device={p.device!r} must be auto, cpu or cuda")
    if p.strategy not in ("ddp", "fsdp2"):
        raise ConfigError(
            f"policy.strategy={p.strategy!r} must be ddp (replicated data parallel) or fsdp2 (sharded: FSDP2 "
            "fully_shard)"
        )
    positive("policy.gpus_per_worker", p.gpus_per_worker, allow_zero=True)
    positive("policy.cpus_per_worker", p.cpus_per_worker, allow_zero=True)
    positive("policy.refit_bucket_bytes", p.refit_bucket_bytes)
    if p.num_threads is not None:
        positive("policy.num_threads", p.num_threads)
    if p.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(
            f"policy.placement_strategy={p.placement_strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"
        )
    if p.gpus_per_worker > 1:
        raise ConfigError(
            f"policy.gpus_per_worker={p.gpus_per_worker}: a worker trains on one GPU; use policy.num_workers for more "
            "GPUs"
        )
    if p.num_workers > 1 or p.strategy == "fsdp2":
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigError(
                f"policy.num_workers={p.num_workers}, policy.strategy={p.strategy} need torch.distributed, which this "
                "torch build lacks; use policy.num_workers=1 with ddp"
            )
    if p.strategy == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
        except ImportError as e:
            raise ConfigError(
                f"policy.strategy=fsdp2 needs torch.distributed.fsdp.fully_shard (torch >= 2.6): {e}; use "
                "policy.strategy=ddp"
            ) from e
