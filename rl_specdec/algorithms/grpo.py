"""GRPO with speculative rollouts.

Group Relative Policy Optimization, one step at a time:

1. **prompts**: take P problems from the task (deterministic in the step
   number, so a resumed run sees exactly the batches it would have seen);
2. **rollouts**: sample G responses per prompt from the vLLM engines. With
   speculation on, a drafter proposes k tokens and the policy verifies them in
   one pass; with probabilistic drafting and standard rejection sampling the
   emitted tokens are distributed exactly as plain sampling from the policy,
   and their log-probs are the policy's. Spec-decode counters are read on
   every engine before and after, so the step's ``spec_decode/*`` metrics
   describe this step only;
3. **rewards** from the task's verifier;
4. **advantages**: each reward minus its group's mean, over the group's std;
5. **policy update**: one optimizer step on the clipped policy-gradient loss,
   whose importance ratio is taken against the generation log-probs (plus an
   optional KL to the initial policy). The gap between training and generation
   log-probs is logged: it is the on-policy check;
6. **refit**: the new weights go into every engine's target model (the drafter
   is left as it is: it goes stale as the policy drifts, which costs speed,
   never correctness);
7. **validation** every N steps (greedy, fixed prompts);
8. **logging** to wandb, the console and ``metrics.jsonl``;
9. **checkpoint** every N steps, atomically.

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
from rl_specdec.algorithms.checkpoint import CheckpointManager
from rl_specdec.algorithms.loss import ClippedPGLoss
from rl_specdec.config import RunConfig, check_cluster_resources, to_dict
from rl_specdec.environments import Sample, Task, make_task
from rl_specdec.generation import GenerationOutput, SamplingSettings
from rl_specdec.logging import MetricsLogger, Timer
from rl_specdec.spec_decode import compute_spec_decode_metrics, read_spec_counters

logger = logging.getLogger(__name__)

VAL_SEED = 10**9 + 7  # validation problems never overlap a training step's seed


@dataclass
class GRPORun:
    """Everything a run holds (instead of a long tuple)."""

    cfg: RunConfig
    tokenizer: Any
    task: Task
    policy: Any  # PolicyInterface
    generation: Any  # RolloutEngine
    metrics: MetricsLogger
    checkpoints: CheckpointManager | None
    loss_fn: ClippedPGLoss
    start_step: int = 0

    def shutdown(self) -> None:
        self.metrics.finish()
        for part in (self.generation, self.policy):
            try:
                part.shutdown()
            except Exception:  # a dead actor needs no shutdown
                pass


# ---- set-up ----------------------------------------------------------------------
def setup(cfg: RunConfig) -> GRPORun:
    """Start Ray, the engines and the policy; restore a checkpoint if resuming."""
    from transformers import AutoTokenizer

    from rl_specdec.generation.vllm_generation import VllmGeneration, init_ray
    from rl_specdec.policy import PolicyGroup

    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    task = make_task(cfg.env.name, **cfg.env.kwargs)
    ckpt_dir = cfg.checkpoint.dir or str(Path(cfg.logger.log_dir) / "checkpoints")
    checkpoints = CheckpointManager(ckpt_dir, cfg.checkpoint.keep) if cfg.checkpoint.enabled else None
    latest = checkpoints.latest() if (checkpoints and cfg.resume) else None
    if cfg.resume and latest is None:
        logger.warning("resume=true but no checkpoint in %s: starting from step 0", ckpt_dir)

    init_ray(cfg.cluster)
    import ray

    check_cluster_resources(cfg, ray.cluster_resources())  # more GPUs/CPUs than the cluster has: fail before any actor starts
    generation = VllmGeneration(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)
    try:
        policy = PolicyGroup(cfg.policy, keep_reference=cfg.grpo.kl_coef > 0 or cfg.grpo.log_kl, seed=cfg.seed)
    except Exception:
        generation.shutdown()
        raise
    start_step = 0
    if latest is not None:
        path, state = latest
        policy.load_checkpoint(str(path / "policy"))
        generation.update_weights(policy.state_dict_for_refit())
        start_step = int(state["step"])
        logger.info("resumed from %s (step %d)", path, start_step)
    metrics = MetricsLogger(cfg.logger.log_dir, to_dict(cfg), cfg.logger.wandb, resume=latest is not None)
    if latest is not None:
        metrics.truncate_after(start_step)
    loss_fn = ClippedPGLoss(cfg.grpo.clip_eps, cfg.grpo.kl_coef)
    return GRPORun(cfg, tokenizer, task, policy, generation, metrics, checkpoints, loss_fn, start_step)


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


def select_for_training(advantages: torch.Tensor, skip_zero: bool) -> list[int]:
    """Indices of the samples to train on: those with a non-zero advantage (all if none or if not skipping)."""
    keep = torch.nonzero(advantages != 0).flatten().tolist() if skip_zero else []
    return keep or list(range(advantages.numel()))


def build_train_batch(
    prompt_ids: list[list[int]], out: GenerationOutput, advantages: torch.Tensor, pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the policy worker (layout in rl_specdec/policy/worker.py)."""
    seqs = [p + r for p, r in zip(prompt_ids, out.token_ids)]
    n, t = len(seqs), max(map(len, seqs))
    input_ids = torch.full((n, t), pad_id, dtype=torch.long)  # [N, T]
    attention_mask = torch.zeros((n, t), dtype=torch.long)  # [N, T]
    loss_mask = torch.zeros((n, t - 1))  # [N, T-1]
    gen_logprobs = torch.zeros((n, t - 1))  # [N, T-1]
    for i, (p, r, lp) in enumerate(zip(prompt_ids, out.token_ids, out.logprobs)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[i, : len(p) + len(r)] = 1
        # position t predicts token t+1: response tokens sit at len(p) .. len(p)+len(r)-1
        loss_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
        gen_logprobs[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(lp)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "gen_logprobs": gen_logprobs,
        "advantages": advantages.float(),  # [N]
        "batch_num_tokens": torch.full((n,), float(loss_mask.sum().clamp(min=1))),  # [N]
    }


def validate(run: GRPORun) -> dict[str, float]:
    g = run.cfg.grpo
    samples = run.task.validation_batch(seed=VAL_SEED, n=g.val_num_prompts)
    prompt_ids = [run.tokenizer.encode(s.prompt) for s in samples]
    out = run.generation.generate(prompt_ids, SamplingSettings(max_tokens=run.cfg.policy.generation.max_new_tokens, temperature=0.0))
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


# ---- the loop ----------------------------------------------------------------------
def train(cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Run GRPO to ``grpo.max_steps``; returns the last step's metrics."""
    from tqdm.auto import tqdm

    run = setup(cfg)
    g, gen_cfg = cfg.grpo, cfg.policy.generation
    G = g.num_generations_per_prompt
    timer = Timer()
    last: dict[str, Any] = {}
    step = run.start_step
    try:
        if run.start_step == 0:  # a step-0 row: the start-up guard and the untrained policy's validation
            baseline = self_check(run)
            if g.val_every:
                baseline.update(validate(run))
            if baseline:
                run.metrics.log(baseline, step=0)
        bar = tqdm(range(run.start_step, g.max_steps), initial=run.start_step, total=g.max_steps, desc="GRPO", disable=not (cfg.logger.progress_bar if progress is None else progress))
        for step in bar:
            t_step = time.perf_counter()

            # 1. prompts: P problems, each repeated G times (prompt-major)
            with timer("prompts"):
                samples = step_prompts(run, step)
                prompt_ids = [run.tokenizer.encode(s.prompt) for s in samples]
                group_samples = [s for s in samples for _ in range(G)]  # [P*G]
                group_prompt_ids = [p for p in prompt_ids for _ in range(G)]  # [P*G]

            # 2. rollouts, between two counter snapshots
            with timer("generation"):
                spec_start = read_spec_counters(run.generation)
                out = run.generation.generate(
                    group_prompt_ids,
                    SamplingSettings(
                        max_tokens=gen_cfg.max_new_tokens,
                        temperature=gen_cfg.temperature,
                        top_p=gen_cfg.top_p,
                        top_k=gen_cfg.top_k,
                        seed=cfg.seed * 1_000_003 + step * 10_007,
                    ),
                )
                spec_end = read_spec_counters(run.generation)
            spec_metrics = compute_spec_decode_metrics(spec_start, spec_end)

            # 3. rewards
            with timer("reward"):
                rewards, correct = score(run, group_samples, out)  # [P*G], [P*G]

            # 4. advantages
            advantages = group_advantages(rewards, G, g.normalize_std)  # [P*G]

            # 5. policy update (on the samples that carry signal)
            with timer("train"):
                keep = select_for_training(advantages, g.skip_zero_advantage and g.kl_coef == 0)  # indices into [P*G]
                batch = build_train_batch(
                    [group_prompt_ids[i] for i in keep], out.select(keep), advantages[keep], run.tokenizer.pad_token_id
                )
                train_metrics = run.policy.train_step(batch, run.loss_fn)

            # 6. refit the engines' target model (the drafter stays)
            with timer("refit"):
                run.generation.update_weights(run.policy.state_dict_for_refit())

            # 7. validation
            val_metrics = {}
            if g.val_every and ((step + 1) % g.val_every == 0 or step + 1 == g.max_steps):
                with timer("validation"):
                    val_metrics = validate(run)

            # 8. logging
            lengths = torch.tensor([len(t) for t in out.token_ids], dtype=torch.float)  # [P*G]
            times = timer.pop()
            gen_time = times["timing/generation"]
            metrics = {
                "train/reward_mean": rewards.mean().item(),
                "train/reward_std": rewards.std(unbiased=False).item(),
                "train/accuracy": correct.mean().item(),
                "train/zero_advantage_fraction": (advantages == 0).float().mean().item(),
                "train/num_samples": float(len(keep)),
                **{f"train/{k}": v for k, v in train_metrics.items() if k != "step_time_s"},
                "generation/num_tokens": lengths.sum().item(),
                "generation/tokens_per_s": lengths.sum().item() / max(gen_time, 1e-9),
                "generation/response_length_mean": lengths.mean().item(),
                "generation/response_length_max": lengths.max().item(),
                "generation/truncated_fraction": sum(r == "length" for r in out.finish_reasons) / len(out.finish_reasons),
                **tail_metrics(out),
                **spec_metrics,
                **val_metrics,
                **times,
                "timing/step": time.perf_counter() - t_step,
            }
            run.metrics.log(metrics, step=step + 1)
            bar.set_postfix(_postfix(metrics))
            if val_metrics:
                bar.write(f"step {step + 1}: val/accuracy {val_metrics['val/accuracy']:.3f}  train/reward {metrics['train/reward_mean']:.3f}")
            last = metrics

            # 9. checkpoint (atomic)
            if run.checkpoints and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == g.max_steps):
                with timer("checkpoint"):
                    run.checkpoints.save(
                        step + 1,
                        lambda path: run.policy.save_checkpoint(str(Path(path) / "policy")),
                        {"step": step + 1, "data_position": step + 1, "seed": cfg.seed},
                    )
        bar.close()
    except BaseException as e:
        latest = run.checkpoints.latest() if run.checkpoints else None
        where = f"; the last checkpoint is {latest[0]} (step {latest[1]['step']}), continue with resume=true" if latest else ""
        logger.error("GRPO stopped at step %d: %s: %s%s", step + 1, type(e).__name__, e, where)
        raise
    finally:
        run.shutdown()
    return last


def tail_metrics(out: GenerationOutput) -> dict[str, float]:
    """The long tail of one generation step: seconds until 50%, 90% and 100% of rollouts were done."""
    return {
        f"generation/time_to_{pct}pct_done": t
        for pct in (50, 90, 100)
        if (t := out.time_until_done(pct / 100)) is not None
    }


def _postfix(m: dict[str, Any]) -> dict[str, str]:
    out = {"reward": f"{m['train/reward_mean']:.3f}", "acc": f"{m['train/accuracy']:.2f}"}
    if "spec_decode/acceptance_length" in m:
        out["acc_len"] = f"{m['spec_decode/acceptance_length']:.2f}"
    out["gen_tok/s"] = f"{m['generation/tokens_per_s']:.0f}"
    out["t_gen"] = f"{m['timing/generation']:.2f}s"
    out["t_train"] = f"{m['timing/train']:.2f}s"
    return out
