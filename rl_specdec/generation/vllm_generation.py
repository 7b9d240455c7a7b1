"""A data-parallel group of vLLM engines in Ray actors.

``VllmGeneration`` reserves one Ray placement-group bundle per engine (CPUs on
a CPU machine, ``tensor_parallel_size`` GPUs on a GPU machine), starts one
:class:`~rl_specdec.generation.vllm_worker.VllmWorker` actor in each, and then
builds the engines. A batch of token-id prompts is cut into contiguous shards,
one per engine, generated concurrently, and gathered back in input order.

Because placement goes through a placement group, the same code spans the
nodes of an existing Ray cluster (``cluster.address``): engines land wherever
the bundles fit.

CPU cores: engines that share a host get disjoint cores for their OpenMP
threads (``VLLM_CPU_OMP_THREADS_BIND``), so two engines on a 2-core machine
do not fight over the same core.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_specdec.generation.config import ClusterConfig, GenerationConfig
from rl_specdec.generation.interfaces import GenerationOutput, SamplingSettings
from rl_specdec.generation.self_check import CalibrationReport, SamplingSelfCheckFailed, calibration_report
from rl_specdec.generation.vllm_worker import VllmWorker

logger = logging.getLogger(__name__)


class GenerationEngineDied(RuntimeError):
    """A vLLM engine actor died; the run cannot continue with this group."""


def init_ray(cluster: ClusterConfig) -> None:
    """Start or join Ray once per process."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if cluster.address:
        ray.init(address=cluster.address, **kwargs)
    else:  # "local": never attach to some other job's running cluster by accident
        ray.init(address="local", num_cpus=cluster.num_cpus, **kwargs)


def shard_sizes(n: int, k: int) -> list[int]:
    """Split n items into k contiguous shards whose sizes differ by at most 1."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def assign_cpu_binds(placements: list[dict[str, Any]], cpus_per_engine: int) -> list[str | None]:
    """Disjoint core ranges for engines on the same host ("0", "1", "0-1", ...).

    Hosts are told apart by IP and hostname, so a simulated multi-node Ray
    cluster on one machine still gets disjoint cores. ``None`` (vLLM's own
    "auto" binding) when a host has too few cores for its engines.
    """
    per_host: dict[tuple, int] = defaultdict(int)
    binds: list[str | None] = []
    for p in placements:
        key = (p["ip"], p["host"])
        j = per_host[key]
        per_host[key] += 1
        lo, hi = j * cpus_per_engine, (j + 1) * cpus_per_engine - 1
        if hi >= p["host_cpus"]:
            binds.append(None)
        else:
            binds.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return binds


def reserve_engine_bundles(config: GenerationConfig, cluster: ClusterConfig, what: str):
    """A ready placement group with one bundle per engine; returns (pg, on_gpu).

    A bundle is ``tensor_parallel_size`` GPUs (+1 CPU) on a GPU cluster, else
    ``cpus_per_engine`` CPUs.
    """
    n = config.num_engines
    on_gpu = ray.cluster_resources().get("GPU", 0) > 0
    tp = int(config.vllm_kwargs.get("tensor_parallel_size", 1))
    bundle = {"GPU": tp, "CPU": 1} if on_gpu else {"CPU": config.cpus_per_engine}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=cluster.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not reserve {n} x {bundle} for {what}={n}; the cluster has "
            f"{ray.available_resources()}. Lower num_engines or cpus_per_engine, or add nodes to the cluster."
        ) from e
    return pg, on_gpu


class VllmGeneration:
    """The rollout engine: N vLLM engines, one per Ray actor."""

    def __init__(self, model: str, config: GenerationConfig, cluster: ClusterConfig | None = None, seed: int = 0):
        self.config = config
        self.model = model
        cluster = cluster or ClusterConfig()
        init_ray(cluster)
        n = config.num_engines
        self.pg, on_gpu = reserve_engine_bundles(config, cluster, "policy.generation.num_engines")
        actor_cls = ray.remote(VllmWorker)
        self.workers = [
            actor_cls.options(
                num_cpus=0 if on_gpu else config.cpus_per_engine,
                num_gpus=0,  # the bundle holds the GPUs; vLLM places its own TP workers
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(n)
        ]
        t0 = time.time()
        try:
            self.placements = ray.get([w.placement.remote() for w in self.workers])
            binds = assign_cpu_binds(self.placements, config.cpus_per_engine) if not on_gpu else [None] * n
            self.engine_info = self._get(
                [w.start_engine.remote(model, config.vllm_kwargs, seed, b, dict(config.env_vars)) for w, b in zip(self.workers, binds)]
            )
        except BaseException:  # a failed start must not leave actors or reserved CPUs/GPUs behind
            self.shutdown()
            raise
        for i, (p, info) in enumerate(zip(self.placements, self.engine_info)):
            logger.info("engine %d on %s (node %s) cores=%s started in %.1fs", i, p["host"], p["node_id"][:8], info["cpu_bind"], info["start_s"])
        self.start_s = time.time() - t0

    # ---- helpers ------------------------------------------------------------
    def _get(self, refs):
        try:
            return ray.get(refs)
        except RayActorError as e:
            raise GenerationEngineDied(
                f"a vLLM engine actor died ({e.__class__.__name__}): {e}. "
                "Check the actor's log above (out of memory? killed?) and restart the run; "
                "resume=true continues from the last checkpoint."
            ) from e

    @property
    def num_engines(self) -> int:
        return len(self.workers)

    # ---- RolloutEngine --------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> GenerationOutput:
        sizes = shard_sizes(len(prompt_token_ids), self.num_engines)
        refs, start = [], 0
        for w, size in zip(self.workers, sizes):
            if size:
                refs.append(w.generate.remote(prompt_token_ids[start : start + size], sampling, start))
            start += size
        parts = self._get(refs)
        out = GenerationOutput(token_ids=[], logprobs=[], finish_reasons=[], top_logprobs=[] if sampling.logprobs else None)
        for p in parts:
            out.token_ids += p["token_ids"]
            out.logprobs += p["logprobs"]
            out.finish_reasons += p["finish_reasons"]
            if sampling.logprobs:
                out.top_logprobs += p["top_logprobs"]
            out.per_engine_time_s.append(p["time_s"])
            out.finish_time_s += p["finish_time_s"]
        return out

    def check_sampling(self, prompt_token_ids: list[list[int]], max_tokens: int, top_k: int = 5, seed: int = 0, min_p_value: float = 1e-6) -> CalibrationReport:
        """Sample at temperature 1 and refuse (raise) if the tokens are not distributed as the policy says.

        See :mod:`rl_specdec.generation.self_check`. Also fails when an engine's
        rejection-sampler expand path is broken on this platform.
        """
        broken = [i for i, info in enumerate(self.engine_info) if not info["expand_path_ok"]]
        if broken:
            raise SamplingSelfCheckFailed(
                f"engines {broken}: vLLM's rejection-sampler expand kernel returns wrong values on this platform, "
                "so speculative sampling at temperature > 0 would not be lossless."
            )
        out = self.generate(prompt_token_ids, SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=top_k))
        report = calibration_report(out, top_k)
        if report.p_value < min_p_value:
            raise SamplingSelfCheckFailed(
                "sampled tokens are not distributed as the policy's probabilities say (" + report.summary() + "). "
                "Speculative decoding is changing what is sampled here; refusing to train. "
                "Turn speculation off (policy.generation.vllm_kwargs.speculative_config=null) or fix the engine."
            )
        return report

    def get_metrics(self) -> list[dict[str, Any]]:
        """Each engine's cumulative spec-decode counters (vLLM names)."""
        return self._get([w.get_metrics.remote() for w in self.workers])

    def update_weights(self, state_dict: dict[str, Any] | ray.ObjectRef) -> float:
        """Refit every engine's target model from an HF-named state dict (or an ObjectRef to one).

        The dict is put in Ray's object store once and every engine reads it from there.
        """
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        return max(self._get([w.update_weights.remote(ref) for w in self.workers]))

    def reset_prefix_cache(self) -> None:
        self._get([w.reset_prefix_cache.remote() for w in self.workers])

    def sleep(self, level: int = 1) -> None:
        self._get([w.sleep.remote(level) for w in self.workers])

    def wake_up(self) -> None:
        self._get([w.wake_up.remote() for w in self.workers])

    def shutdown(self) -> None:
        """Stop every engine and actor and release the placement group."""
        for w in getattr(self, "workers", []):
            try:
                ray.get(w.shutdown.remote(), timeout=30)
            except Exception:  # already dead: nothing to release
                pass
            ray.kill(w, no_restart=True)
        self.workers = []
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None

