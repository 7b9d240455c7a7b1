"""One step off-policy (``grpo.max_staleness=1``): step t+1's rollouts are generated while step t trains.

W_s are the weights after s updates; step t (0-based) trains on its rollouts R_t and turns W_t into W_{t+1}.

* Step 0 generates R_0 with W_0 and waits for it, as does any step whose rollouts are missing or unusable
  (a resume from a checkpoint without them, rollouts a stop dropped).
* Every step t starts generating R_{t+1} with the weights the engines hold, W_t, before its own update, and
  trains on R_t meanwhile. Then it waits for R_{t+1}, and only then refits W_{t+1} (and the drafter, which
  trains on R_t's top-k on the same schedule) into the engines: a refit never happens during a generation.
* So step t+1 trains W_{t+1} on rollouts of version t: staleness 1 (0 at step 0). Every sample carries its
  version; rollouts older than ``grpo.max_staleness`` are never trained on (:func:`~.rollouts.unusable`):
  that step generates its own.

The spec-decode counters still come with each generate call's output, so a step's ``spec_decode/*`` describe
the rollouts it trains on, generated (with the drafter of that time) during the step before.

A checkpoint after step t carries R_{t+1} (``rollouts.json``, inside the atomic save and its manifest), so a
resumed run trains on what the uninterrupted one would have. A stop (SIGTERM, SIGINT) while R_{t+1} is still
generating drops it: step t is finished without a refit or validation (the engines are busy) and checkpointed;
its ``trainer_state.json`` records the drop, and the resumed run generates step t+1's rollouts itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rl_specdec.config import RunConfig
from rl_specdec.grpo.recovery import GENERATION
from rl_specdec.grpo.rollouts import (
    ROLLOUTS_FILE,
    Rollouts,
    load_rollouts,
    overlap_fraction,
    save_rollouts,
    staleness_metrics,
    unusable,
)
from rl_specdec.grpo.run import GRPORun
from rl_specdec.grpo.step import Learned, Taken
from rl_specdec.grpo.stop import StopSignals
from rl_specdec.metrics.logger import Timer
from rl_specdec.rollout import GenerationOutput

logger = logging.getLogger(__name__)


def wait_or_drop(pending, stop: StopSignals) -> GenerationOutput | None:
    """The in-flight generation's output, or None once a stop is asked for while it still runs (dropped)."""
    if stop.requested:
        return pending.result() if pending.done() else None
    try:
        with stop.abandonable():
            return pending.result()
    except KeyboardInterrupt:
        if not stop.requested:
            raise
        return None


@dataclass
class Launched:
    step: int
    prompt_ids: list[list[int]]
    pending: Any  # a PendingGeneration
    version: int  # updates in the weights the engines held when it started


class PipelinedSteps:
    """The schedule of a run with ``grpo.max_staleness=1`` (:class:`~rl_specdec.grpo.step.Schedule`): step t
    trains on rollouts generated during step t-1, while step t+1's generate."""

    off_policy = True

    def __init__(self, run: GRPORun):
        self.run, self.bound = run, run.cfg.grpo.max_staleness
        self.version = run.start_step  # updates in the weights the engines hold (set-up gives them the trainer's)
        self.ready: Rollouts | None = None  # the next step's rollouts
        self.dropped = False  # a stop dropped the next step's rollouts
        self.spans: dict[str, list[tuple[float, float]]] = {"generation": [], "train": []}
        if run.start_step and run.checkpoints is not None:
            self.ready = resumed_rollouts(run.checkpoints.path(run.start_step), run.start_step)
        if run.cfg.cluster.address is None and (why := shared_cores(run.cfg, host_cores())):
            logger.warning(why)

    def take(self, step: int) -> Taken:
        """This step's samples and rollouts: the ones generated during the last step when usable, else generated
        now (a stop meanwhile drops the step, as in the sequential loop)."""
        run, (ro, self.ready, self.dropped) = self.run, (self.ready, None, False)
        self.spans = {"generation": [], "train": []}
        with run.timer("prompts"):
            request = run.source.request(step)
        prompt_ids = request.prompt_ids
        why = ro and unusable(ro, step, self.bound, prompt_ids, request.sampling.logprobs > 0, len(request.samples))
        if why:
            logger.warning(
                "step %d does not train on the rollouts it was given: %s; it generates its own", step + 1, why
            )
        if ro is None or why:
            with run.timer("generation_wait"), run.stop.abandonable():
                pending = run.source.submit(request)
                ro = self._stamped(
                    Launched(step, prompt_ids, pending, self.version), run.faults.guarded(GENERATION, pending.result)
                )
        assert max(ro.staleness()) <= self.bound, "rollouts older than grpo.max_staleness reached the update"
        return Taken(request, ro)

    def update(self, step: int, learn: Callable[[], Learned]) -> tuple[Learned, bool]:
        """Step ``step + 1``'s rollouts start with the weights the engines hold, W_t, and generate while ``learn``
        turns W_t into W_{t+1}; then they are waited for. True: the engines may take W_{t+1} now (the last step,
        or the next rollouts are in); False: a stop dropped them."""
        last = step + 1 >= self.run.cfg.grpo.max_steps
        launched = None if last else self._launch(step + 1)
        learned = learn()
        self.spans["train"] = [(a, b) for phase, a, b in self.run.timer.spans if phase == "train"]
        if launched is not None:
            self.ready = self._finish(launched)
        refits = launched is None or self.ready is not None
        if refits:  # between generations: W_{t+1}, then the drafter (a fault stops at the newest checkpoint)
            self.version = step + 1
        return learned, refits

    def times(self, taken: Taken, timer: Timer) -> dict[str, float]:
        times = timer.pop()
        times["timing/generation"] = taken.rollouts.seconds  # those trained on; the waits: timing/generation_wait
        return times

    def metrics(self, taken: Taken, keep: list[int]) -> dict[str, float]:
        return staleness_metrics(taken.rollouts, keep)

    def overlap(self, start: float, end: float) -> dict[str, float]:
        """``timing/overlap``: the fraction of [start, end] (the last step) when generation and training both ran."""
        return {"timing/overlap": overlap_fraction(self.spans["generation"], self.spans["train"], (start, end))}

    def _launch(self, step: int) -> Launched:
        with self.run.timer("prompts"):
            request = self.run.source.request(step)
        return Launched(step, request.prompt_ids, self.run.source.submit(request), self.version)

    def _finish(self, launched: Launched) -> Rollouts | None:
        with self.run.timer("generation_wait"):
            out = self.run.faults.guarded(GENERATION, lambda: wait_or_drop(launched.pending, self.run.stop))
        if out is None:
            self.dropped = True
            self.spans["generation"].append((launched.pending.launched_at, time.perf_counter()))
            logger.warning(
                "the stop dropped step %d's rollouts, still generating: step %d finishes without a refit or "
                "validation (its checkpoint records the drop), and a resumed run generates step %d's rollouts",
                launched.step + 1,
                launched.step,
                launched.step + 1,
            )
            return None
        return self._stamped(launched, out)

    def _stamped(self, launched: Launched, out: GenerationOutput) -> Rollouts:
        ro = Rollouts(launched.step, launched.prompt_ids, out, [launched.version] * len(out))
        start = launched.pending.launched_at
        self.spans["generation"].append((start, start + ro.seconds))
        return ro

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps records of the pipeline (``trainer_state.json``)."""
        carried = self.ready is not None and self.ready.step == step
        return {"max_staleness": self.bound, "rollouts": ROLLOUTS_FILE if carried else None, "dropped": self.dropped}

    def save(self, folder: Path, step: int) -> None:
        """The next step's rollouts into a checkpoint being written (after ``step`` steps), when there are any."""
        if self.ready is not None and self.ready.step == step:
            save_rollouts(folder, self.ready)


def host_cores() -> int:
    """Cores this process may run on: its affinity mask where the OS has one, else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shared_cores(cfg: RunConfig, cores: int) -> str | None:
    """Why one step off-policy will not overlap on this host, or None: CPU engines bind their OpenMP threads to
    ``num_engines x cpus_per_engine`` cores, and the trainer's threads beside them must not need those cores too."""
    p, gen = cfg.policy, cfg.policy.generation
    if p.device != "cpu":
        return None
    engine = gen.num_engines * gen.cpus_per_engine
    trainer = (p.num_threads or max(1, cores // p.num_workers)) * p.num_workers
    if engine + trainer <= cores:
        return None
    return (
        f"grpo.max_staleness=1 generates while the policy trains, but the engines' {engine} cores "
        f"(policy.generation.num_engines x cpus_per_engine) and the trainer's {trainer} threads (policy.num_threads "
        f"x num_workers) need more than this host's {cores} cores: each side will slow the other down (several "
        'times on a 2-core CPU; docs/performance.md, "One step off-policy"). Split the cores, e.g. '
        f"policy.generation.cpus_per_engine={max(1, (cores - p.num_workers) // gen.num_engines)} "
        f"policy.num_threads=1, or set grpo.max_staleness=0"
    )


def resumed_rollouts(folder: Path, step: int) -> Rollouts | None:
    """The rollouts a checkpoint carries for the step it resumes at; None (with the reason) when it has none."""
    ro = load_rollouts(folder)
    if ro is None:
        state = json.loads((folder / "trainer_state.json").read_text()).get("pipeline") or {}
        why = "a stop dropped them" if state.get("dropped") else "it was written without them"
        logger.warning("checkpoint %s carries no rollouts for step %d (%s): it generates them", folder, step + 1, why)
    return ro


def sequential_resume_note(run: GRPORun) -> None:
    """``grpo.max_staleness=0`` resuming from a checkpoint that carries rollouts: they are one update old, so the
    sequential loop does not train on them; it says so."""
    if (
        run.start_step
        and run.checkpoints is not None
        and (run.checkpoints.path(run.start_step) / ROLLOUTS_FILE).exists()
    ):
        logger.warning(
            "checkpoint step %d carries the next step's rollouts (grpo.max_staleness=1 wrote it); they are not "
            "trained on with grpo.max_staleness=0: step %d generates its own",
            run.start_step,
            run.start_step + 1,
        )
