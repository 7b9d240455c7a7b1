"""Where engines run: Ray start-up, placement-group bundles, CPU core binding, sharding.

One placement-group bundle per engine: ``tensor_parallel_size`` GPUs (+1 CPU)
on a GPU cluster, ``cpus_per_engine`` CPUs otherwise. Because placement goes
through a placement group, the same code spans the nodes of an existing Ray
cluster (``cluster.address``). Engines that share a host get disjoint cores
for their OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), so two engines on a
2-core machine never fight over the same core.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rl_specdec.config.generation import ClusterConfig, GenerationConfig
from rl_specdec.metrics.console import console_level, worker_env


def init_ray(cluster: ClusterConfig) -> None:
    """Start or join Ray once per process; its workers log at the console's level (rl_specdec.metrics.console)."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": console_level()}
    if env := worker_env():
        kwargs["runtime_env"] = {"env_vars": env}
    if cluster.address:
        ray.init(address=cluster.address, **kwargs)
    else:  # "local": never attach to some other job's running cluster by accident
        ray.init(address="local", num_cpus=cluster.num_cpus, **kwargs)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


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


def reserve_engine_bundles(config: GenerationConfig, cluster: ClusterConfig, on_gpu: bool):
    """A ready placement group with one bundle per engine (removed again if it cannot be reserved)."""
    n = config.num_engines
    tp = int(config.vllm_kwargs.get("tensor_parallel_size", 1))
    bundle = {"GPU": tp, "CPU": 1} if on_gpu else {"CPU": config.cpus_per_engine}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=cluster.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not reserve {n} x {bundle} for policy.generation.num_engines={n}; the cluster has "
            f"{ray.available_resources()}. Lower num_engines or cpus_per_engine, or add nodes to the cluster."
        ) from e
    return pg
