"""The GRPO loop: a step-0 row, then steps, checkpoints and one logged row per step.

:func:`train` sets the run up (:mod:`rl_specdec.grpo.run`), logs a step-0 row
(the start-up sampling check and the untrained policy's held-out accuracy),
then per step runs :func:`~rl_specdec.grpo.step.grpo_step` on the run's
schedule (with ``grpo.max_staleness=1``, :class:`~rl_specdec.grpo.pipeline.PipelinedSteps`:
the next step's rollouts are generated while this one trains), saves a
checkpoint every ``checkpoint.every`` steps (atomic, with a checksum
manifest), and logs the step's row to wandb, the console and
``metrics.jsonl``. Before anything is generated, the engines hold the
trainer's weights, so every rollout comes from the weights the trainer holds
(or, with ``grpo.max_staleness=1``, from those of one update before).

A checkpoint that cannot be written (a full disk) stops the run, or only warns
with ``checkpoint.on_error=warn``. SIGTERM and SIGINT stop it after the step in
progress (:mod:`rl_specdec.grpo.stop`): that step is checkpointed and logged,
or dropped if it was still generating, and every part is shut down.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rl_specdec.config import RunConfig
from rl_specdec.errors import CheckpointWriteFailed
from rl_specdec.grpo.pipeline import PipelinedSteps, sequential_resume_note
from rl_specdec.grpo.restarts import train_restarting
from rl_specdec.grpo.run import GRPORun, setup
from rl_specdec.grpo.saves import last_checkpoint, save_checkpoint
from rl_specdec.grpo.step import SequentialSteps, due, evaluate, grpo_step, sampling_check
from rl_specdec.grpo.stop import StopSignals

logger = logging.getLogger(__name__)


def baseline(run: GRPORun) -> dict[str, Any]:
    """The step-0 row: the start-up guard and the untrained policy's validation."""
    row = sampling_check(run)
    if run.cfg.grpo.val_every:
        row.update(evaluate(run))
    if row:
        run.metrics.log(row, step=0)
    return row


def train(cfg: RunConfig, progress: bool | None = None, resume_command: str | None = None) -> dict[str, Any]:
    """Run GRPO to ``grpo.max_steps``; returns the last step's metrics ({} if there was nothing to do).

    SIGTERM and SIGINT stop it without losing a finished step (:mod:`rl_specdec.grpo.stop`): it raises
    :class:`~rl_specdec.errors.RunStopped` once that step is checkpointed and logged and the run's processes
    are gone; its line gives ``resume_command`` (the command line that resumes) when the caller passes one.
    With ``run.max_restarts`` a process that dies restarts the run from its newest checkpoint
    (:mod:`rl_specdec.grpo.restarts`).
    """
    show = cfg.logger.progress_bar if progress is None else progress
    return train_restarting(cfg, lambda c, restarts: _attempt(c, show, resume_command, restarts))


def _attempt(cfg: RunConfig, show: bool, resume_command: str | None, restarts: int) -> dict[str, Any]:
    """One run from set-up to its end (``restarts``: how many times it was restarted before)."""
    from rl_specdec.rollout.placement import record_ray_processes, stop_ray

    with StopSignals(cfg.checkpoint.grace_s, resume_command) as stop:
        try:
            with stop.abandonable():  # a signal while the engines start stops at once: no step to save yet
                run = setup(cfg)
        except KeyboardInterrupt:
            if not stop.requested:
                raise
            stop_ray()
            raise stop.stopped(None, None) from None
        run.stop, stop.checkpoints, run.restarts = stop, run.checkpoints, restarts
        record_ray_processes()
        try:
            run.schedule = PipelinedSteps(run) if cfg.grpo.max_staleness else SequentialSteps(run)
            run.finished = run.start_step
            if not run.off_policy:
                sequential_resume_note(run)
            last, finished = run_steps(run, show)
            saved = last_checkpoint(run, finished, last) if stop.requested else None
        finally:
            record_ray_processes()  # while the tree is whole: the actors' children leave it when they are killed
            run.shutdown()
        if stop.requested:
            if killed := stop_ray():
                logger.info("killed what Ray left running after its shutdown: %s", ", ".join(killed))
            raise stop.stopped(finished, saved)
    return last


def run_steps(run: GRPORun, show: bool) -> tuple[dict[str, Any], int]:
    """The step-0 row, then the steps from ``run.start_step``; returns the last row and the steps finished.

    After a stop request it returns once the step in progress is finished, checkpointed and logged. A request
    while a step generates (or the step-0 row) drops that step at once: its rollouts are not trained on.
    """
    from tqdm.auto import tqdm

    g, last, step = run.cfg.grpo, {}, run.start_step
    bar = tqdm(total=g.max_steps, initial=run.start_step, desc="GRPO", disable=not show)
    try:
        if run.start_step == 0:
            with run.stop.abandonable():
                row0 = baseline(run)
            if "val/accuracy" in row0 and show:
                bar.write(f"step 0: val/accuracy {row0['val/accuracy']:.3f}  (before training)")
        for step in range(run.start_step, g.max_steps):
            last = step_and_log(run, step)
            bar.update(1)
            bar.set_postfix(_postfix(last))
            if "val/accuracy" in last:
                bar.write(
                    f"step {step + 1}: val/accuracy {last['val/accuracy']:.3f}  train/reward "
                    f"{last['train/reward_mean']:.3f}"
                )
            if run.stop.requested:
                return last, step + 1
    except KeyboardInterrupt:
        if not run.stop.requested:
            _log_failure(run, step, KeyboardInterrupt())
            raise
        logger.warning("step %d dropped: the stop came while it was generating; %d steps are finished", step + 1, step)
        return last, step
    except BaseException as e:
        _log_failure(run, step, e)
        raise
    finally:
        bar.close()
    return last, g.max_steps


def step_and_log(run: GRPORun, step: int) -> dict[str, Any]:
    """One step, its checkpoint when due (or when a stop was asked for), and its row in metrics.jsonl."""
    t0 = time.perf_counter()
    row = grpo_step(run, step)
    if run.checkpoints and (due(step + 1, run.cfg.checkpoint.every, run.cfg.grpo.max_steps) or run.stop.requested):
        checkpoint_step(run, step + 1, row)
    row["timing/step"] = time.perf_counter() - t0
    if run.off_policy:
        row.update(run.schedule.overlap(t0, t0 + row["timing/step"]))
    row.update(run.faults.metrics())
    if run.cfg.run.max_restarts:
        row["faults/run_restarts"] = float(run.restarts)
    run.metrics.log(row, step=step + 1)
    run.finished, run.last_row = step + 1, row
    return row


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


def _log_failure(run: GRPORun, step: int, e: BaseException) -> None:
    latest = run.checkpoints.latest() if run.checkpoints else None
    if latest:
        where = f"; the newest checkpoint is {latest[0]} (step {latest[1]['step']}): {run.stop.resume_hint()}"
    elif run.checkpoints:
        where = f"; there is no checkpoint yet (checkpoint.every={run.cfg.checkpoint.every} bounds what a fault loses)"
    else:
        where = "; checkpoint.enabled=false: there is nothing to resume from"
    from rl_specdec.grpo.restarts import restartable

    if isinstance(e, restartable()) and not run.cfg.run.max_restarts and run.checkpoints:
        where += "; run.max_restarts=1 would have restarted the run from its newest checkpoint by itself"
    logger.error("GRPO stopped at step %d: %s: %s%s", step + 1, type(e).__name__, e, where)


def _postfix(m: dict[str, Any]) -> dict[str, str]:
    out = {"reward": f"{m['train/reward_mean']:.3f}", "acc": f"{m['train/accuracy']:.2f}"}
    if "spec_decode/acceptance_length" in m:
        out["acc_len"] = f"{m['spec_decode/acceptance_length']:.2f}"
    out["gen_tok/s"] = f"{m['generation/tokens_per_s']:.0f}"
    out["t_gen"] = f"{m['timing/generation']:.2f}s"
    out["t_train"] = f"{m['timing/train']:.2f}s"
    return out
