"""Where engines run: Ray start-up and shut-down, placement-group bundles, CPU core binding, sharding.

One placement-group bundle per engine: ``tensor_parallel_size`` GPUs (+1 CPU)
on a GPU cluster, ``cpus_per_engine`` CPUs otherwise. Because placement goes
through a placement group, the same code spans the nodes of an existing Ray
cluster (``cluster.address``). Engines that share a host get disjoint cores
for their OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), so two engines on a
2-core machine never fight over the same core.

:func:`init_ray` starts a local Ray instance (or joins ``cluster.address``)
and notes which processes the local instance starts, with a watchdog process
that kills them if the driver dies without stopping them (SIGKILL, the OOM
killer: :mod:`rl_specdec.rollout.watchdog`); :func:`stop_ray` shuts
it down and makes sure every one of them is gone; :func:`kill_ray_now` kills
them for an exit that cannot wait. A cluster that was joined is never shut
down: only the run's actors (stopped by their groups) are the run's there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import defaultdict
from typing import Any

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rl_specdec.config.generation import ClusterConfig, GenerationConfig
from rl_specdec.metrics.console import console_level, worker_env
from rl_specdec.rollout import watchdog

# The local Ray instance init_ray started in this process: this process's descendants from before it
# ("before"), every process of the instance seen since ("seen"), and the watchdog that kills them if this
# process dies without stopping them ("watchdog", rollout/watchdog.py); None when Ray was joined or not started here.
_local: dict[str, Any] | None = None
# A local Ray prestarts idle workers for the driver's tasks; every actor here has its own runtime_env (the engines'
# and trainers' environment), so none ever takes one: not starting them saves about a second of CPU at each start.
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def init_ray(cluster: ClusterConfig) -> None:
    """Start or join Ray once per process; its workers log at the console's level (rl_specdec.metrics.console).

    ray.init installs its own SIGTERM handlers in the driver: ``sys.exit``, and the core worker's native
    failure handler, which prints a stack dump (``*** SIGTERM received ... PC: @``) and aborts with status 134.
    A Python handler for SIGTERM or SIGINT installed before (the GRPO loop's, grpo/stop.py) is put back, which
    replaces both.
    """
    global _local
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": console_level()}
    if env := worker_env():
        kwargs["runtime_env"] = {"env_vars": env}
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    if cluster.address:
        ray.init(address=cluster.address, **kwargs)
    else:  # "local": never attach to some other job's running cluster by accident
        if _local is not None:  # a Ray shut down without stop_ray: its watchdog goes with it
            _local["watchdog"].kill()
        before, since = set(_descendants()), time.time()
        ray.init(address="local", num_cpus=cluster.num_cpus, _system_config=LOCAL_RAY_SYSTEM_CONFIG, **kwargs)
        _local = {"before": before, "seen": set(), "watchdog": watchdog.start(os.getpid(), since)}
    for s, handler in handlers.items():
        if callable(handler):
            signal.signal(s, handler)


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)  # skips a child that ends while the tree is walked


def record_ray_processes() -> list[psutil.Process]:
    """The processes the local Ray instance started that are alive now (its GCS, raylet, agents, workers and the
    engines' own processes), added to those seen before: call it while the tree is whole (before actors are
    killed, whose children then leave it). Empty when Ray was joined or started elsewhere."""
    if _local is None:
        return []
    mine = {p for p in _descendants() if p not in _local["before"] and p.pid != _local["watchdog"].pid}
    _local["seen"].update(mine)
    return [p for p in _local["seen"] if p.is_running()]


def stop_ray(wait_s: float = 5.0) -> list[str]:
    """Shut down the local Ray instance :func:`init_ray` started, and make sure every process it started is gone.

    ``ray.shutdown`` stops the GCS and the raylet; the raylet's workers and agents (dashboard agent, runtime env
    agent) and the engines' processes end by themselves, mostly: any still alive ``wait_s`` seconds later is
    killed. Returns what had to be killed. Nothing happens for a joined cluster or a Ray started elsewhere.
    """
    global _local
    procs = record_ray_processes()
    if _local is None:
        return []
    ray.shutdown()
    guard = _local.pop("watchdog")
    guard.kill()  # the driver lives on: what Ray leaves is killed below
    guard.wait(timeout=5.0)
    _local = None
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    killed = []
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended in the meantime
            killed.append(f"{p.name()} (pid {p.pid})")
            p.kill()
    psutil.wait_procs(alive, timeout=2.0)
    return killed


def kill_ray_now() -> None:
    """SIGKILL every process the local Ray instance started, without a word to Ray: for an exit that cannot wait."""
    for p in record_ray_processes():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


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
