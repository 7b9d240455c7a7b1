"""One GRPO step with speculative rollouts, phase by phase.

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

The loop around it (:mod:`rl_specdec.grpo.loop`) logs one row per step and
checkpoints; the run's parts are set up in :mod:`rl_specdec.grpo.run`. A
step is a pure function of the run's seed and the step number (problems and
sampling seeds), so a resumed run sees exactly the batches it would have seen.

Only token ids cross the generation boundary; text exists only where the task
verifies answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from rl_specdec.grpo.advantages import group_advantages
from rl_specdec.grpo.batch import build_train_batch, select_for_training
from rl_specdec.grpo.recovery import BASELINE, CANARY, GENERATION, REFIT, VALIDATION, Phase, Updated
from rl_specdec.grpo.rollouts import Rollouts
from rl_specdec.grpo.run import GRPORun
from rl_specdec.grpo.sources import Request
from rl_specdec.metrics import compute_spec_decode_metrics
from rl_specdec.metrics.logger import Timer
from rl_specdec.rollout import GenerationOutput, SamplingSettings
from rl_specdec.rollout.runtime_k.metrics import control_metrics

logger = logging.getLogger(__name__)


def evaluate(run: GRPORun, phase: Phase = BASELINE) -> dict[str, float]:
    """Greedy decoding on held-out problems (or episodes): ``val/reward`` and ``val/accuracy``."""
    greedy = SamplingSettings.from_config(run.cfg.policy.generation, temperature=0.0)
    rewards, correct = run.faults.guarded(phase, lambda: run.source.held_out(run.cfg.grpo.val_num_prompts, greedy))
    return {"val/reward": rewards.mean().item(), "val/accuracy": correct.mean().item()}


def sampling_check(run: GRPORun) -> dict[str, float]:
    """Refuse to train if sampled tokens are not distributed as the policy says (rollout/sampling_guard.py)."""
    n = run.cfg.grpo.self_check_prompts
    if not run.cfg.policy.generation.self_check or n == 0:
        return {}
    prompt_ids = run.source.check_prompts(n) * 4
    max_tokens, seed = run.cfg.policy.generation.max_new_tokens, run.cfg.seed
    report = run.faults.guarded(
        BASELINE, lambda: run.generation.check_sampling(prompt_ids, max_tokens=max_tokens, seed=seed)
    )
    logger.info("sampling self-check passed: %s", report.summary())
    return {
        "self_check/p_value": report.p_value,
        "self_check/chi2": report.chi2,
        "self_check/num_tokens": float(report.num_tokens),
    }


def due(step: int, every: int, last: int) -> bool:
    """Whether something that runs every ``every`` steps (and at the last one) runs after ``step`` steps."""
    return bool(every) and (step % every == 0 or step == last)


@dataclass
class Taken:
    """A step's rollouts and the problems they answer."""

    request: Request  # [P*G]: each problem (or episode) repeated G times, group-major
    rollouts: Rollouts  # their prompt ids and the engines' output, stamped with the weights that generated it


class Schedule(Protocol):
    """When a step's rollouts are generated and when the engines are refit. :class:`SequentialSteps`: each step
    generates its own, then updates and refits. One step off-policy (``grpo.max_staleness=1``):
    :class:`~rl_specdec.grpo.pipeline.PipelinedSteps` generates step t+1's rollouts while step t trains."""

    off_policy: bool  # rollouts may come from one update before the trainer's weights

    def take(self, step: int) -> Taken: ...

    def update(self, step: int, learn: Callable[[], Learned]) -> tuple[Learned, bool]: ...

    def times(self, taken: Taken, timer: Timer) -> dict[str, float]: ...

    def metrics(self, taken: Taken, keep: list[int]) -> dict[str, float]: ...


def grpo_step(run: GRPORun, step: int) -> dict[str, float]:
    """One GRPO step (0-based ``step``): phases 1-7, in the order the run's schedule sets; returns its metrics."""
    timer, schedule = run.timer, run.schedule or SequentialSteps(run)
    taken = schedule.take(step)  # 1-2. prompts and rollouts [P*G]: generated now, or during the last step
    prompt_ids, out = taken.rollouts.prompt_ids, taken.rollouts.out
    spec = after_rollouts(run, step, prompt_ids, out)  # may start the drafter's step beside the policy's update

    # 3-5. rewards, advantages, policy update; off-policy, the next step's rollouts generate meanwhile, and the
    # engines are refit only once they are in (False: a stop dropped them, the engines were busy)
    learned, refits = schedule.update(step, lambda: learn(run, taken.request, out))
    # from here a fault saves this update, marked incomplete; off-policy it stops at the newest checkpoint
    # (grpo/recovery.py)
    row = lambda: step_metrics(out, learned, spec, dict(timer.times))  # noqa: E731
    updated = None if schedule.off_policy else Updated(step + 1, row)

    if refits:
        refit(run, updated)  # 6. the engines' target model gets the new weights
    spec.update(run.drafter.after_refit(run.generation if refits else None, timer))  # and the drafter's
    spec.update(validate_if_due(run, step, updated) if refits else {})  # 7. validation
    times = schedule.times(taken, timer)
    return {**step_metrics(out, learned, spec, times), **schedule.metrics(taken, learned.keep)}


class SequentialSteps:
    """Each step generates its own rollouts with the weights the trainer holds, then updates and refits."""

    off_policy = False

    def __init__(self, run: GRPORun):
        self.run = run

    def take(self, step: int) -> Taken:
        run = self.run
        with run.timer("prompts"):  # 1. P problems (or episodes), each repeated G times (group-major)
            request = run.source.request(step)
        # 2. rollouts; the call's spec-decode counters come with them. A stop asked for meanwhile drops the step
        with run.timer("generation"), run.stop.abandonable():
            out = run.faults.guarded(GENERATION, lambda: run.source.generate(request))
        return Taken(request, Rollouts(step, request.prompt_ids, out, [step] * len(out)))

    def update(self, step: int, learn: Callable[[], Learned]) -> tuple[Learned, bool]:
        return learn(), True

    def times(self, taken: Taken, timer: Timer) -> dict[str, float]:
        return timer.pop()

    def metrics(self, taken: Taken, keep: list[int]) -> dict[str, float]:
        return {}


def after_rollouts(run: GRPORun, step: int, prompt_ids: list[list[int]], out: GenerationOutput) -> dict[str, float]:
    """The rollouts' ``spec_decode/*`` (their call's own counters), the acceptance canary, run-time k's report;
    the drafter takes its batch from them (and starts training, with ``overlap``)."""
    spec = compute_spec_decode_metrics(None, out.spec_counters)
    spec.update(control_metrics(out.spec_control))  # run-time k: k per bucket, tokens/s, the fewest running
    # the acceptance canary (and whether it drafted at all); a trip turns speculation off (grpo/recovery.py)
    spec.update(run.faults.guarded(CANARY, lambda: run.drafter.check(spec)))
    run.drafter.after_generation(step, prompt_ids, out, run.tokenizer.pad_token_id)  # may overlap the policy's update
    return spec


@dataclass
class Learned:
    """What phases 3-5 produced: rewards [N], correct [N], advantages [N], the trained indices, the update's metrics."""

    rewards: torch.Tensor
    correct: torch.Tensor
    advantages: torch.Tensor
    keep: list[int]
    train_metrics: dict[str, float]
    source_metrics: dict[str, float]  # the rollout source's own, with their prefix (episodes/*)


def learn(run: GRPORun, request: Request, out: GenerationOutput) -> Learned:
    """Phases 3-5: rewards, group advantages, and one policy update on the trajectories that carry signal."""
    g, timer = run.cfg.grpo, run.timer
    with timer("reward"):  # 3. rewards: the source's (a task's verifier, or the environment's), with trajectories
        scored = run.source.scored(request, out)
        rewards, correct = scored.rewards, scored.correct  # [P*G], [P*G]

    advantages = group_advantages(rewards, g.num_generations_per_prompt, g.normalize_std)  # 4. [P*G]

    with timer("train"):  # 5. policy update, on the samples that carry signal
        keep = select_for_training(advantages, g.skip_zero_advantage and g.kl_coef == 0)  # indices into [P*G]
        batch = build_train_batch([scored.trajectories[i] for i in keep], advantages[keep], run.tokenizer.pad_token_id)
        train_metrics = run.policy.train_step(batch, run.loss_fn)
    return Learned(rewards, correct, advantages, keep, train_metrics, scored.metrics)


def refit(run: GRPORun, updated: Updated | None) -> None:
    """Phase 6: the trainer's weights into every engine's target model, streamed in buckets (verified).
    ``updated``: the update being refit (None with one step off-policy)."""
    with run.timer("refit"):
        run.faults.guarded(
            REFIT.after(updated),
            lambda: run.generation.update_weights_buckets(run.policy.state_dict_buckets()),
        )


def validate_if_due(run: GRPORun, step: int, updated: Updated | None) -> dict[str, float]:
    """Phase 7: ``val/*`` every ``grpo.val_every`` steps and at the last one ({} otherwise)."""
    g = run.cfg.grpo
    if not due(step + 1, g.val_every, g.max_steps):
        return {}
    with run.timer("validation"):
        return evaluate(run, VALIDATION.after(updated))


def step_metrics(out: GenerationOutput, learned: Learned, extra, times) -> dict[str, float]:
    """The flat ``/``-prefixed metric dict of one step."""
    lengths = torch.tensor([len(t) for t in out.token_ids], dtype=torch.float)  # [P*G]
    rewards, correct, advantages = learned.rewards, learned.correct, learned.advantages
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std": rewards.std(unbiased=False).item(),
        "train/accuracy": correct.mean().item(),
        "train/zero_advantage_fraction": (advantages == 0).float().mean().item(),
        "train/num_samples": float(len(learned.keep)),
        **{f"train/{k}": v for k, v in learned.train_metrics.items() if k != "step_time_s"},
        **learned.source_metrics,
        "generation/num_tokens": lengths.sum().item(),
        "generation/tokens_per_s": lengths.sum().item() / max(times["timing/generation"], 1e-9),
        "generation/response_length_mean": lengths.mean().item(),
        "generation/response_length_median": lengths.median().item(),
        "generation/response_length_p90": lengths.quantile(0.9).item(),
        "generation/response_length_max": lengths.max().item(),
        "generation/truncated_fraction": sum(r == "length" for r in out.finish_reasons) / len(out.finish_reasons),
        **tail_metrics(out),
        **extra,  # spec_decode/*, drafter/*, val/*
        **times,
    }


def tail_metrics(out: GenerationOutput) -> dict[str, float]:
    """The long tail of one generation step: seconds until 50%, 90% and 100% of rollouts were done."""
    return {
        f"generation/time_to_{pct}pct_done": t
        for pct in (50, 90, 100)
        if (t := out.time_until_done(pct / 100)) is not None
    }
