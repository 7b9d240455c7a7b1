"""The one door to vLLM's internals: every hook's probe passes on the vLLM installed, a moved hook and
another vLLM version each stop a run at start-up with a clear message, and the override key works."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from rl_specdec import vllm_ext
from rl_specdec.config import GenerationConfig, load_config
from rl_specdec.errors import ConfigError, VllmIncompatible

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted({m for ms in vllm_ext.FEATURES.values() for m in ms})


@pytest.fixture(autouse=True)
def fresh_probes():
    vllm_ext.probe_failures.cache_clear()
    yield
    vllm_ext.probe_failures.cache_clear()


@pytest.mark.parametrize("module", MODULES)
def test_every_hook_probe_passes_on_the_installed_vllm(module):
    probes = importlib.import_module(f"rl_specdec.vllm_ext.{module}").PROBES
    assert probes, f"{module} declares no probe"
    for hook, probe in probes.items():
        probe()  # raises when vLLM moved it


def test_the_package_holds_every_touch_of_vllm_internals():
    """Outside vllm_ext, rl_specdec imports only vLLM's public API (and nothing under vllm.v1 but the engine)."""
    public = (
        "from vllm import",
        "from vllm.engine.arg_utils import",
        "from vllm.v1.engine.async_llm import",
        "from vllm.inputs import",
        "from vllm.sampling_params import",
    )
    offenders = []
    for path in (ROOT / "rl_specdec").rglob("*.py"):
        if "vllm_ext" in path.parts:
            continue
        for line in path.read_text().splitlines():
            s = line.strip()
            if (
                (s.startswith("from vllm") or s.startswith("import vllm"))
                and s != "import vllm"
                and not s.startswith(public)
            ):
                offenders.append(f"{path.relative_to(ROOT)}: {s}")
    assert not offenders, offenders


def test_the_gate_passes_here():
    assert all(vllm_ext.probe_failures(f) == () for f in vllm_ext.FEATURES)
    assert vllm_ext.check_vllm(False, tuple(vllm_ext.FEATURES)) is None


def test_another_vllm_version_is_refused_unless_allowed(monkeypatch, caplog):
    monkeypatch.setattr(vllm_ext, "installed_version", lambda: "0.33.1")
    with pytest.raises(
        VllmIncompatible,
        match=r"vLLM 0\.33\.1 is installed.*written and tested for vLLM 0\.32\.0.*allow_untested_vllm=true",
    ):
        vllm_ext.check_vllm(False)
    vllm_ext._warn_once.cache_clear()
    vllm_ext.check_vllm(True)  # the override: a warning, no error
    assert "running anyway" in caplog.text


def test_a_moved_hook_is_refused_naming_it_even_with_the_override(monkeypatch):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    monkeypatch.delattr(SpecDecodeBaseProposer, "_get_slot_mapping")
    vllm_ext.check_vllm(False, ("core",))  # run-time k is not used: its hooks are not needed
    with pytest.raises(
        VllmIncompatible, match=r"vLLM 0\.32\.0.*drafter_kv: .*SpecDecodeBaseProposer\._get_slot_mapping"
    ):
        vllm_ext.check_vllm(True, ("core", "runtime_k"))


def test_a_moved_server_hook_is_refused(monkeypatch):
    from vllm.renderers.online_renderer import OnlineRenderer

    async def moved(self, request, messages):
        pass

    monkeypatch.setattr(OnlineRenderer, "preprocess_chat", moved)
    with pytest.raises(VllmIncompatible, match="openai_app: .*vLLM moved OnlineRenderer.preprocess_chat"):
        vllm_ext.check_vllm(False, ("core", "server"))


def test_a_config_load_runs_the_gate(monkeypatch):
    monkeypatch.setattr(vllm_ext, "installed_version", lambda: "0.40.0")
    with pytest.raises(ConfigError, match="policy.generation.allow_untested_vllm=true"):
        load_config(ROOT / "configs/grpo_spec.yaml")
    cfg = load_config(ROOT / "configs/grpo_spec.yaml", ["policy.generation.allow_untested_vllm=true"])
    assert cfg.policy.generation.allow_untested_vllm


def test_an_engine_process_runs_the_gate(monkeypatch):
    """Each engine actor checks again (a cluster node may have another vLLM than the head)."""
    from rl_specdec.rollout.worker import VllmWorker

    monkeypatch.setattr(vllm_ext, "installed_version", lambda: "0.31.0")
    with pytest.raises(VllmIncompatible, match="0.31.0"):
        VllmWorker()._prepare_process(GenerationConfig(), cpu_bind=None)
