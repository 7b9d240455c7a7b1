"""GRPO with speculative rollouts.

Group Relative Policy Optimization, one step at a time (:func:`grpo_step`):

1. **prompts**: take P problems from the task (deterministic in the step
   number, so a resumed run sees exactly the batches it would have seen);
2. **rollouts**: sample G responses per prompt from the vLLM engines. With
   speculation on, a drafter proposes k tokens and the policy verifies them in
   one pass; with probabilistic drafting and standard rejection sampling the
   emitted tokens are distributed exactly as plain sampling from the policy,
   and their log-probs are the policy's. Each engine returns its own
   spec-decode counters for this call, so ``spec_decode/*`` describe this
   step's requests only; with ``speculation_control`` on, each engine's
   controller chooses k between engine steps and reports its decisions;
3. **rewards** from the task's verifier;
4. **advantages**: each reward minus its group's mean, over the group's std;
5. **policy update**: one optimizer step on the clipped policy-gradient loss,
   whose importance ratio is taken against the generation log-probs (plus an
   optional KL to the initial policy). The gap between training and generation
   log-probs is logged: it is the on-policy check;
6. **refit**: the new weights go into every engine's target model;
7. **validation** every N steps (greedy, held-out problems).

:func:`train` is the loop around it: a step-0 row (the start-up sampling
self-check and the untrained policy's validation), then per step
``grpo_step`` → checkpoint (atomic, every N steps) → one logged row (wandb,
console, ``metrics.jsonl``). Before anything is generated, the engines are
loaded with the trainer's weights, so every rollout comes from the weights
the trainer holds.

Only token ids cross the generation boundary; text exists only where the task
verifies answers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_specdec.algorithms.advantages import group_advantages
from rl_specdec.algorithms.batch import Trajectory, build_train_batch, select_for_training
from rl_specdec.algorithms.checkpoint import CheckpointManager
from rl_specdec.algorithms.drafter_upkeep import DrafterUpkeep
from rl_specdec.algorithms.loss import ClippedPGLoss
from rl_specdec.config import RunConfig, check_cluster_resources, to_dict
from rl_specdec.environments import Sample, Task, make_task
from rl_specdec.generation import GenerationOutput, RolloutEngine, SamplingSettings
from rl_specdec.logging import MetricsLogger, Timer
from rl_specdec.policy import PolicyInterface
from rl_specdec.spec_decode import compute_spec_decode_metrics, control_metrics

logger = logging.getLogger(__name__)

VAL_SEED = 10**9 + 7  # validation problems never overlap a training step's seed


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

    def shutdown(self) -> None:
        self.metrics.finish()
        for part in (self.generation, self.policy, self.drafter):
            try:
                part.shutdown()
            except Exception:  # a dead actor needs no shutdown
                pass


# ---- set-up ----------------------------------------------------------------------
def setup(cfg: RunConfig) -> GRPORun:
    """Start the logger, Ray, the engines and the policy; sync weights; restore a checkpoint if resuming."""
    from transformers import AutoTokenizer

    ckpt_dir = cfg.checkpoint.dir or str(Path(cfg.logger.log_dir) / "checkpoints")
    checkpoints = CheckpointManager(ckpt_dir, cfg.checkpoint.keep) if cfg.checkpoint.enabled else None
    latest = checkpoints.latest() if (checkpoints and cfg.resume) else None
    if cfg.resume and latest is None:
        logger.warning("resume=true but no checkpoint in %s: starting from step 0", ckpt_dir)
    # first, so that a bad wandb setting fails in seconds, before any engine starts
    metrics = MetricsLogger(cfg.logger.log_dir, to_dict(cfg), cfg.logger.wandb, resume=latest is not None)
    try:
        generation, policy, drafter = _start_workers(cfg)
    except BaseException:
        metrics.finish()
        raise
    run = GRPORun(
        cfg, AutoTokenizer.from_pretrained(cfg.policy.model_name), make_task(cfg.env.name, **cfg.env.kwargs),
        policy, generation, metrics, checkpoints, ClippedPGLoss(cfg.grpo.clip_eps, cfg.grpo.kl_coef), Timer(), drafter,
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


def _start_workers(cfg: RunConfig) -> tuple[RolloutEngine, PolicyInterface, DrafterUpkeep]:
    from rl_specdec.generation.group import VllmGeneration
    from rl_specdec.generation.placement import cluster_has_gpus, init_ray
    from rl_specdec.policy import PolicyGroup

    init_ray(cfg.cluster)
    import ray

    check_cluster_resources(cfg, ray.cluster_resources())  # more GPUs/CPUs than the cluster has: fail before any actor starts
    generation = VllmGeneration(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)
    try:
        policy = PolicyGroup(cfg.policy, keep_reference=cfg.grpo.kl_coef > 0 or cfg.grpo.log_kl, seed=cfg.seed)
        drafter = DrafterUpkeep.create(cfg, cluster_has_gpus())
    except BaseException:
        generation.shutdown()
        raise
    return generation, policy, drafter


def record_environment(run: GRPORun) -> None:
    """env.txt and engine.yaml in the log folder, the engines' settings in wandb (engine/), one console line."""
    from omegaconf import OmegaConf

    from rl_specdec.env import report
    from rl_specdec.generation.settings import summary_line

    gen = run.generation
    run.metrics.write_file("env.txt", report())
    engines = [dict(info["settings"], engine=i, host=p["host"], cores=info["cpu_bind"]) for i, (info, p) in enumerate(zip(gen.engine_info, gen.placements))]
    run.metrics.write_file("engine.yaml", OmegaConf.to_yaml({"engines": engines}))
    run.metrics.add_config({"engine": gen.settings})
    logger.info("%s", summary_line(gen.settings, len(engines)))


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


# ---- the phases ------------------------------------------------------------------
def step_prompts(run: GRPORun, step: int) -> list[Sample]:
    return run.task.make_batch(seed=run.cfg.seed * 1_000_003 + step, n=run.cfg.grpo.num_prompts_per_step)


def decode_response(tokenizer, ids: list[int], finish_reason: str) -> str:
    if finish_reason == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


def score(run: GRPORun, samples: list[Sample], out: GenerationOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N], correct [N] for responses aligned with ``samples``."""
    rewards, correct = [], []
    for s, ids, reason in zip(samples, out.token_ids, out.finish_reasons):
        r = run.task.score(decode_response(run.tokenizer, ids, reason), s.answer, reason == "stop")
        rewards.append(r.reward)
        correct.append(float(r.correct))
    return torch.tensor(rewards), torch.tensor(correct)


def validate(run: GRPORun) -> dict[str, float]:
    """Greedy decoding on held-out problems."""
    samples = run.task.validation_batch(seed=VAL_SEED, n=run.cfg.grpo.val_num_prompts)
    prompt_ids = [run.tokenizer.encode(s.prompt) for s in samples]
    out = run.generation.generate(prompt_ids, SamplingSettings.from_config(run.cfg.policy.generation, temperature=0.0))
    rewards, correct = score(run, samples, out)
    return {"val/reward": rewards.mean().item(), "val/accuracy": correct.mean().item()}


def self_check(run: GRPORun) -> dict[str, float]:
    """Refuse to train if sampled tokens are not distributed as the policy says (see generation/self_check.py)."""
    n = run.cfg.grpo.self_check_prompts
    if not run.cfg.policy.generation.self_check or n == 0:
        return {}
    samples = run.task.validation_batch(seed=VAL_SEED + 1, n=n)
    prompt_ids = [run.tokenizer.encode(s.prompt) for s in samples] * 4
    report = run.generation.check_sampling(prompt_ids, max_tokens=run.cfg.policy.generation.max_new_tokens, seed=run.cfg.seed)
    logger.info("sampling self-check passed: %s", report.summary())
    return {"self_check/p_value": report.p_value, "self_check/chi2": report.chi2, "self_check/num_tokens": float(report.num_tokens)}


def due(step: int, every: int, last: int) -> bool:
    """Whether something that runs every ``every`` steps (and at the last one) runs after ``step`` steps."""
    return bool(every) and (step % every == 0 or step == last)


# ---- one step ----------------------------------------------------------------------
def grpo_step(run: GRPORun, step: int) -> dict[str, float]:
    """One GRPO step (0-based ``step``): phases 1-7; returns the step's metrics."""
    g, timer = run.cfg.grpo, run.timer
    G = g.num_generations_per_prompt

    with timer("prompts"):  # 1. P problems, each repeated G times (prompt-major)
        samples = step_prompts(run, step)
        group_samples = [s for s in samples for _ in range(G)]  # [P*G]
        prompt_ids = [ids for s in samples for ids in [run.tokenizer.encode(s.prompt)] * G]  # [P*G]

    with timer("generation"):  # 2. rollouts; the call's spec-decode counters come with them
        seed = run.cfg.seed * 1_000_003 + step * 10_007
        sampling = SamplingSettings.from_config(run.cfg.policy.generation, seed=seed, logprobs=run.drafter.top_k(step))
        out = run.generation.generate(prompt_ids, sampling)
    spec = compute_spec_decode_metrics(None, out.spec_counters)
    spec.update(run.drafter.check(spec, run.generation))  # the acceptance canary
    spec.update(control_metrics(out.spec_control))  # run-time k: k per bucket, predicted and realised tokens/s
    run.drafter.after_generation(step, prompt_ids, out, run.tokenizer.pad_token_id)  # may overlap the policy's update

    with timer("reward"):  # 3. rewards
        rewards, correct = score(run, group_samples, out)  # [P*G], [P*G]

    advantages = group_advantages(rewards, G, g.normalize_std)  # 4. [P*G]

    with timer("train"):  # 5. policy update, on the samples that carry signal
        keep = select_for_training(advantages, g.skip_zero_advantage and g.kl_coef == 0)  # indices into [P*G]
        trajectories = [Trajectory.single_turn(prompt_ids[i], out.token_ids[i], out.logprobs[i]) for i in keep]
        batch = build_train_batch(trajectories, advantages[keep], run.tokenizer.pad_token_id)
        train_metrics = run.policy.train_step(batch, run.loss_fn)

    with timer("refit"):  # 6. the engines' target model gets the new weights, streamed in buckets (verified)
        run.generation.update_weights_buckets(run.policy.state_dict_buckets())
    spec.update(run.drafter.after_refit(run.generation, timer))  # and the drafter, when it trained

    val_metrics = {}
    if due(step + 1, g.val_every, g.max_steps):  # 7. validation
        with timer("validation"):
            val_metrics = validate(run)
    return step_metrics(out, rewards, correct, advantages, len(keep), train_metrics, {**spec, **val_metrics}, timer.pop())


def step_metrics(out, rewards, correct, advantages, num_trained, train_metrics, extra, times) -> dict[str, float]:
    """The flat ``/``-prefixed metric dict of one step."""
    lengths = torch.tensor([len(t) for t in out.token_ids], dtype=torch.float)  # [P*G]
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std": rewards.std(unbiased=False).item(),
        "train/accuracy": correct.mean().item(),
        "train/zero_advantage_fraction": (advantages == 0).float().mean().item(),
        "train/num_samples": float(num_trained),
        **{f"train/{k}": v for k, v in train_metrics.items() if k != "step_time_s"},
        "generation/num_tokens": lengths.sum().item(),
        "generation/tokens_per_s": lengths.sum().item() / max(times["timing/generation"], 1e-9),
        "generation/response_length_mean": lengths.mean().item(),
        "generation/response_length_median": lengths.median().item(),
        "generation/response_length_max": lengths.max().item(),
        "generation/truncated_fraction": sum(r == "length" for r in out.finish_reasons) / len(out.finish_reasons),
        **tail_metrics(out),
        **extra,  # spec_decode/*, drafter/*, val/*
        **times,
    }


def tail_metrics(out: GenerationOutput) -> dict[str, float]:
    """The long tail of one generation step: seconds until 50%, 90% and 100% of rollouts were done."""
    return {f"generation/time_to_{pct}pct_done": t for pct in (50, 90, 100) if (t := out.time_until_done(pct / 100)) is not None}


# ---- the loop ----------------------------------------------------------------------
def save_checkpoint(run: GRPORun, step: int, row: dict[str, Any]) -> None:
    """Atomic checkpoint after ``step`` steps; it carries the step's metric row, so a crash before logging loses nothing."""
    state = {"step": step, "data_position": step, "seed": run.cfg.seed, "metrics": row}

    def save(path: str) -> None:
        run.policy.save_checkpoint(str(Path(path) / "policy"))
        run.drafter.save(Path(path))

    run.checkpoints.save(step, save, state)


def baseline(run: GRPORun) -> dict[str, Any]:
    """The step-0 row: the start-up guard and the untrained policy's validation."""
    row = self_check(run)
    if run.cfg.grpo.val_every:
        row.update(validate(run))
    if row:
        run.metrics.log(row, step=0)
    return row


def train(cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Run GRPO to ``grpo.max_steps``; returns the last step's metrics ({} if there was nothing to do)."""
    from tqdm.auto import tqdm

    run = setup(cfg)
    g, last, step = cfg.grpo, {}, run.start_step
    show = cfg.logger.progress_bar if progress is None else progress
    try:
        if run.start_step == 0 and "val/accuracy" in (row0 := baseline(run)) and show:
            tqdm.write(f"step 0: val/accuracy {row0['val/accuracy']:.3f}  (before training)")
        bar = tqdm(range(run.start_step, g.max_steps), initial=run.start_step, total=g.max_steps, desc="GRPO", disable=not show)
        for step in bar:
            t0 = time.perf_counter()
            last = grpo_step(run, step)
            if run.checkpoints and due(step + 1, cfg.checkpoint.every, g.max_steps):
                with run.timer("checkpoint"):
                    save_checkpoint(run, step + 1, last)
                last.update(run.timer.pop())
            last["timing/step"] = time.perf_counter() - t0
            run.metrics.log(last, step=step + 1)
            bar.set_postfix(_postfix(last))
            if "val/accuracy" in last:
                bar.write(f"step {step + 1}: val/accuracy {last['val/accuracy']:.3f}  train/reward {last['train/reward_mean']:.3f}")
        bar.close()
    except BaseException as e:
        latest = run.checkpoints.latest() if run.checkpoints else None
        where = f"; the last checkpoint is {latest[0]} (step {latest[1]['step']}), continue with resume=true" if latest else ""
        logger.error("GRPO stopped at step %d: %s: %s%s", step + 1, type(e).__name__, e, where)
        raise
    finally:
        run.shutdown()
    return last


def _postfix(m: dict[str, Any]) -> dict[str, str]:
    out = {"reward": f"{m['train/reward_mean']:.3f}", "acc": f"{m['train/accuracy']:.2f}"}
    if "spec_decode/acceptance_length" in m:
        out["acc_len"] = f"{m['spec_decode/acceptance_length']:.2f}"
    out["gen_tok/s"] = f"{m['generation/tokens_per_s']:.0f}"
    out["t_gen"] = f"{m['timing/generation']:.2f}s"
    out["t_train"] = f"{m['timing/train']:.2f}s"
    return out
