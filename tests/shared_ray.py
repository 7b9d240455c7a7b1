"""One Ray instance per pytest worker, kept from one test file to the next, and engines shared across files.

Starting Ray costs about 3 s of wall time and 3.7 s of CPU, and a toy engine 9-12 s (most of it importing torch,
transformers and vLLM into a new process), so each file starting its own was a large share of the suite. Here:

* :func:`ensure_local_ray` starts the worker's test instance (RAY_TEST_CPUS logical CPUs, the tests folder on the
  workers' path); the ``local_ray`` fixture joins it, and the next file that asks for it finds it up;
* an integration file that asks for no ``local_ray`` (its GRPO runs start Ray with the host's cores, or it builds a
  cluster of its own) starts without any Ray up, as before; a file of unit tests leaves the instance as it is;
* after each file, a Ray that is not the test instance, or one that holds anything the file started and left
  (an actor or a placement group that no shared engine owns), is shut down, so no file inherits another's leftovers;
* :func:`shared_engine` hands out one engine per setting per worker, for the files whose tests only read from it
  (no refit, no change of k, never killed); it lives as long as the test instance. A test that changes or kills
  its engine starts its own (``conftest.module_engine``), shut down at its file's end.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Logical CPUs of the test Ray instance. Each engine reserves a CPU bundle; a 2-core machine would otherwise hold
# only two engines at a time. Engines take turns (one generate call at a time), so the oversubscription is harmless.
RAY_TEST_CPUS = 16
TESTS_DIR = Path(__file__).resolve().parent

_test_ray: dict[str, Any] = {"gcs": None}
# settings key -> (the test instance's GCS address, the engine, {what was computed from it: value})
_engines: dict[str, tuple[str, Any, dict]] = {}


def _gcs() -> str | None:
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def ensure_local_ray(num_cpus: int = RAY_TEST_CPUS) -> None:
    """A local Ray instance whose workers (and the engine-core processes they spawn) can import the test
    helpers, e.g. ``engine_debug``'s worker extension; it becomes the worker's shared test instance."""
    import ray

    from rl_specdec.rollout.placement import LOCAL_RAY_SYSTEM_CONFIG

    if not ray.is_initialized():
        path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            _system_config=LOCAL_RAY_SYSTEM_CONFIG,
        )
        if num_cpus == RAY_TEST_CPUS:
            _test_ray["gcs"] = _gcs()


def _is_test_ray() -> bool:
    return _test_ray["gcs"] is not None and _gcs() == _test_ray["gcs"]


def _leftovers() -> list[str]:
    """What lives in the test instance that no shared engine owns: placement groups and actors."""
    import ray

    from conftest import actor_states

    owned = [g for gcs, g, _ in _engines.values() if gcs == _test_ray["gcs"]]
    pgs = {g.pg.id.hex() for g in owned if g.pg is not None}
    left = [
        f"placement group {pid}"
        for pid, pg in ray.util.placement_group_table().items()
        if pg["state"] != "REMOVED" and pid not in pgs
    ]
    alive = sum(1 for state in actor_states(None).values() if state == "ALIVE")
    expected = sum(len(g.workers) + (g._checksummer is not None) for g in owned)
    return left + ([f"{alive - expected} actors"] if alive > expected else [])


def _shutdown() -> None:
    import ray

    ray.shutdown()
    _test_ray["gcs"] = None
    _engines.clear()  # they died with it


def _starts_its_own_ray(module) -> bool:
    """An integration file that asks for no ``local_ray``: its runs start Ray in this process with the host's
    cores, or it builds a cluster of its own. A file of unit tests never touches Ray, and keeps the test instance
    up for the next file that asks for it."""
    items = [item for item in module.session.items if item.module is module.obj]
    return not any("local_ray" in item.fixturenames for item in items) and any(
        item.get_closest_marker("integration") for item in items
    )


@pytest.fixture(scope="module", autouse=True)
def ray_per_module(request):
    """A file whose runs start their own Ray starts with no Ray up (:func:`_starts_its_own_ray`); after each file,
    any Ray but a clean test instance is shut down, so the next file never inherits a Ray sized (or filled) by
    another: a GRPO run starts Ray with the host's cores, and an engine after it would find no CPU to reserve."""
    import ray

    if ray.is_initialized() and _starts_its_own_ray(request.node):
        _shutdown()
    yield
    if ray.is_initialized() and (not _is_test_ray() or _leftovers()):
        _shutdown()


@pytest.fixture(scope="module")
def local_ray():
    """The worker's test Ray instance (RAY_TEST_CPUS logical CPUs), started by the first file that asks."""
    import ray

    if ray.is_initialized() and not _is_test_ray():
        _shutdown()
    ensure_local_ray()
    yield


def shared_engine(policy_path, spec: dict[str, Any] | None, **kw):
    """The worker's engine with these settings in the test instance, started at the first request
    (``conftest.start_engine``'s arguments). Only for tests that leave it as they found it."""
    from conftest import start_engine

    key = repr((str(policy_path), spec, sorted((k, repr(v)) for k, v in kw.items())))
    held = _engines.get(key)
    if held is None or held[0] != _gcs() or not _is_test_ray():
        held = (_gcs(), start_engine(policy_path, spec, **kw), {})
        _engines[key] = held
    return held[1]


def computed_once(engine, what: str, compute):
    """``compute()``, memoised with a shared engine for as long as the engine lives (seeded samples, greedy
    references: the same value each time they are asked for)."""
    memo = next(m for _, g, m in _engines.values() if g is engine)
    if what not in memo:
        memo[what] = compute()
    return memo[what]
