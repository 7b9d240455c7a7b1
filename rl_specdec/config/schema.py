"""The typed run configuration: every key, its type and its default (docs/grpo.md lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rl_specdec.config.generation import ClusterConfig, GenerationConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class PolicyConfig:
    model_name: str = "toy:policy"  # "toy:policy", a local HF folder, or a hub id
    # auto (bf16-mixed on GPUs and on CPUs with native bf16, else fp32) | fp32 | bf16-mixed | bf16: the trainer's master
    # weights, AdamW state and compute (rl_specdec/policy/precision.py); the engines' dtype follows unless
    # vllm_kwargs.dtype is set
    precision: str = "auto"
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 64  # sequences per forward/backward (per worker); gradients accumulate to one step
    # one worker: each prompt's tokens computed once for the rows that share it, in the train step
    # (rl_specdec/policy/prefix.py); false: every row whole (the same numbers to float32 rounding)
    share_prefix: bool = True
    num_threads: Optional[int] = (
        None  # torch threads per worker on CPU (default: the host's cores shared by its workers)
    )
    device: str = "auto"  # auto (cuda where the loading process sees CUDA, else cpu) | cpu | cuda; resolved at load
    # Data parallelism: num_workers Ray actors train one model with torch.distributed (gloo on CPU,
    # NCCL on GPU). ddp replicates the model; fsdp2 shards parameters, gradients and AdamW state.
    num_workers: int = 1
    strategy: str = "ddp"  # ddp | fsdp2
    gpus_per_worker: float = 1.0  # with device=cuda; 0 = reserve none and share the engines' GPUs (cuda:<local rank>)
    cpus_per_worker: float = (
        0.0  # CPUs each worker reserves; 0 = none (the trainer and the engines take turns on the cores)
    )
    placement_strategy: str = (
        "PACK"  # Ray placement of the workers' bundles: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    )
    refit_bucket_bytes: int = 256 * 2**20  # refit streams the weights to the engines in dicts of at most this size
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class GRPOConfig:
    max_steps: int = 80
    num_prompts_per_step: int = 64
    num_generations_per_prompt: int = 8  # G: samples per prompt; advantages are normalised within each group
    clip_eps: float = 0.2  # clip range of the importance ratio against the generation log-probs
    kl_coef: float = 0.0  # > 0 adds a k3 KL penalty to a frozen reference copy of the initial policy
    log_kl: bool = True  # keep the reference to log train/kl even when kl_coef = 0 (one extra forward)
    normalize_std: bool = True  # divide advantages by the group's reward std (GRPO); false: mean-centre only
    # Train only on samples with a non-zero advantage when kl_coef = 0: the others add nothing to the
    # gradient (their group all scored the same), only compute. The loss is averaged over the kept tokens.
    skip_zero_advantage: bool = True
    val_every: int = 10  # validation every N steps (0: never)
    val_num_prompts: int = 256
    self_check_prompts: int = 32  # prompts for the start-up sampling self-check (0: skip)
    # 0: generate, then train, in turn. 1: step t+1's rollouts are generated with the weights before step t's
    # update while step t trains (one step off-policy; grpo/pipeline.py). Larger values are refused.
    max_staleness: int = 0
    # null: off. c >= 1: each token's importance weight against the generation log-probs is truncated at c
    # (detached), on top of the clipped ratio (grpo/loss.py)
    behaviour_is_cap: Optional[float] = None


@dataclass
class TaskConfig:
    name: str = "sorting"
    kwargs: dict[str, Any] = field(default_factory=dict)  # the task class's arguments (its defaults where unset)
    # a multi-turn task's bounds on an episode: model turns, and tokens (prompt and generation); one that reaches
    # either ends with its last step's reward
    max_turns: int = 4
    max_episode_tokens: int = 1024


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str = "offline"  # offline | online | disabled
    project: str = "rl_specdec"
    name: Optional[str] = None
    entity: Optional[str] = None  # team or user the run belongs to (default: wandb's default entity)
    group: Optional[str] = None  # runs of one group sit together (default: the run's name, e.g. grpo_spec)
    tags: list[str] = field(default_factory=list)
    notes: Optional[str] = None


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
    # After SIGTERM or SIGINT: seconds to finish (or drop) the step in progress, checkpoint it and shut down;
    # when they run out, or at a second signal, the run exits at once (grpo/stop.py)
    grace_s: float = 60.0
    on_error: str = "stop"  # a checkpoint that cannot be written (full disk): stop the run | warn and train on


@dataclass
class RestartConfig:
    """The run started again from its newest checkpoint, in the same process, after a fatal fault of any process
    but the driver (rl_specdec.grpo.restarts)."""

    max_restarts: int = 0  # restarts per invocation; 0: a fatal fault ends the run (resume=true goes on by hand)
    max_per_hour: int = 3  # restarts within any hour; a host that keeps killing the run's processes stops it


@dataclass
class RunConfig:
    seed: int = 0
    resume: bool = False
    run: RestartConfig = field(default_factory=RestartConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
