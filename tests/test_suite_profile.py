"""scripts/suite_profile.py names each process by its title; pure logic, no processes started."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "suite_profile.py"


def _profile():
    spec = importlib.util.spec_from_file_location("suite_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_process_is_named_by_its_title():
    kind_of = _profile().kind_of
    assert kind_of("[pytest-xdist running] tests/test_grpo.py::test_one") == "pytest worker"
    assert kind_of("[pytest-xdist idle]") == "pytest worker"
    assert kind_of("ray::VllmWorker.generate") == "engine actor"
    assert kind_of("ray::AsyncVllmWorker") == "engine actor"
    assert kind_of("ray::PolicyWorker.train_step") == "policy worker"
    assert kind_of("/usr/bin/python -m pip install .") == "other"


def test_the_costliest_titles_are_summed_across_processes():
    rows = _profile().top_titles([("ray::IDLE", 2.0), ("ray::IDLE", 1.5), ("ray::PolicyWorker", 3.0)], n=1)
    assert rows == [{"title": "ray::IDLE", "processes": 2, "cpu_s": 3.5}]
