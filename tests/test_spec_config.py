"""Load-time validation of ``vllm_kwargs`` / ``speculative_config`` (imports vLLM, starts nothing)."""

from __future__ import annotations

import json

import pytest

from rl_specdec.config import ConfigError, validate_vllm_kwargs
from rl_specdec.vllm_ext.declarations import mtp_methods as vllm_mtp_methods
from rl_specdec.vllm_ext.declarations import speculative_methods as vllm_speculative_methods
from rl_specdec.vllm_ext.methods import METHODS
from rl_specdec.vllm_ext.methods import method as method_row

KEY = "policy.generation.vllm_kwargs"
SPEC_KEY = f"{KEY}.speculative_config"


def _model_dir(path, vocab_size):
    """A model folder with only a config.json (enough for the vocabulary check)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": vocab_size})
    )
    return str(path)


@pytest.fixture
def policy(tmp_path):
    return _model_dir(tmp_path / "policy", 32)


@pytest.fixture
def drafter(tmp_path):
    return _model_dir(tmp_path / "drafter", 32)


def validate(spec, policy, **extra):
    return validate_vllm_kwargs({"max_model_len": 128, **extra, "speculative_config": spec}, policy)


# ---- errors ------------------------------------------------------------------


def test_unknown_method(policy):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.method='ngramm' is not a vLLM speculative method") as e:
        validate({"method": "ngramm", "num_speculative_tokens": 3}, policy)
    assert "'ngram'" in str(e.value)  # lists the valid names


def test_missing_method(policy):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.method is missing"):
        validate({"num_speculative_tokens": 3}, policy)


@pytest.mark.parametrize("k", [0, -2])
def test_num_speculative_tokens_below_one(policy, k):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.num_speculative_tokens={k} must be >= 1"):
        validate(
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}, policy
        )


def test_num_speculative_tokens_missing(policy):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.num_speculative_tokens is missing"):
        validate({"method": "ngram"}, policy)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_drafter_method_without_model(policy, method):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.model is missing: method '{method}' needs a drafter"):
        validate({"method": method, "num_speculative_tokens": 3}, policy)


def test_model_free_method_with_model(policy, drafter):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.model is set but method 'ngram' uses no drafter model"):
        validate({"method": "ngram", "model": drafter, "num_speculative_tokens": 3}, policy)


def test_drafter_vocab_differs_from_policy(policy, tmp_path):
    other = _model_dir(tmp_path / "other_vocab", 64)
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.model .* has vocab_size 64 but the policy .* has 32"):
        validate({"method": "draft_model", "model": other, "num_speculative_tokens": 3}, policy)


def test_drafter_vocab_from_text_config(policy, tmp_path):
    """Multimodal-style configs keep vocab_size under text_config."""
    d = tmp_path / "vlm_drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 48}}))
    with pytest.raises(ConfigError, match="vocab_size 48"):
        validate({"method": "draft_model", "model": str(d), "num_speculative_tokens": 3}, policy)


def test_synthetic_rejection_sampling_refused_in_training(policy):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}
    with pytest.raises(
        ConfigError, match=rf"{SPEC_KEY}\.rejection_sample_method='synthetic' .* must not be used for training"
    ):
        validate(spec, policy)
    # allowed when validating for a benchmark, not a training run
    out = validate_vllm_kwargs({"speculative_config": spec}, policy, training=False)
    assert out["speculative_config"]["rejection_sample_method"] == "synthetic"


def test_unknown_key_in_speculative_config(policy):
    with pytest.raises(ConfigError, match=rf"{SPEC_KEY}\.num_spec_tokens is not a field of vLLM's SpeculativeConfig"):
        validate({"method": "ngram", "num_speculative_tokens": 3, "num_spec_tokens": 3}, policy)


def test_unknown_key_in_vllm_kwargs(policy):
    with pytest.raises(ConfigError, match=rf"{KEY}\.max_model_length is not a vLLM engine argument") as e:
        validate_vllm_kwargs({"max_model_length": 128}, policy)
    assert "max_model_len" in str(e.value)  # suggests the right spelling


@pytest.mark.parametrize("key", ["model", "seed"])
def test_keys_owned_by_rl_specdec(policy, key):
    with pytest.raises(ConfigError, match=rf"{KEY}\.{key} is set by rl_specdec"):
        validate_vllm_kwargs({key: 1}, policy)


@pytest.mark.parametrize("gmu", [0.0, 1.5])
def test_gpu_memory_utilization_range(policy, gmu):
    with pytest.raises(ConfigError, match=rf"{KEY}\.gpu_memory_utilization={gmu} must be in"):
        validate_vllm_kwargs({"gpu_memory_utilization": gmu}, policy)


def test_async_scheduling_with_ngram(policy):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with pytest.raises(
        ConfigError, match=r"vllm_kwargs\.async_scheduling=true cannot be combined with .*method='ngram'"
    ):
        validate(spec, policy, async_scheduling=True)
    validate(spec, policy, async_scheduling=False)  # fine


def test_async_scheduling_with_draft_model_is_fine(policy, drafter):
    out = validate(
        {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}, policy, async_scheduling=True
    )
    assert out["async_scheduling"] is True


# ---- what passes, and the defaults filled in ------------------------------------


def test_no_speculation_passes_through(policy):
    kw = {"max_model_len": 128, "kv_cache_memory_bytes": 2**28, "speculative_config": None}
    assert validate_vllm_kwargs(kw, policy) == {"max_model_len": 128, "kv_cache_memory_bytes": 2**28}
    assert validate_vllm_kwargs(None, policy) == {}


def _reasonable_spec(method, drafter):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method in ("ngram", "ngram_gpu"):
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    if method_row(method).drafter_model:
        spec["model"] = drafter
    return spec


def test_vllm_lists_the_methods_we_rely_on():
    methods = vllm_speculative_methods()
    for m in ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp"):
        assert m in methods
    # the method table names only methods this vLLM declares: a renamed or dropped one would keep its row silently
    assert sorted(set(METHODS) - set(methods)) == []


@pytest.mark.parametrize("method", vllm_speculative_methods())
def test_every_vllm_method_passes_name_validation(policy, drafter, method):
    spec = _reasonable_spec(method, drafter)
    out = validate(spec, policy)["speculative_config"]
    assert out["method"] == method
    assert out["num_speculative_tokens"] == 3
    if method_row(method).drafter_model or method in vllm_mtp_methods():
        assert out["draft_sample_method"] == "probabilistic"
    else:
        assert "draft_sample_method" not in out


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_probabilistic_drafting_is_the_default(policy, drafter, method):
    out = validate({"method": method, "model": drafter, "num_speculative_tokens": 3}, policy)
    assert out["speculative_config"]["draft_sample_method"] == "probabilistic"
    # an explicit choice is kept
    out = validate(
        {"method": method, "model": drafter, "num_speculative_tokens": 3, "draft_sample_method": "greedy"}, policy
    )
    assert out["speculative_config"]["draft_sample_method"] == "greedy"


def test_input_is_not_mutated(policy, drafter):
    spec = {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}
    kw = {"load_format": "dummy", "speculative_config": spec}
    validate_vllm_kwargs(kw, policy)
    assert spec == {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}


def test_draft_load_config_when_policy_is_dummy(policy, drafter):
    spec = {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}
    out = validate(spec, policy, load_format="dummy")["speculative_config"]
    assert out["draft_load_config"] == {"load_format": "auto"}
    # a real policy load: the drafter inherits it, nothing added
    assert "draft_load_config" not in validate(spec, policy)["speculative_config"]
    # ngram has no drafter to load
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert "draft_load_config" not in validate(ngram, policy, load_format="dummy")["speculative_config"]
    # an explicit draft_load_config is kept
    explicit = dict(spec, draft_load_config={"load_format": "safetensors"})
    assert validate(explicit, policy, load_format="dummy")["speculative_config"]["draft_load_config"] == {
        "load_format": "safetensors"
    }


def test_drafter_with_same_vocab_passes(policy, drafter):
    out = validate({"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}, policy)
    assert out["speculative_config"]["model"] == drafter


def test_result_is_accepted_by_vllm_speculative_config_fields(policy, drafter):
    """Every key we hand to vLLM (incl. the defaults we add) is one vLLM declares."""
    import dataclasses

    from vllm.config.speculative import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    out = validate(
        {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}, policy, load_format="dummy"
    )
    assert set(out["speculative_config"]) <= fields


# ---- vLLM's batch-size schedule for k (num_speculative_tokens_per_batch_size) ------------
SCHED_KEY = f"{SPEC_KEY}.num_speculative_tokens_per_batch_size"


def test_schedule_sets_k_to_its_largest_entry(policy, drafter):
    out = validate(
        {
            "method": "draft_model",
            "model": drafter,
            "num_speculative_tokens_per_batch_size": [[17, 1024, 0], [1, 16, 4]],
        },
        policy,
    )
    spec = out["speculative_config"]
    assert spec["num_speculative_tokens"] == 4
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 16, 4], [17, 1024, 0]]  # sorted by vLLM's parser


def test_schedule_above_num_speculative_tokens_is_refused(policy, drafter):
    """vLLM would silently cap k=5 at 3; here it is an error naming the fix."""
    with pytest.raises(
        ConfigError,
        match=rf"{SCHED_KEY} asks for k=5 but .*num_speculative_tokens=3 caps "
        rf".*set {SPEC_KEY}\.num_speculative_tokens=5",
    ):
        validate(
            {
                "method": "draft_model",
                "model": drafter,
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": [[1, 8, 5], [9, 64, 3]],
            },
            policy,
        )


@pytest.mark.parametrize(
    "schedule, why",
    [
        ([[2, 16, 3]], "must start at 1"),
        ([[1, 16, 3], [10, 64, 2]], "non-overlapping"),
        ([[1, 16]], "3-item sequence"),
        ([[1, 16, -1]], ">= 0"),
        ([[1, 1024, 0]], "never speculates"),
    ],
)
def test_bad_schedule_names_the_key_and_the_form(policy, drafter, schedule, why):
    with pytest.raises(ConfigError, match=SCHED_KEY) as e:
        validate({"method": "draft_model", "model": drafter, "num_speculative_tokens_per_batch_size": schedule}, policy)
    assert why in str(e.value)


def test_null_keys_are_unset(policy):
    """After an override like method=suffix, model=null removes the drafter rather than failing."""
    out = validate(
        {"method": "suffix", "num_speculative_tokens": 3, "model": None, "draft_sample_method": None}, policy
    )
    assert out["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 3}
