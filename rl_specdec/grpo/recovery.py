"""An engine that dies is replaced, and the run goes on (``policy.generation.engine_restart``).

An engine holds nothing the trainer cannot give it again: its weights come from a refit, its drafter from
the drafter's refit, its run-time k from ``set_speculation``. So when an engine's process dies (the OOM
killer, a preempted node), :class:`EngineRecovery`, called by the engine group
(:meth:`~rl_specdec.rollout.engines.EngineSlots._gather`, or the refit phase):

1. **checkpoints first**: the last finished step is saved, unless it is on disk already, whatever happens
   next (as a stop by SIGTERM does), while the trainer holds exactly that step's state (until the step's
   rollouts are back);
2. stops the run with :class:`~rl_specdec.errors.GenerationEngineDied`, naming the checkpoint and the command
   that resumes, when replacement is off, its bound is reached (``max_restarts`` per run, ``max_per_hour``
   in any hour), or the new engine does not start. A death noticed after the step's policy update (in the
   refit or validation phase) saves that update first, as step t marked incomplete (``"complete": false``
   in its ``trainer_state.json``, ``faults/incomplete_step`` in its row): a resume refits it into new
   engines, so nothing the trainer learned is lost;
3. otherwise starts a new engine in the dead one's bundle and refits the trainer's weights into the group,
   and the drafter's, verified, before it takes a request. The group then generates the dead engine's share
   of the batch again, with the same per-request seeds; the other engines keep theirs.

With ``grpo.max_staleness=1`` an engine's death stops the run: the dead engine's share, generated again
after the update that overlapped it, would come from newer weights than the rest of its batch.

``faults/engine_restarts`` counts replacements and ``faults/time_lost_s`` the seconds they took (start and
refit; the dead engine's share generated again is in ``timing/generation``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from rl_specdec.errors import GenerationEngineDied

logger = logging.getLogger(__name__)

HOUR_S = 3600.0


def within_hour(times: list[float], now: float) -> list[float]:
    """The times (time.monotonic) in ``times`` less than an hour before ``now``: what a per-hour bound counts."""
    return [t for t in times if now - t < HOUR_S]


class EngineRecovery:
    """What a GRPO run does when one of its engines dies (the group's ``on_engine_death``)."""

    def __init__(self, run, checkpoint: Callable[..., Path | None]):
        """``checkpoint(run, step, row[, complete])`` saves step ``step`` unless it is on disk, and returns its
        path (None when there is none), as after a stop (``grpo.loop.last_checkpoint``)."""
        self.run, self.checkpoint = run, checkpoint
        self.cfg = run.cfg.policy.generation.engine_restart
        self.times: list[float] = []  # when each replacement happened (time.monotonic)
        self.lost_s = 0.0

    def __call__(self, group, dead: list[int], error: BaseException) -> None:
        t0 = time.perf_counter()
        what = f"engine(s) {dead} died ({type(error).__name__})"
        if why_not := self._refused():
            raise GenerationEngineDied(f"{what}; {why_not}. {self._save_for_stop()}", dead) from error
        where = self._checkpoint_first()
        logger.warning("%s; replacing them. %s", what, where)
        try:
            group.replace_engines(dead)
        except GenerationEngineDied as e:
            raise GenerationEngineDied(f"{what}, and {e}. {self._save_for_stop(where)}", dead) from e
        self.refit(group)
        self.times.append(time.monotonic())
        self.lost_s += time.perf_counter() - t0
        logger.warning("engine(s) %s replaced and refit in %.1fs; the run goes on", dead, time.perf_counter() - t0)

    def refit(self, group) -> None:
        """The trainer's weights into every engine, and the drafter's: verified, as every refit."""
        run = self.run
        group.update_weights_buckets(run.policy.state_dict_buckets())
        run.drafter.sync(group)

    def after_refit_failed(self, error: GenerationEngineDied) -> None:
        """An engine died during the refit phase: replace the dead ones; their refit gives every engine the
        trainer's weights, so the phase is done."""
        group = self.run.generation
        dead = group.dead_engines()
        if not dead:
            raise error
        self(group, dead, error)

    def _refused(self) -> str | None:
        c = self.cfg
        if not c.enabled:
            return "policy.generation.engine_restart.enabled=false, so the run stops"
        if self.run.pipeline is not None:  # the dead share, generated again now, would come from newer weights
            return "with grpo.max_staleness=1 a replacement would mix two policy versions in a batch, so the run stops"
        if len(self.times) >= c.max_restarts:
            return (
                f"{len(self.times)} engines were replaced already (policy.generation.engine_restart.max_restarts="
                f"{c.max_restarts}), so the run stops"
            )
        recent = within_hour(self.times, time.monotonic())
        if len(recent) >= c.max_per_hour:
            return (
                f"{len(recent)} engines were replaced within the last hour "
                f"(policy.generation.engine_restart.max_per_hour={c.max_per_hour}), so the run stops"
            )
        return None

    def _save_for_stop(self, saved: str = "") -> str:
        """The run stops: save the newest state the trainer holds, and say where the run can resume. After the
        step's update (a death noticed in the refit or validation phase) that is the updated step, marked
        incomplete: its refit or validation had not finished, and a resume refits new engines anyway."""
        run, updated = self.run, self.run.updated
        if run.checkpoints is None or run.pipeline is not None or updated is None or updated.step != run.finished + 1:
            return saved or self._checkpoint_first()
        run.drafter.after_refit(None, run.timer)  # the drafter's step of this update, finished, not refit
        row = {**updated.row(), "faults/incomplete_step": 1.0}
        path = self.checkpoint(run, updated.step, row, False)
        if path is None:
            return saved or self._checkpoint_first()
        return (
            f"Step {updated.step} was updated but its refit or validation did not finish; the trainer's state "
            f"after that update is checkpointed at {path}; {run.stop.resume_hint()}"
        )

    def _checkpoint_first(self) -> str:
        """Save the last finished step if the trainer still holds exactly it; say where the run can resume."""
        run = self.run
        resume = run.stop.resume_hint()
        if run.checkpoints is None:
            return "checkpoint.enabled=false: there is no checkpoint to resume from"
        if run.pipeline is None and not run.step_in_progress and run.finished > 0:
            path = self.checkpoint(run, run.finished, run.last_row)
            if path is not None:
                return f"The last finished step ({run.finished}) is checkpointed at {path}; {resume}"
        latest = run.checkpoints.latest()
        if latest is None:
            return "there is no checkpoint yet"
        return f"The newest checkpoint is {latest[0]} (step {latest[1]['step']}); {resume}"

    def metrics(self) -> dict[str, float]:
        return {"faults/engine_restarts": float(len(self.times)), "faults/time_lost_s": self.lost_s}
