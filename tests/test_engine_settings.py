"""What the engine really runs: the comparison logic (pure) and the environment report.

The engine side (a real engine that drops ``async_scheduling`` on CPU) is
tested in tests/test_grpo.py, where the run writes engine.yaml.
"""

from __future__ import annotations

import pytest

from rl_specdec.config.generation import GenerationConfig
from rl_specdec.errors import ConfigError
from rl_specdec.rollout import engine_settings as settings

CPU_DRAFT = {
    "vllm_version": "0.32.0",
    "backend": "cpu",
    "cpu_expand_fix": True,
    "async_scheduling": False,
    "dtype": "float32",
    "max_num_batched_tokens": 4096,
    "max_model_len": 128,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "compilation_mode": 0,
    "speculative/method": "draft_model",
    "speculative/num_speculative_tokens": 3,
    "speculative/num_speculative_tokens_per_batch_size": None,
    "speculative/draft_sample_method": "probabilistic",
    "speculative/rejection_sample_method": "standard",
}


def asked(strict: bool = False, **vllm_kwargs) -> GenerationConfig:
    return GenerationConfig(vllm_kwargs=vllm_kwargs, strict_engine_settings=strict)


ASKED = {
    "async_scheduling": True,
    "max_model_len": 128,
    "dtype": "float32",
    "enable_prefix_caching": True,
    "speculative_config": {"method": "draft_model", "model": "/x", "num_speculative_tokens": 3},
}


def test_a_dropped_setting_is_named_with_both_values_and_the_reason():
    (m,) = settings.mismatches(asked(**ASKED), CPU_DRAFT)
    assert m.key == "async_scheduling" and m.requested is True and m.effective is False
    msg = m.message()
    assert "policy.generation.vllm_kwargs.async_scheduling" in msg and "True" in msg and "False" in msg
    assert "CPU platform" in msg


def test_honoured_settings_give_nothing():
    ok = {k: v for k, v in ASKED.items() if k != "async_scheduling"}
    assert settings.mismatches(asked(**ok), CPU_DRAFT) == []
    assert settings.mismatches(asked(dtype="auto"), CPU_DRAFT) == []  # auto asks for nothing
    assert settings.mismatches(asked(dtype="torch.float32"), CPU_DRAFT) == []  # same dtype, other spelling


def test_a_changed_speculative_setting_is_named_under_speculative_config():
    five = asked(speculative_config={"method": "draft_model", "num_speculative_tokens": 5})
    (m,) = settings.mismatches(five, CPU_DRAFT)
    assert "speculative_config.num_speculative_tokens" in m.message()


def test_check_warns_once_per_setting_or_stops_when_strict():
    warned = []
    assert settings.check(asked(**ASKED), [CPU_DRAFT, dict(CPU_DRAFT)], warn=warned.append) == CPU_DRAFT
    assert len(warned) == 1 and "async_scheduling" in warned[0]
    with pytest.raises(ConfigError, match="async_scheduling.*strict_engine_settings=false"):
        settings.check(asked(True, **ASKED), [CPU_DRAFT], warn=warned.append)


def test_engines_that_disagree_are_an_error_naming_the_engine():
    other = dict(CPU_DRAFT, dtype="bfloat16")
    with pytest.raises(
        ConfigError, match="engine 2 runs different settings.*dtype: engine 0 'float32', engine 2 'bfloat16'"
    ):
        settings.agree([CPU_DRAFT, CPU_DRAFT, other])


def test_summary_line_says_what_runs():
    line = settings.summary_line(CPU_DRAFT, 2)
    for part in (
        "2 engine(s)",
        "vLLM 0.32.0 on cpu",
        "draft_model k=3",
        "probabilistic",
        "float32",
        "async scheduling off",
        "CPU sampling fix applied",
    ):
        assert part in line, (part, line)
    threshold = dict(CPU_DRAFT, **{"speculation_control/mode": "fixed", "speculation_control/k_max": 3})
    assert "k chosen at run time (fixed, 0..3, k=0 through" in settings.summary_line(threshold, 1)
    threshold["speculation_control/draft_below"] = 32
    assert "(fixed, 0..3, drafting below 32 running requests," in settings.summary_line(threshold, 1)
    started = dict(threshold, **{"speculation_control/mode": "adaptive", "speculation_control/start": "schedule"})
    started["speculative/num_speculative_tokens_per_batch_size"] = [[1, 4, 3], [5, 256, 0]]
    assert "(adaptive, 0..3, drafting below 32 running requests, starting from [[1, 4, 3], [5, 256, 0]], k=0" in (
        settings.summary_line(started, 1)
    )
    assert "no speculation" in settings.summary_line(
        {k: v for k, v in CPU_DRAFT.items() if not k.startswith("speculative/")}, 1
    )


# a KV cache of 256 MiB in fp32 as the engine reports it: 1 MiB per 128-token block for the toy target, 0.25 MiB
# for its drafter, so 204 blocks; max_model_len 128 is one block a request
KV = dict(CPU_DRAFT, max_num_seqs=256, kv_cache_memory_bytes=256 * 2**20, kv_cache_blocks=204, block_size=128)


def test_kv_capacity_counts_requests_of_max_model_len():
    assert settings.kv_capacity(KV) == 204
    assert settings.kv_capacity(dict(KV, max_model_len=512)) == 51  # 4 blocks a request
    assert settings.kv_capacity(dict(KV, max_model_len=129)) == 102  # a partial block is a whole one
    assert settings.kv_capacity(CPU_DRAFT) is None  # an engine that did not report its blocks


def test_a_kv_cache_too_small_for_a_call_is_named_with_the_bytes_that_fit_it():
    msg = settings.kv_shortfall(KV, wanted=512)  # 512 requests a call, max_num_seqs 256 of them at once
    assert "vllm_kwargs: the KV cache holds 204 requests" in msg and "up to 256" in msg and "drafter" in msg
    mib = int(msg.split("(")[-1].split(" MiB")[0])
    per_block = KV["kv_cache_memory_bytes"] / KV["kv_cache_blocks"]
    assert mib * 2**20 // per_block >= 256 > (mib - 1) * 2**20 // per_block  # the fix is enough, and no more
    assert f"kv_cache_memory_bytes to at least {mib * 2**20}" in msg
    gpu = settings.kv_shortfall(dict(KV, kv_cache_memory_bytes=None), wanted=512)
    assert "gpu_memory_utilization" in gpu


def test_a_kv_cache_that_holds_the_call_gives_nothing():
    assert settings.kv_shortfall(KV, wanted=204) is None
    assert settings.kv_shortfall(dict(KV, max_num_seqs=128), wanted=512) is None  # vLLM runs 128 at most
    assert settings.kv_shortfall(dict(KV, kv_cache_blocks=256), wanted=512) is None
    assert settings.kv_shortfall(CPU_DRAFT, wanted=512) is None  # nothing reported, nothing claimed


def test_environment_report_runs_and_names_the_vllm_version():
    import vllm

    from rl_specdec.sysinfo import report  # what `python -m rl_specdec.sysinfo` writes; in process, vLLM is imported

    out = report()
    assert f"vllm: {vllm.__version__}" in out
    assert "cores_usable:" in out and "cpu_sampling_fix_applies:" in out and "LD_PRELOAD" in out
    assert "label: " in out  # the machine label every benchmark report is headed with
