"""The engines of a group, one per placement-group bundle: started, replaced when one dies, restarted, stopped.

:class:`EngineSlots` is the base of :class:`~rl_specdec.rollout.group.VllmGeneration`: it owns the actors,
their bundles and CPU cores, and the way a call's results come back. Slot ``i`` is bundle ``i`` of the
group's placement group, so an engine started in a dead one's place runs where it ran, on the same cores.
A call that loses an engine mid-generation raises :class:`~rl_specdec.errors.EnginesLost`, which keeps the
other engines' shards and can generate the dead one's again (:meth:`EngineSlots._gather`). Whether to replace
and refit the engine is the run's to decide (:mod:`rl_specdec.grpo.recovery`), since only the trainer holds the
weights it must load; the group never calls back into the run.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_specdec.config.generation import ClusterConfig, GenerationConfig
from rl_specdec.errors import EnginesLost, GenerationEngineDied, ProcessDied
from rl_specdec.rollout import engine_settings
from rl_specdec.rollout.placement import (
    assign_cpu_binds,
    cluster_has_gpus,
    init_ray,
    reserve_engine_bundles,
    shard_sizes,
)

logger = logging.getLogger(__name__)
# the run's other actors, as a user knows them (Ray's report names the class)
KNOWN_PROCESSES = {"PolicyWorker": "the trainer (a policy worker)", "DrafterTrainer": "the drafter's trainer"}


def other_process_died(error: RayActorError) -> ProcessDied:
    """The death of an actor that is not an engine, named from Ray's report (its class and pid)."""
    text = str(error)
    cls = (re.search(r"class_name: (\w+)", text) or [None, ""])[1]
    pid = re.search(r"pid: (\d+)", text)
    who = KNOWN_PROCESSES.get(cls, f"the run's {cls} process" if cls else "a process of the run")
    who += f" (pid {pid[1]})" if pid else ""
    logger.debug("Ray's report of the dead process: %s", text)
    return ProcessDied(
        f"{who} died while the engines waited on its work; the engines are alive. Its process ended without an "
        "error of its own, most often the kernel's OOM killer (`dmesg | grep -i 'killed process'` shows its "
        "record), else a signal or a crash",
        cls,
    )


class EngineSlots:
    """N engines in Ray actors, one per bundle; ``worker_cls`` is the actor class (sync or async)."""

    worker_cls: type
    actor_options: dict[str, Any] = {}

    def _hold(
        self, model: str, config: GenerationConfig, cluster: ClusterConfig, seed: int, start_kwargs: dict[str, Any]
    ) -> None:
        """Every attribute the group has, before anything starts: a failed start leaves a whole, empty group."""
        self.model, self.config, self.cluster, self.seed, self._start_kwargs = (
            model,
            config,
            cluster,
            seed,
            start_kwargs,
        )
        self.workers: list[Any] = []
        self.placements: list[dict[str, Any]] = []
        self.engine_info: list[dict[str, Any]] = []
        self.binds: list[str | None] = []
        self.settings: dict[str, Any] = {}
        self.pg = self._checksummer = None
        self.start_s = 0.0
        self.k_max: int | None = None  # set_speculation's last value: a replaced engine gets it too

    def _start(self) -> None:
        """Reserve the bundles, start one actor and engine per bundle; on failure release everything and raise."""
        config = self.config
        init_ray(self.cluster)
        t0 = time.time()
        try:
            self.pg = reserve_engine_bundles(config, self.cluster, cluster_has_gpus())
            self.workers = [self._spawn(i) for i in range(config.num_engines)]
            self.placements = self._get([w.placement.remote() for w in self.workers])
            on_gpu = cluster_has_gpus()
            self.binds = (
                [None] * len(self.workers) if on_gpu else assign_cpu_binds(self.placements, config.cpus_per_engine)
            )
            self.engine_info = self._get([self._start_engine(i) for i in range(len(self.workers))])
            # what the engines really run; a setting vLLM did not honour is a warning (or, strict, an error)
            self.settings = engine_settings.check(config, [i["settings"] for i in self.engine_info], logger.warning)
        except BaseException:  # a failed start must not leave actors or reserved CPUs/GPUs behind
            self.shutdown()
            raise
        for i in range(len(self.workers)):
            self._log_started(i)
        self.start_s = time.time() - t0

    def _spawn(self, i: int):
        """An actor of ``worker_cls`` in bundle ``i`` of the group's placement group."""
        on_gpu = cluster_has_gpus()
        return (
            ray.remote(self.worker_cls)
            .options(
                num_cpus=0 if on_gpu else self.config.cpus_per_engine,
                # the bundle's GPUs, so Ray sets CUDA_VISIBLE_DEVICES for this engine (and its TP processes)
                num_gpus=int(self.config.vllm_kwargs.get("tensor_parallel_size", 1)) if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": {k: str(v) for k, v in self.config.env_vars.items()}},  # at process start
                **self.actor_options,
            )
            .remote()
        )

    def _start_engine(self, i: int) -> ray.ObjectRef:
        return self.workers[i].start_engine.remote(
            self.model, self.config, self.seed, self.binds[i], **self._start_kwargs
        )

    def _log_started(self, i: int) -> None:
        p, info = self.placements[i], self.engine_info[i]
        logger.info(
            "engine %d on %s (node %s) cores=%s started in %.1fs",
            i,
            p["host"],
            p["node_id"][:8],
            info["cpu_bind"],
            info["start_s"],
        )

    def replace_engines(self, dead: Sequence[int]) -> float:
        """Start a new actor and engine in each dead engine's bundle (same settings, cores, seed); returns seconds.

        The new engines hold the model path's weights (or dummy ones) and run-time k's last ``k_max``: refit them
        before they take a request. Raises ``GenerationEngineDied`` if one cannot start (the group is then empty:
        every engine is shut down).
        """
        t0 = time.time()
        try:
            for i in dead:
                ray.kill(self.workers[i], no_restart=True)
                self.workers[i] = self._spawn(i)
            for i, placement in zip(dead, self._get([self.workers[i].placement.remote() for i in dead])):
                self.placements[i] = placement
            for i, info in zip(dead, self._get([self._start_engine(i) for i in dead])):
                self.engine_info[i] = info
                self._log_started(i)
            if self.k_max is not None:
                self._get([self.workers[i].set_speculation.remote(self.k_max) for i in dead])
        except (GenerationEngineDied, ray.exceptions.RayError) as e:
            self.shutdown()
            raise GenerationEngineDied(f"the replacement for engine(s) {list(dead)} did not start: {e}", dead) from e
        return time.time() - t0

    def dead_engines(self, timeout_s: float = 30.0) -> list[int]:
        """The indices of engines whose actor is gone (each is asked for its placement; one still busy after
        ``timeout_s`` counts as alive)."""
        refs = [w.placement.remote() for w in self.workers]
        dead = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except RayActorError:
                dead.append(i)
            except ray.exceptions.GetTimeoutError:
                logger.info("engine %d did not answer within %gs: busy, not dead", i, timeout_s)
        return dead

    def _is_engine(self, error: RayActorError) -> bool:
        """Whether the actor Ray reports dead is one of this group's (an error that names none counts as one)."""
        ours = {w._actor_id.hex() for w in self.workers}
        if self._checksummer is not None:
            ours.add(self._checksummer._actor_id.hex())
        return getattr(error, "actor_id", None) in ours | {None}

    def _get(self, refs):
        try:
            return ray.get(refs)
        except RayActorError as e:
            if not self._is_engine(e):  # a task's input from a process that died (the trainer's refit stream)
                raise other_process_died(e) from e
            raise GenerationEngineDied(
                f"a vLLM engine actor died ({e.__class__.__name__}): {e}. "
                "Check the actor's log above (out of memory? killed?) and restart the run; "
                "resume=true continues from the last checkpoint."
            ) from e

    def _gather(self, refs: list[ray.ObjectRef], resubmit: Callable[[int], ray.ObjectRef]) -> list[Any]:
        """Each shard's result, in order (shard i ran on engine i). Engines that died raise
        :class:`~rl_specdec.errors.EnginesLost` with the others' shards kept: its ``redo`` asks ``resubmit`` for
        the dead shards again (on their replacements) and returns every shard's result."""
        return self._collect(list(range(len(refs))), list(refs), [None] * len(refs), resubmit)

    def _collect(self, todo: list[int], refs: list, out: list[Any], resubmit: Callable[[int], ray.ObjectRef]):
        dead, error = [], None
        for j in todo:
            try:
                out[j] = ray.get(refs[j])
            except RayActorError as e:
                if not self._is_engine(e):
                    raise other_process_died(e) from e
                dead.append(j)
                error = e
        if not dead:
            return out

        def redo() -> list[Any]:
            for j in dead:
                refs[j] = resubmit(j)
            return self._collect(dead, refs, out, resubmit)

        raise EnginesLost(
            f"vLLM engine(s) {dead} died ({type(error).__name__}) with their share of the call in flight: {error}. "
            "Check the actor's log above (out of memory? killed?) and restart the run; resume=true continues "
            "from the last checkpoint.",
            dead,
            redo,
        ) from error

    @property
    def num_engines(self) -> int:
        return len(self.workers)

    def _shards(self, n: int) -> list[slice]:
        """Engine i's contiguous slice of a batch of ``n``, for every engine that gets work (they come first)."""
        out, start = [], 0
        for size in shard_sizes(n, self.num_engines):
            if size:
                out.append(slice(start, start + size))
            start += size
        return out

    def restart(self, config: GenerationConfig) -> None:
        """Stop every engine and start the group again with ``config`` (same model, cluster, seed, bundles).

        On failure the group is left whole but empty (no actor, no placement group; ``num_engines`` 0) and the
        error is raised; :meth:`shutdown` is still safe to call.
        """
        self.shutdown()
        self._hold(self.model, config, self.cluster, self.seed, self._start_kwargs)
        self._start()

    def shutdown(self, wait_s: float = 30.0) -> None:
        """Stop every engine and actor and release the placement group.

        The engines stop together, within ``wait_s`` (an engine still busy with a call that a stop abandoned
        finishes it first); one that does not is killed with its actor all the same.
        """
        refs = [w.shutdown.remote() for w in self.workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
        for i, (w, ref) in enumerate(zip(self.workers, refs)):
            if ref not in done:
                logger.info("engine %d did not shut down within %gs; killing its actor", i, wait_s)
            else:
                try:
                    ray.get(ref)
                except RayActorError as e:  # dead already: killed below either way
                    logger.info("engine %d was gone at shutdown (%s); killing its actor", i, type(e).__name__)
            ray.kill(w, no_restart=True)
        if self._checksummer is not None:
            ray.kill(self._checksummer, no_restart=True)
            self._checksummer = None
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
