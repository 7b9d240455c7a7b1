"""What a run writes to disk after a step, a stop or a fault: one atomic checkpoint, with its metric row.

The loop saves when a checkpoint is due (:mod:`rl_specdec.grpo.loop`), a stop saves the last finished step
(:func:`last_checkpoint`), and the fault handler saves what the trainer holds before it decides
(:mod:`rl_specdec.grpo.recovery`). ``run`` is the :class:`~rl_specdec.grpo.run.GRPORun`, which imports this
module (so this one does not import it back).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rl_specdec.errors import CheckpointWriteFailed

logger = logging.getLogger(__name__)


def save_checkpoint(run, step: int, row: dict[str, Any], complete: bool = True) -> None:
    """Atomic checkpoint after ``step`` steps; it carries the step's metric row, so a crash before logging
    loses nothing, and with ``grpo.max_staleness=1`` the next step's rollouts (:mod:`rl_specdec.grpo.pipeline`).
    ``complete`` False: a fault stopped the step after its update, before its refit or validation finished."""
    state = {"step": step, "data_position": step, "seed": run.cfg.seed, "metrics": row, "complete": complete}
    if run.off_policy:
        state["pipeline"] = run.schedule.state(step)

    def save(path: str) -> None:
        run.policy.save_checkpoint(str(Path(path) / "policy"))
        run.drafter.save(Path(path))
        if run.off_policy:
            run.schedule.save(Path(path), step)

    run.checkpoints.save(step, save, state)


def last_checkpoint(run, finished: int, row: dict[str, Any], complete: bool = True) -> Path | None:
    """After a stop: the checkpoint of the last finished step, written now unless it is on disk (a step dropped
    while generating leaves the one before it, which may not have been due); None when there is none.
    ``complete`` False: ``finished`` is a step a fault stopped after its update (:func:`save_checkpoint`)."""
    if run.checkpoints is None or finished == 0:
        return None
    if not run.checkpoints.has(finished):
        try:
            save_checkpoint(run, finished, row, complete)
        except CheckpointWriteFailed as e:
            logger.error("%s", e)
            return None
    return run.checkpoints.path(finished)
