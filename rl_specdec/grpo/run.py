"""A GRPO run's parts and their life: start them, restore a checkpoint, record what runs, stop them.

:func:`setup` builds a :class:`GRPORun`: after a check that this machine's vLLM
can run the speculation method, the metrics logger (first, so a bad
wandb setting fails in seconds), the tokenizer and the task (one prompt
encoded, so a chat task with a template-less tokenizer fails before any actor
starts), Ray, the engine group and the policy group (started side by
side), and the drafter's upkeep; then it restores the newest intact checkpoint when
resuming, and loads the trainer's weights into every engine before the first
rollout.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_specdec.config import RunConfig, check_cluster_resources, check_runs_here, to_dict
from rl_specdec.drafter.upkeep import DrafterUpkeep
from rl_specdec.errors import GenerationEngineDied, PolicyWorkerDied
from rl_specdec.grpo.checkpoint import CheckpointManager
from rl_specdec.grpo.episodes import EpisodeSource
from rl_specdec.grpo.loss import ClippedPGLoss
from rl_specdec.grpo.recovery import EngineRecovery
from rl_specdec.grpo.saves import last_checkpoint
from rl_specdec.grpo.sources import PromptSource, RolloutSource
from rl_specdec.grpo.stop import StopSignals
from rl_specdec.metrics.logger import MetricsLogger, Timer
from rl_specdec.policy import PolicyInterface
from rl_specdec.rollout import RolloutEngine
from rl_specdec.tasks import Task, encode_prompts, is_episodic, make_task
from rl_specdec.toy.resolve import prepare_models

logger = logging.getLogger(__name__)


@dataclass
class GRPORun:
    """Everything a run holds (instead of a long tuple)."""

    cfg: RunConfig
    tokenizer: Any
    task: Task
    policy: PolicyInterface
    generation: RolloutEngine
    metrics: MetricsLogger
    checkpoints: CheckpointManager | None
    loss_fn: ClippedPGLoss
    timer: Timer
    drafter: DrafterUpkeep
    start_step: int = 0
    stop: StopSignals = field(default_factory=StopSignals)  # SIGTERM/SIGINT: what the loop and the step check
    # when each step generates and refits: SequentialSteps (grpo/step.py; None means it too) or, with
    # grpo.max_staleness=1, PipelinedSteps (grpo/pipeline.py)
    schedule: Any = None
    faults: EngineRecovery = field(init=False)
    source: RolloutSource = field(init=False)  # what every engine call of a step goes through (grpo/recovery.py)
    finished: int = 0  # steps finished and logged
    last_row: dict[str, Any] = field(default_factory=dict)  # the last finished step's metrics
    restarts: int = 0  # times the run restarted itself before this attempt (run.max_restarts)

    def __post_init__(self) -> None:
        self.faults = EngineRecovery(self, last_checkpoint)
        # where the steps' rollouts come from: the task's prompts, or its episodes through the engines' servers
        self.source = EpisodeSource(self) if is_episodic(self.task) else PromptSource(self)

    @property
    def off_policy(self) -> bool:
        """Whether a step's rollouts may come from the weights of one update before the trainer's."""
        return self.schedule is not None and self.schedule.off_policy

    def shutdown(self) -> None:
        """Stop the engines, the policy workers and the drafter, in that order, and close the logger."""
        from ray.exceptions import RayActorError

        self.metrics.finish()
        for name, part in (("engines", self.generation), ("policy", self.policy), ("drafter", self.drafter)):
            try:
                part.shutdown()
            except (RayActorError, GenerationEngineDied, PolicyWorkerDied) as e:  # dead already: nothing to stop
                logger.info("the %s were already gone at shutdown (%s)", name, type(e).__name__)


def setup(cfg: RunConfig) -> GRPORun:
    """Prepare the models, start the logger, Ray, the engines and the policy; sync weights; restore a checkpoint if
    resuming."""
    check_runs_here(cfg)  # a method this machine's vLLM cannot run (eagle3 on the CPU build): before anything starts
    prepare_models(cfg)  # toy:* and pkg:* names become folders, built the first time
    ckpt_dir = cfg.checkpoint.dir or str(Path(cfg.logger.log_dir) / "checkpoints")
    checkpoints = CheckpointManager(ckpt_dir, cfg.checkpoint.keep) if cfg.checkpoint.enabled else None
    latest = checkpoints.latest() if (checkpoints and cfg.resume) else None
    if cfg.resume and latest is None:
        logger.warning("resume=true but no checkpoint in %s: starting from step 0", ckpt_dir)
    # first, so that a bad wandb setting fails in seconds, before any engine starts
    metrics = MetricsLogger(cfg.logger.log_dir, to_dict(cfg), cfg.logger.wandb, resume=latest is not None)
    try:
        tokenizer, task = prepare_task(cfg)  # before any actor: a task that cannot encode its prompts stops here
        generation, policy, drafter = _start_workers(cfg)
    except BaseException:
        metrics.finish()
        raise
    run = GRPORun(
        cfg,
        tokenizer,
        task,
        policy,
        generation,
        metrics,
        checkpoints,
        ClippedPGLoss(cfg.grpo.clip_eps, cfg.grpo.kl_coef, cfg.grpo.behaviour_is_cap),
        Timer(),
        drafter,
    )
    try:
        record_environment(run)
        if latest is not None:
            run.start_step = _resume(run, *latest)
        # the engines hold exactly the trainers' weights before the first rollout (dummy-loaded or not)
        generation.update_weights_buckets(policy.state_dict_buckets())
        drafter.sync(generation)
    except BaseException:
        run.shutdown()
        raise
    return run


def prepare_task(cfg: RunConfig) -> tuple[Any, Task]:
    """The policy's tokenizer and the task, with one validation prompt encoded (a chat task needs a template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    task = make_task(cfg.task.name, **cfg.task.kwargs)
    if not is_episodic(task):  # an episode's prompts are the server's to render
        encode_prompts(task, tokenizer, task.validation_batch(seed=0, n=1))
    return tokenizer, task


def _start_workers(cfg: RunConfig) -> tuple[RolloutEngine, PolicyInterface, DrafterUpkeep]:
    from rl_specdec.policy import PolicyGroup
    from rl_specdec.rollout.placement import cluster_has_gpus, init_ray

    init_ray(cfg.cluster)
    import ray

    # more GPUs/CPUs than the cluster has: fail before any actor starts
    check_cluster_resources(cfg, ray.cluster_resources())
    # The policy's workers start while the engines do: either start is mostly a new process importing its libraries.
    with ThreadPoolExecutor(1, thread_name_prefix="policy-start") as pool:
        policy_start = pool.submit(
            PolicyGroup, cfg.policy, keep_reference=cfg.grpo.kl_coef > 0 or cfg.grpo.log_kl, seed=cfg.seed
        )
        try:
            generation = engine_group(cfg)
        except BaseException:
            _discard(policy_start)
            raise
        try:
            policy = policy_start.result()
            drafter = DrafterUpkeep.create(cfg, cluster_has_gpus(), policy)
        except BaseException:
            generation.shutdown()
            _discard(policy_start)
            raise
    return generation, policy, drafter


def engine_group(cfg: RunConfig) -> RolloutEngine:
    """The engine group: with ``policy.generation.server`` set, async engines each serving vLLM's OpenAI app."""
    from rl_specdec.rollout.group import AsyncVllmGeneration, VllmGeneration

    gen = cfg.policy.generation
    if gen.server is None:
        return VllmGeneration(cfg.policy.model_name, gen, cfg.cluster, seed=cfg.seed)
    return AsyncVllmGeneration(cfg.policy.model_name, gen, cfg.cluster, seed=cfg.seed, server=gen.server)


def _discard(policy_start: Future) -> None:
    """Stop the policy group a failed start began, once it has started (or failed to, leaving nothing)."""
    try:
        policy = policy_start.result()
    except BaseException as e:  # noqa: BLE001  it left nothing behind; the caller raises the first error, this is said
        logger.warning("the policy group failed to start as well: %s: %s", type(e).__name__, e)
        return
    policy.shutdown()


def record_environment(run: GRPORun) -> None:
    """sysinfo.txt and engine.yaml in the log folder, the engines' settings in wandb (engine/), one console line."""
    from omegaconf import OmegaConf

    from rl_specdec.rollout.engine_settings import kv_shortfall, summary_line
    from rl_specdec.sysinfo import report

    gen = run.generation
    run.metrics.write_file("sysinfo.txt", report(engine=gen.engine_info[0]))
    engines = [
        dict(info["settings"], engine=i, host=p["host"], cores=info["cpu_bind"])
        for i, (info, p) in enumerate(zip(gen.engine_info, gen.placements))
    ]
    run.metrics.write_file("engine.yaml", OmegaConf.to_yaml({"engines": engines}))
    run.metrics.add_config({"engine": gen.settings})
    logger.info("%s", summary_line(gen.settings, len(engines)))
    g = run.cfg.grpo
    per_engine = -(-max(g.num_prompts_per_step * g.num_generations_per_prompt, g.val_num_prompts) // len(engines))
    if short := kv_shortfall(gen.settings, per_engine):
        logger.warning("%s", short)


def _resume(run: GRPORun, path: Path, state: dict[str, Any]) -> int:
    """Load the checkpoint's policy; keep metrics.jsonl up to its step (restoring that step's row)."""
    run.policy.load_checkpoint(str(path / "policy"))
    run.drafter.load(path)
    step = int(state["step"])
    run.metrics.truncate_after(step)
    if state.get("metrics") and step not in run.metrics.logged_steps():
        run.metrics.log(state["metrics"], step=step)  # saved with the checkpoint, lost by a crash before logging
    logger.info("resumed from %s (step %d)", path, step)
    return step
