"""Stops that lose nothing: SIGTERM (a scheduler preempting the job) and SIGINT (Ctrl-C) during a GRPO run.

:class:`StopSignals` handles both while :func:`~rl_specdec.grpo.loop.train` runs. The first signal asks
for a stop:

* The step in progress is finished (train, refit, validation), checkpointed and logged. If it is still
  generating, it is dropped at once instead. Generation is one blocking call into the engines; its samples
  are worth nothing once the step cannot finish, and the grace period is better spent on the checkpoint than
  on waiting for rollouts that would be thrown away. Ray's waits give up only for ``KeyboardInterrupt``, so
  that is what the handler raises inside such a phase (:meth:`StopSignals.abandonable`: start-up, the step-0
  row, a step's generation). Anywhere else it only sets a flag, which the loop reads after each step.
* The last finished step's checkpoint is written unless it is on disk already (atomic, with its manifest),
  and its row is in ``metrics.jsonl``. The engines, the policy workers and the drafter are shut down in that
  order, then the local Ray instance, and every process it started is gone
  (:func:`~rl_specdec.rollout.placement.stop_ray`). A joined cluster (``cluster.address``) stays up.
* :class:`~rl_specdec.errors.RunStopped` carries one line: the signal, the step, the checkpoint and the
  command that resumes from it. Its exit status is 128 + the signal (143 for SIGTERM, 130 for SIGINT).

A second signal, or ``checkpoint.grace_s`` seconds after the first, exits at once (``os._exit``, the same
status): the processes the local Ray instance started are killed, and the line names the newest checkpoint on
disk. Ray's own SIGTERM handlers in the driver (``sys.exit``; the core worker's native failure handler, which
prints a stack dump and aborts with 134) are never reached: ``init_ray`` puts these handlers back after
``ray.init``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Iterator

from rl_specdec.errors import CheckpointDamaged, RunStopped
from rl_specdec.grpo.checkpoint import CheckpointManager

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """SIGTERM and SIGINT handlers for one run, installed while it is entered (a context manager)."""

    def __init__(self, grace_s: float = 60.0, resume_command: str | None = None):
        self.grace_s = grace_s
        self.resume_command = resume_command
        self.signum: int | None = None
        self.checkpoints: CheckpointManager | None = None  # set once the run has them: stop lines name its newest
        self._abandonable = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        else:
            logger.info("GRPO runs outside the main thread: SIGTERM and SIGINT keep their handlers")
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """A phase that a stop drops instead of finishing: a signal during it raises ``KeyboardInterrupt`` there
        (so does entering it once a stop was asked for). The caller tells it from a real one by :attr:`requested`.
        """
        if self.requested:
            raise KeyboardInterrupt
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            self._exit_now(signum, f"a second signal ({signal_name(signum)})")
        self.signum = signum
        why = f"checkpoint.grace_s={self.grace_s:g} ran out after {signal_name(signum)}"
        self._timer = threading.Timer(self.grace_s, self._exit_now, (signum, why))
        self._timer.daemon = True
        self._timer.start()
        logger.warning(
            "%s: %s; a second signal, or checkpoint.grace_s=%g seconds, exits at once",
            signal_name(signum),
            "dropping the step in progress (it is generating), then stopping"
            if self._abandonable
            else "finishing the step in progress, then checkpointing and stopping",
            self.grace_s,
        )
        if self._abandonable:
            raise KeyboardInterrupt

    def _exit_now(self, signum: int, why: str) -> None:
        """Exit with 128 + ``signum`` now (from the handler or the grace timer's thread), killing Ray's processes."""
        from rl_specdec.rollout.placement import kill_ray_now

        line = f"{why}: exited at once, without finishing the step in progress; {self._newest()}\n"
        os.write(2, line.encode())
        kill_ray_now()
        os._exit(128 + signum)

    def stopped(self, finished: int | None, checkpoint: Path | None) -> RunStopped:
        """The exception that ends a stopped run, after ``finished`` steps (None: while it was starting)."""
        assert self.signum is not None
        what = f"stopped by {signal_name(self.signum)}"
        if finished is None:
            line = f"{what} while the run was starting: nothing new to save; run the same command again"
        elif checkpoint is not None:
            line = f"{what} after step {finished}: checkpoint {checkpoint}; {self.resume_hint()}"
        elif finished == 0:
            line = f"{what} before the first step finished: nothing to resume; run the same command again"
        elif self.checkpoints is None:
            line = f"{what} after step {finished}: checkpoint.enabled=false, so there is no checkpoint to resume"
        else:
            line = f"{what} after step {finished}, whose checkpoint could not be written; {self._newest()}"
        return RunStopped(line, self.signum)

    def resume_hint(self) -> str:
        """How to resume: the command line when the caller gave one."""
        return f"resume with: {self.resume_command}" if self.resume_command else "resume with resume=true"

    def _newest(self) -> str:
        if self.checkpoints is None:  # still starting, or checkpoint.enabled=false
            return "run the same command again"
        try:
            latest = self.checkpoints.latest()
        except CheckpointDamaged:
            latest = None
        if latest is None:
            return "there is no checkpoint to resume from"
        return f"the newest checkpoint is {latest[0]} (step {latest[1]['step']}); {self.resume_hint()}"
