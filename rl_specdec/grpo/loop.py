"""The GRPO loop: a step-0 row, then steps, checkpoints and one logged row per step.

:func:`train` sets the run up (:mod:`rl_specdec.grpo.run`), logs a step-0 row
(the start-up sampling check and the untrained policy's held-out accuracy),
then per step runs :func:`~rl_specdec.grpo.step.grpo_step`, saves a
checkpoint every ``checkpoint.every`` steps (atomic, with a checksum
manifest), and logs the step's row to wandb, the console and
``metrics.jsonl``. Before anything is generated, the engines hold the
trainer's weights, so every rollout comes from the weights the trainer holds.
A checkpoint that cannot be written (a full disk) stops the run, or only warns
with ``checkpoint.on_error=warn``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rl_specdec.config import RunConfig
from rl_specdec.errors import CheckpointWriteFailed
from rl_specdec.grpo.run import GRPORun, setup
from rl_specdec.grpo.step import due, evaluate, grpo_step, sampling_check

logger = logging.getLogger(__name__)


def save_checkpoint(run: GRPORun, step: int, row: dict[str, Any]) -> None:
    """Atomic checkpoint after ``step`` steps; it carries the step's metric row, so a crash before logging
    loses nothing."""
    state = {"step": step, "data_position": step, "seed": run.cfg.seed, "metrics": row}

    def save(path: str) -> None:
        run.policy.save_checkpoint(str(Path(path) / "policy"))
        run.drafter.save(Path(path))

    run.checkpoints.save(step, save, state)


def baseline(run: GRPORun) -> dict[str, Any]:
    """The step-0 row: the start-up guard and the untrained policy's validation."""
    row = sampling_check(run)
    if run.cfg.grpo.val_every:
        row.update(evaluate(run))
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
        bar = tqdm(
            range(run.start_step, g.max_steps), initial=run.start_step, total=g.max_steps, desc="GRPO", disable=not show
        )
        for step in bar:
            t0 = time.perf_counter()
            last = grpo_step(run, step)
            if run.checkpoints and due(step + 1, cfg.checkpoint.every, g.max_steps):
                checkpoint_step(run, step + 1, last)
            last["timing/step"] = time.perf_counter() - t0
            run.metrics.log(last, step=step + 1)
            bar.set_postfix(_postfix(last))
            if "val/accuracy" in last:
                bar.write(
                    f"step {step + 1}: val/accuracy {last['val/accuracy']:.3f}  train/reward "
                    f"{last['train/reward_mean']:.3f}"
                )
        bar.close()
    except BaseException as e:
        latest = run.checkpoints.latest() if run.checkpoints else None
        where = (
            f"; the last checkpoint is {latest[0]} (step {latest[1]['step']}), continue with resume=true"
            if latest
            else ""
        )
        logger.error("GRPO stopped at step %d: %s: %s%s", step + 1, type(e).__name__, e, where)
        raise
    finally:
        run.shutdown()
    return last


def checkpoint_step(run: GRPORun, step: int, row: dict[str, Any]) -> None:
    """Save after ``step`` steps; a write that fails stops the run, or only warns with ``checkpoint.on_error=warn``."""
    try:
        with run.timer("checkpoint"):
            save_checkpoint(run, step, row)
    except CheckpointWriteFailed as e:
        if run.cfg.checkpoint.on_error != "warn":
            raise
        logger.warning("%s. Training goes on without it (checkpoint.on_error=warn)", e)
    row.update(run.timer.pop())


def _postfix(m: dict[str, Any]) -> dict[str, str]:
    out = {"reward": f"{m['train/reward_mean']:.3f}", "acc": f"{m['train/accuracy']:.2f}"}
    if "spec_decode/acceptance_length" in m:
        out["acc_len"] = f"{m['spec_decode/acceptance_length']:.2f}"
    out["gen_tok/s"] = f"{m['generation/tokens_per_s']:.0f}"
    out["t_gen"] = f"{m['timing/generation']:.2f}s"
    out["t_train"] = f"{m['timing/train']:.2f}s"
    return out
