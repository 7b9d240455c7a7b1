"""What a run does when its engines fail it: the one place that decides (``policy.generation.engine_restart``).

The engine group only raises: :class:`~rl_specdec.errors.EnginesLost` names the dead engines and keeps the
call's other shards, and the acceptance canary raises :class:`~rl_specdec.errors.SpeculationTurnedOff`. Each
engine call of a step goes through :meth:`EngineRecovery.guarded` with the :class:`Phase` it is made in, so what
the trainer holds at that moment comes from where the call stands in the step, not from flags.

An engine holds nothing the trainer cannot give it again: its weights come from a refit, its drafter from
the drafter's refit, its run-time k from ``set_speculation``. So when an engine's process dies (the OOM
killer, a preempted node), the handler:

1. **checkpoints first**: the last finished step is saved, unless it is on disk already, whatever happens
   next (as a stop by SIGTERM does), while the trainer holds exactly that step's state (until the step's
   rollouts are back);
2. stops the run with :class:`~rl_specdec.errors.GenerationEngineDied`, naming the checkpoint and the command
   that resumes, when replacement is off, its bound is reached (``max_restarts`` per run, ``max_per_hour``
   in any hour), or the new engine does not start. A death after the step's policy update (in the refit or
   validation phase) saves that update first, as step t marked incomplete (``"complete": false`` in its
   ``trainer_state.json``, ``faults/incomplete_step`` in its row): a resume refits it into new engines, so
   nothing the trainer learned is lost. Past the run's own bound the error reaches ``run.max_restarts``
   (:mod:`rl_specdec.grpo.restarts`), which may restart the whole run from its newest checkpoint;
3. otherwise starts a new engine in the dead one's bundle and refits the trainer's weights into the group,
   and the drafter's, verified, before it takes a request. The group then generates the dead engine's share
   of the batch again (``EnginesLost.redo``), with the same per-request seeds; the other engines keep theirs.
   In the refit phase the replacement's refit is the phase's work.

With ``grpo.max_staleness=1`` an engine's death stops the run: the dead engine's share, generated again
after the update that overlapped it, would come from newer weights than the rest of its batch.

A canary that turns speculation off restarts the engines without a drafter (or sets k=0 with run-time k) and
refits the trainer's weights into them at once, so no engine ever holds weights the trainer does not.

``faults/engine_restarts`` counts replacements and ``faults/time_lost_s`` the seconds they took (start and
refit; the dead engine's share generated again is in ``timing/generation``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from rl_specdec.errors import EnginesLost, GenerationEngineDied, SpeculationTurnedOff

logger = logging.getLogger(__name__)

HOUR_S = 3600.0
T = TypeVar("T")


@dataclass
class Updated:
    """The step whose policy update the trainer holds before the step is finished, and its row so far: what a
    fault that stops the run in the refit or validation phase checkpoints."""

    step: int  # steps done, counting this one
    row: Any  # () -> the step's metrics so far


@dataclass(frozen=True)
class Phase:
    """Where in a step the engines are called, which says what the trainer holds at that moment."""

    name: str
    holds_finished: bool = False  # the trainer and drafter hold exactly the last finished step's state
    refits: bool = False  # a replacement's refit (every engine, verified) is the phase's whole work
    updated: Updated | None = None  # after the step's update: that step and its row so far

    def after(self, updated: Updated | None) -> Phase:
        """This phase of a step whose update ``updated`` describes (None with one step off-policy, whose stop
        saves the newest checkpoint)."""
        return dataclasses.replace(self, updated=updated)


BASELINE = Phase("baseline", holds_finished=True)  # the step-0 row: the sampling check, the untrained validation
GENERATION = Phase("generation", holds_finished=True)  # the step's rollouts (before the update)
CANARY = Phase("canary")  # after the rollouts, before the update; the drafter may have begun its step
REFIT = Phase("refit", refits=True)  # after the update: use .after(updated)
VALIDATION = Phase("validation")  # after the update and its refit: use .after(updated)


def within_hour(times: list[float], now: float) -> list[float]:
    """The times (time.monotonic) in ``times`` less than an hour before ``now``: what a per-hour bound counts."""
    return [t for t in times if now - t < HOUR_S]


class EngineRecovery:
    """The run's one decision on what its engines raise: replace and redo, checkpoint and stop, or turn speculation
    off (:meth:`guarded`)."""

    def __init__(self, run, checkpoint: Callable[..., Path | None]):
        """``checkpoint(run, step, row[, complete])`` saves step ``step`` unless it is on disk, and returns its
        path (None when there is none), as after a stop (``grpo.saves.last_checkpoint``)."""
        self.run, self.checkpoint = run, checkpoint
        self.cfg = run.cfg.policy.generation.engine_restart
        self.times: list[float] = []  # when each replacement happened (time.monotonic)
        self.lost_s = 0.0

    def guarded(self, phase: Phase, call: Callable[[], T]) -> T:
        """``call()`` (engine work of ``phase``); what the engines raise meanwhile is decided here. Lost engines
        are replaced and their share redone (the result is the whole call's); in a refit, the replacements'
        refit is the call's work (None). A tripped canary turns speculation off and gives its metrics."""
        try:
            return call()
        except EnginesLost as lost:
            return self._redo(phase, lost)
        except SpeculationTurnedOff as off:
            return self._speculation_off(off)
        except GenerationEngineDied as e:
            dead = self.run.generation.dead_engines() if phase.refits else []
            if not dead:
                raise
            self._replace(phase, dead, e)
            return None

    def _redo(self, phase: Phase, lost: EnginesLost):
        while True:
            self._replace(phase, lost.engines, lost)
            try:
                return lost.redo()
            except EnginesLost as again:  # a replacement died too: the same decision, counted again
                lost = again

    def _replace(self, phase: Phase, dead: list[int], error: BaseException) -> None:
        """Replace the dead engines and refit the group, or raise to stop the run with what was saved."""
        t0, group = time.perf_counter(), self.run.generation
        what = f"engine(s) {dead} died ({type(error.__cause__ or error).__name__})"
        if why_not := self._refused():
            raise GenerationEngineDied(f"{what}; {why_not}. {self._save_for_stop(phase)}", dead) from error
        where = self._checkpoint_first(phase)
        logger.warning("%s in the %s phase; replacing them. %s", what, phase.name, where)
        try:
            group.replace_engines(dead)
        except GenerationEngineDied as e:
            raise GenerationEngineDied(f"{what}, and {e}. {self._save_for_stop(phase, where)}", dead) from e
        self.refit(group)
        self.times.append(time.monotonic())
        self.lost_s += time.perf_counter() - t0
        logger.warning("engine(s) %s replaced and refit in %.1fs; the run goes on", dead, time.perf_counter() - t0)

    def refit(self, group) -> None:
        """The trainer's weights into every engine, and the drafter's: verified, as every refit."""
        run = self.run
        group.update_weights_buckets(run.policy.state_dict_buckets())
        run.drafter.sync(group)

    def _speculation_off(self, off: SpeculationTurnedOff) -> dict[str, float]:
        """Speculation off for the rest of the run: k=0 with run-time k, else the engines restart without a
        drafter and get the trainer's weights at once (the drafter is gone with speculation)."""
        group = self.run.generation
        restarts = not group.control_on
        group.disable_speculation()
        if restarts:
            group.update_weights_buckets(self.run.policy.state_dict_buckets())
        logger.warning("%s", off)
        return off.metrics

    def _refused(self) -> str | None:
        c = self.cfg
        if not c.enabled:
            return "policy.generation.engine_restart.enabled=false, so the run stops"
        if self.run.off_policy:  # the dead share, generated again now, would come from newer weights
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

    def _save_for_stop(self, phase: Phase, saved: str = "") -> str:
        """The run stops: save the newest state the trainer holds, and say where the run can resume. After the
        step's update (a death noticed in the refit or validation phase) that is the updated step, marked
        incomplete: its refit or validation had not finished, and a resume refits new engines anyway."""
        run, updated = self.run, phase.updated
        if run.checkpoints is None or run.off_policy or updated is None or updated.step != run.finished + 1:
            return saved or self._checkpoint_first(phase)
        run.drafter.after_refit(None, run.timer)  # the drafter's step of this update, finished, not refit
        row = {**updated.row(), "faults/incomplete_step": 1.0}
        path = self.checkpoint(run, updated.step, row, False)
        if path is None:
            return saved or self._checkpoint_first(phase)
        return (
            f"Step {updated.step} was updated but its refit or validation did not finish; the trainer's state "
            f"after that update is checkpointed at {path}; {run.stop.resume_hint()}"
        )

    def _checkpoint_first(self, phase: Phase) -> str:
        """Save the last finished step if the trainer still holds exactly it; say where the run can resume."""
        run = self.run
        resume = run.stop.resume_hint()
        if run.checkpoints is None:
            return "checkpoint.enabled=false: there is no checkpoint to resume from"
        if not run.off_policy and phase.holds_finished and run.finished > 0:
            path = self.checkpoint(run, run.finished, run.last_row)
            if path is not None:
                return f"The last finished step ({run.finished}) is checkpointed at {path}; {resume}"
        latest = run.checkpoints.latest()
        if latest is None:
            return "there is no checkpoint yet"
        return f"The newest checkpoint is {latest[0]} (step {latest[1]['step']}); {resume}"

    def metrics(self) -> dict[str, float]:
        return {"faults/engine_restarts": float(len(self.times)), "faults/time_lost_s": self.lost_s}
