"""A run that restarts itself (``run.max_restarts``): from its newest checkpoint, in the same process.

After a fatal fault of any of the run's processes but the driver, the run is set up again with
``resume=true`` and goes on. The faults it restarts after are deaths:

* an engine that died and was not replaced (:class:`~rl_specdec.errors.GenerationEngineDied`: replacement off
  or past ``policy.generation.engine_restart``'s bounds, a replacement that did not start);
* a policy worker that died (:class:`~rl_specdec.errors.PolicyWorkerDied`, or
  :class:`~rl_specdec.errors.ProcessDied` where the engines met its death, as in the refit's stream);
* any other of the run's Ray actors that died (the drafter's trainer: Ray's ``RayActorError``).

Anything else still ends the run, as it would meet the same error again: a config error, a stop by a signal,
a sampling self-check or an acceptance canary that failed, a checkpoint that cannot be written or read,
weights an engine does not hold as sent.

Before a restart the failed attempt's processes are gone (:func:`~rl_specdec.rollout.placement.stop_ray`).
What a restart loses is bounded by the checkpoints: an engine's death saves the trainer's newest state first
(:mod:`rl_specdec.grpo.recovery`); a dead policy worker takes the state it held, so the run goes on from the
newest checkpoint (``checkpoint.every`` bounds the steps trained again). Restarts are bounded as engine
replacements are: ``max_restarts`` per invocation, ``max_per_hour`` within any hour. ``faults/run_restarts``
counts them in every row from the restart on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from rl_specdec.config import RunConfig
from rl_specdec.errors import GenerationEngineDied, PolicyWorkerDied, ProcessDied
from rl_specdec.grpo.recovery import within_hour

logger = logging.getLogger(__name__)


def restartable() -> tuple[type[BaseException], ...]:
    """The errors that mean a process of the run died (Ray imported only when a run is on)."""
    from ray.exceptions import RayActorError

    return (GenerationEngineDied, PolicyWorkerDied, ProcessDied, RayActorError)


def refused(cfg: RunConfig, times: list[float], now: float) -> str | None:
    """Why the run may not restart again (None: it may); ``times``: when each restart so far happened."""
    c = cfg.run
    if len(times) >= c.max_restarts:
        return f"run.max_restarts={c.max_restarts} restart(s) done" if times else "run.max_restarts=0"
    recent = within_hour(times, now)
    if len(recent) >= c.max_per_hour:
        return f"{len(recent)} restarts within the last hour (run.max_per_hour={c.max_per_hour})"
    return None


def train_restarting(cfg: RunConfig, attempt: Callable[[RunConfig, int], dict[str, Any]]) -> dict[str, Any]:
    """``attempt(cfg, restarts_so_far)`` (one run to its end, :func:`rl_specdec.grpo.loop.train`), started
    again with ``resume=true`` after each death of a process, within ``cfg.run``'s bounds."""
    from rl_specdec.rollout.placement import stop_ray

    times: list[float] = []
    while True:
        try:
            return attempt(cfg, len(times))
        except restartable() as e:
            why_not = refused(cfg, times, time.monotonic())
            if why_not is not None:
                if times:
                    logger.error("the run is not restarted again: %s", why_not)
                raise
            if killed := stop_ray():  # the failed attempt's processes, before new ones start
                logger.info("killed what the failed attempt left running: %s", ", ".join(killed))
            times.append(time.monotonic())
            logger.warning(
                "restarting the run from its newest checkpoint (restart %d of run.max_restarts=%d) after %s",
                len(times),
                cfg.run.max_restarts,
                type(e).__name__,
            )
            cfg = dataclasses.replace(cfg, resume=True)
