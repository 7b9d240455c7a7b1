"""The installation's facts file (rl_specdec.vllm_ext.facts): a driver loads a config without importing vLLM once
the file is written, every fact in it is what vLLM says live, and another installation has another file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_specdec import vllm_ext
from rl_specdec.config import load_config
from rl_specdec.config.load import check_runs_here
from rl_specdec.vllm_ext import declarations, facts

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("grpo_spec.yaml", "smollm2_spec.yaml", "smollm2_eagle3.yaml")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in an empty cache; off again after the test (the tests' own process computes facts live)."""
    monkeypatch.setenv("RL_SPECDEC_CACHE", str(tmp_path))
    facts.facts_path.cache_clear()
    vllm_ext.probe_failures.cache_clear()
    facts.use_file()
    yield tmp_path
    facts.use_file(False)
    facts.facts_path.cache_clear()
    vllm_ext.probe_failures.cache_clear()


def test_a_fact_is_computed_once_then_read_from_the_file(store):
    calls = []
    assert facts.fact("x", lambda: calls.append(1) or [1, 2]) == [1, 2]
    facts.use_file()  # a new process: nothing in memory

    def fail():
        raise AssertionError("computed again")

    assert facts.fact("x", fail) == [1, 2] and calls == [1]
    (path,) = (store / "vllm-facts").glob("*.json")
    assert path == facts.facts_path() and json.loads(path.read_text()) == {"x": [1, 2]}


def test_a_damaged_file_or_another_installation_computes_again(store, monkeypatch):
    facts.fact("x", lambda: 1)
    facts.facts_path().write_text("{not json")
    facts.use_file()
    assert facts.fact("x", lambda: 2) == 2
    first = facts.facts_path()
    monkeypatch.setattr(facts, "_vllm_record", lambda: "\nvllm/__init__.py,sha256=another,1\n")
    facts.facts_path.cache_clear()
    assert facts.facts_path() != first and facts.fact("x", lambda: 3) == 3
    monkeypatch.setattr(facts, "_vllm_record", lambda: None)  # vLLM from a source tree: no key, always live
    facts.facts_path.cache_clear()
    assert facts.facts_path() is None and facts.fact("x", lambda: 4) == 4 and facts.fact("x", lambda: 5) == 5


def test_every_fact_a_config_load_writes_is_what_vllm_says_live(store):
    """Loaded with the store on, the shipped configs write the version, the probes of their features, vLLM's
    declarations and their schedules; each equals the live value (the store off)."""
    for name in CONFIGS:
        check_runs_here(load_config(ROOT / "configs" / name))
    written = json.loads(facts.facts_path().read_text())
    facts.use_file(False)
    import vllm

    assert written.pop("version") == vllm.__version__
    probed = {k.split("/")[1] for k in written if k.startswith("probe_failures/")}
    assert {"core", "runtime_k"} <= probed
    for feature in probed:
        assert written.pop(f"probe_failures/{feature}") == list(vllm_ext._probe(feature)) == []
    schedules = [k for k in written if k.startswith("schedule/")]
    assert schedules, "a shipped config's schedule was not recorded"
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    for key in schedules:
        live = validate_and_normalize_dynamic_sd_schedule(json.loads(key.split("/", 1)[1]))
        assert written.pop(key) == [list(e) for e in live], key
    assert written, "no declaration was recorded"
    for key, value in written.items():
        kind, name = key.split("/")
        live = getattr(declarations, name).__wrapped__()
        assert kind == "declarations" and value == (live if isinstance(live, dict) else sorted(live)), key


def test_a_driver_loads_a_config_without_importing_vllm_once_the_file_is_written(store):
    """What run_grpo.py does before it starts Ray, in a new process: the config is checked, vLLM never imported."""
    load_config(ROOT / "configs/grpo_spec.yaml")  # writes the file
    code = (
        "import sys\n"
        "from rl_specdec.vllm_ext import facts\n"
        "facts.use_file()\n"
        "from rl_specdec.config import load_config\n"
        "from rl_specdec.config.load import check_runs_here\n"
        "check_runs_here(load_config('configs/grpo_spec.yaml'))\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
