"""Config loading: inheritance, interpolation, overrides, and load-time errors."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl_specdec.config import ConfigError, load_config
from rl_specdec.config.precision import COMPUTE
from rl_specdec.toy.resolve import prepare_models

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"


def test_every_shipped_config_validates():
    """Every key of every shipped config, its vllm_kwargs and speculative_config against vLLM's declarations;
    no model is built or fetched (test_resolved_toy_config_fills_rl_defaults resolves one)."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        spec = cfg.policy.generation.vllm_kwargs.get("speculative_config")
        if "_base" in path.stem:  # grpo_base*, smollm2_base
            assert spec is None
        else:
            assert spec["num_speculative_tokens"] >= 1
        if spec and spec["method"] == "eagle3":  # a shipped head follows the policy; frozen is the opt-in
            assert cfg.policy.generation.drafter_training.enabled, path.name


GPU_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("qwen3_*.yaml"))
SPEC_KEY = "policy.generation.vllm_kwargs.speculative_config"
VK = "policy.generation.vllm_kwargs"


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_are_validated_against_vllm_without_their_models(name):
    """Loading checks vllm_kwargs and speculative_config against vLLM: a misspelled key or a method vLLM does not
    declare fails, named, without a model file or a download."""
    path = ROOT / "configs" / name
    load_config(path)
    for edit, needle in (
        (f"{SPEC_KEY}.num_speculative_tokenz=3", "speculative_config.num_speculative_tokenz is not a field of vLLM"),
        (f"{SPEC_KEY}.method=eagle4", "speculative_config.method='eagle4' is not a vLLM speculative method"),
        ("policy.generation.vllm_kwargs.max_modle_len=64", "vllm_kwargs.max_modle_len is not a vLLM engine argument"),
    ):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config(path, [edit])


def test_validation_reads_no_model_file_and_preparation_does(tmp_path, monkeypatch):
    """Loading checks names and builds nothing, nor looks up a folder; preparing the models does both."""
    monkeypatch.setenv("RL_SPECDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"policy.model_name='toy:nope': the embedded models are toy:policy"):
        load_config(SPEC, ["policy.model_name=toy:nope"])
    elsewhere = ["policy.model_name=/on/the/cluster/qwen3", f"{SPEC_KEY}.model=/on/the/cluster/qwen3-0.6b"]
    cfg = load_config(SPEC, elsewhere)  # a config for another machine validates here
    assert cfg.policy.generation.vllm_kwargs["speculative_config"]["model"] == "/on/the/cluster/qwen3-0.6b"
    assert not (tmp_path / "cache").exists()  # toy:policy was not built
    with pytest.raises(ConfigError, match=r"policy.model_name='/on/the/cluster/qwen3' is not a directory"):
        prepare_models(load_config(SPEC, elsewhere))
    with pytest.raises(ConfigError, match=r"speculative_config.model='/nope' is not a directory"):
        prepare_models(load_config(SPEC, [f"policy.model_name={tmp_path}", f"{SPEC_KEY}.model=/nope"]))


# What each GPU config states in its header comment it needs.
STATED_HARDWARE = {
    "qwen3_draft_model.yaml": {"GPU": 8, "CPU": 32},
    "qwen3_eagle3.yaml": {"GPU": 8, "CPU": 32},
    "qwen3_ngram.yaml": {"GPU": 8, "CPU": 32},
    "qwen3_1p7b_one_gpu.yaml": {"GPU": 1, "CPU": 8},
}


@pytest.mark.parametrize("name", sorted(STATED_HARDWARE))
def test_gpu_configs_fit_the_hardware_they_state(name):
    from rl_specdec.config import check_cluster_resources

    # as on a GPU cluster (cluster.address: the load-time "no local CUDA" check steps aside)
    cfg = load_config(ROOT / "configs" / name, ["policy.device=cuda", "cluster.address=auto"])
    have = STATED_HARDWARE[name]
    check_cluster_resources(cfg, have)
    fewer = {**have, "GPU": have["GPU"] - 1}
    with pytest.raises(
        ConfigError, match=rf"asks for {have['GPU']} GPUs but the Ray cluster has {have['GPU'] - 1}|cluster has no GPU"
    ):
        check_cluster_resources(cfg, fewer)


def test_cluster_check_counts_policy_and_engines():
    from rl_specdec.config import check_cluster_resources

    cfg = load_config(
        SPEC,
        [
            "policy.device=cuda",
            "cluster.address=auto",
            "policy.num_workers=4",
            "policy.generation.num_engines=3",
            "policy.generation.vllm_kwargs.tensor_parallel_size=2",
        ],
    )
    check_cluster_resources(cfg, {"GPU": 10, "CPU": 3})  # 4 x 1 + 3 x 2 GPUs; 3 CPUs, one per GPU engine
    with pytest.raises(ConfigError) as e:
        check_cluster_resources(cfg, {"GPU": 8, "CPU": 64})
    msg = str(e.value)
    assert "asks for 10 GPUs but the Ray cluster has 8" in msg
    assert "policy 4 x 1 (policy.num_workers x policy.gpus_per_worker) = 4" in msg
    assert "engines 3 x 2 (policy.generation.num_engines x tensor_parallel_size) = 6" in msg
    with pytest.raises(ConfigError, match="policy.device=cuda but the Ray cluster has no GPU"):
        check_cluster_resources(cfg, {"CPU": 64})
    # on CPU: engines reserve cpus_per_engine, workers cpus_per_worker; the default run fits 2 cores
    check_cluster_resources(load_config(SPEC), {"CPU": 2})
    cpu = load_config(SPEC, ["policy.num_workers=2", "policy.cpus_per_worker=1"])
    with pytest.raises(
        ConfigError, match=r"asks for 4 CPUs but the Ray cluster has 2: policy 2 x 1 .* = 2, engines 1 x 2"
    ):
        check_cluster_resources(cpu, {"CPU": 2})


def test_device_precision_and_engine_dtype_are_resolved_once_at_load():
    from rl_specdec.config import PolicyConfig, resolve_device_and_dtype
    from rl_specdec.config.precision import cpu_has_native_bf16

    cfg = load_config(SPEC)
    p = cfg.policy
    native = "bf16-mixed" if cpu_has_native_bf16() else "fp32"
    assert (p.device, p.precision, p.generation.vllm_kwargs["dtype"]) == ("cpu", native, COMPUTE[native])  # no CUDA
    for has_bf16, want in ((True, ("bf16-mixed", "bfloat16")), (False, ("fp32", "float32"))):
        written = PolicyConfig()
        cpu = resolve_device_and_dtype(written, cuda_available=False, cpu_bf16=has_bf16)
        assert (cpu.device, cpu.precision, cpu.generation.vllm_kwargs["dtype"]) == ("cpu", *want)
        assert written == PolicyConfig()  # resolution returns new settings and leaves these as written
    gpu = resolve_device_and_dtype(PolicyConfig(), cuda_available=True)
    assert (gpu.device, gpu.precision, gpu.generation.vllm_kwargs["dtype"]) == ("cuda", "bf16-mixed", "bfloat16")
    fixed = resolve_device_and_dtype(PolicyConfig(device="cuda", precision="fp32"), cuda_available=False)
    assert (fixed.device, fixed.precision) == ("cuda", "fp32")  # explicit values stay (a CPU head, GPU workers)


@pytest.mark.parametrize("precision, engines", [("fp32", "float32"), ("bf16-mixed", "bfloat16"), ("bf16", "bfloat16")])
def test_engines_follow_the_precision_without_a_warning(precision, engines):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matched pair warns nothing
        cfg = load_config(SPEC, [f"policy.precision={precision}"])
    assert (cfg.policy.precision, cfg.policy.generation.vllm_kwargs["dtype"]) == (precision, engines)


def test_engine_dtype_is_checked_against_the_precision():
    key = "policy.generation.vllm_kwargs.dtype"
    for fp16 in ("float16", "half"):  # no trainer precision goes with fp16 engines: refused, with the fix
        with pytest.raises(
            ConfigError, match=rf"{key}=float16: .*no matching precision.*Remove {key}.*policy.precision=bf16-mixed"
        ):
            load_config(SPEC, [f"{key}={fp16}"])
    # set apart on purpose: allowed, with a warning that names the cost and the fix
    with pytest.warns(
        UserWarning, match=rf"{key}=bfloat16 with policy.precision=fp32: .*policy.precision=bf16-mixed trains faster"
    ):
        cfg = load_config(SPEC, ["policy.precision=fp32", f"{key}=bfloat16"])
    assert (cfg.policy.precision, cfg.policy.generation.vllm_kwargs["dtype"]) == ("fp32", "bfloat16")
    with pytest.warns(UserWarning, match=rf"{key}=float32 with policy.precision=bf16-mixed: .*Remove {key}"):
        load_config(SPEC, ["policy.precision=bf16-mixed", f"{key}=float"])


def test_bad_precision_names_the_key_and_the_choices():
    with pytest.raises(
        ConfigError,
        match=r"policy.precision='fp16' must be auto, fp32, bf16-mixed or bf16: bf16-mixed keeps fp32 weights",
    ):
        load_config(SPEC, ["policy.precision=fp16"])


def test_the_replaced_dtype_key_names_its_successor(tmp_path):
    for old, new in (("float32", "fp32"), ("bfloat16", "bf16-mixed"), ("auto", "auto")):
        with pytest.raises(
            ConfigError,
            match=rf"policy.dtype={old} was replaced by policy.precision .*"
            rf"set policy.precision={new}\b.* and remove policy.dtype",
        ):
            load_config(SPEC, [f"policy.dtype={old}"])
    old_file = tmp_path / "old.yaml"  # a config written before policy.precision
    old_file.write_text(f"defaults: [{SPEC}]\npolicy: {{dtype: bfloat16}}\n")
    with pytest.raises(ConfigError, match="policy.dtype=bfloat16 was replaced by policy.precision"):
        load_config(old_file)


@pytest.mark.parametrize("name", sorted(STATED_HARDWARE))
def test_gpu_configs_train_bf16_mixed_with_bf16_engines(name):
    cfg = load_config(ROOT / "configs" / name, ["policy.device=cuda", "cluster.address=auto"])
    assert (cfg.policy.precision, cfg.policy.generation.vllm_kwargs["dtype"]) == ("bf16-mixed", "bfloat16")


def test_gpu_configs_point_at_real_pairs():
    eagle = load_config(ROOT / "configs/qwen3_eagle3.yaml")
    assert eagle.policy.model_name == "Qwen/Qwen3-8B"
    assert eagle.policy.generation.vllm_kwargs["speculative_config"]["method"] == "eagle3"
    ngram = load_config(ROOT / "configs/qwen3_ngram.yaml")
    assert "model" not in ngram.policy.generation.vllm_kwargs["speculative_config"]  # replaced, not merged


def test_prepared_toy_config_fills_rl_defaults():
    cfg = prepare_models(load_config(SPEC))
    kw = cfg.policy.generation.vllm_kwargs
    assert Path(cfg.policy.model_name, "config.json").is_file()
    assert Path(kw["speculative_config"]["model"], "config.json").is_file()
    assert kw["speculative_config"]["draft_sample_method"] == "probabilistic"
    assert kw["dtype"] == COMPUTE[cfg.policy.precision]  # the engine samples in the trainer's compute dtype


def test_overrides_any_key_and_null():
    cfg = load_config(
        SPEC,
        ["grpo.max_steps=5", "logger.log_dir=/tmp/somewhere", "policy.generation.vllm_kwargs.speculative_config=null"],
    )
    assert cfg.grpo.max_steps == 5
    assert cfg.logger.log_dir == "/tmp/somewhere"
    assert (
        "speculative_config" not in cfg.policy.generation.vllm_kwargs
        or cfg.policy.generation.vllm_kwargs["speculative_config"] is None
    )


def test_defaults_inheritance_and_interpolation(tmp_path):
    (tmp_path / "base.yaml").write_text("seed: 3\ngrpo: {max_steps: 7}\nlogger: {log_dir: /tmp/base}\n")
    (tmp_path / "child.yaml").write_text(
        "defaults: [base.yaml]\ngrpo: {val_every: 2}\nlogger: {log_dir: '/tmp/run_${seed}'}\n"
    )
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.seed, cfg.grpo.max_steps, cfg.grpo.val_every, cfg.logger.log_dir) == (3, 7, 2, "/tmp/run_3")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["grpo.max_stpes=5"], "grpo.max_stpes"),
        (["grpo.max_steps=0"], "grpo.max_steps"),
        (["grpo.max_steps=many"], "grpo.max_steps"),
        (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt"),
        (["checkpoint.grace_s=0"], "checkpoint.grace_s=0.0 must be > 0"),
        (["checkpoint.on_error=ignore"], "checkpoint.on_error='ignore' must be stop"),
        (["grpo.clip_eps=1.5"], "grpo.clip_eps"),
        (["policy.generation.temperature=0"], "policy.generation.temperature"),
        (["policy.generation.temperature=0.7"], "policy.generation.temperature=0.7: the trainer scores"),
        (["policy.generation.top_p=0.9"], "policy.generation.top_p=0.9: the trainer scores"),
        (["policy.generation.top_k=50"], "set it to -1"),
        (["policy.generation.num_engines=0"], "policy.generation.num_engines"),
        (["policy.generation.vllm_kwargs.max_modle_len=64"], "max_modle_len"),
        (["policy.generation.vllm_kwargs.speculative_config.method=magic"], "speculative_config.method"),
        (["policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens=0"], "num_speculative_tokens"),
        (["policy.generation.vllm_kwargs.speculative_config.rejection_sample_method=synthetic"], "synthetic"),
        # wrong types inside speculative_config: a config error naming the key, never a traceback
        ([f"{SPEC_KEY}.num_speculative_tokens=abc"], "speculative_config.num_speculative_tokens='abc' must be an int"),
        ([f"{SPEC_KEY}.num_speculative_tokens=[1,2]"], "num_speculative_tokens=[1, 2] must be an integer"),
        ([f"{SPEC_KEY}.num_speculative_tokens=1.5"], "num_speculative_tokens=1.5 must be an integer"),
        ([f"{SPEC_KEY}.method={{a: 1}}"], "speculative_config.method={'a': 1} must be a string"),
        ([f"{SPEC_KEY}.model=123"], "speculative_config.model=123 must be a string"),
        ([f"{SPEC_KEY}.num_speculative_tokens_per_batch_size=abc"], "num_speculative_tokens_per_batch_size='abc'"),
        (["task.name=chess"], "task.name"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
        (["grpo.max_steps"], "key=value"),
        (["policy.num_workers=0"], "policy.num_workers"),
        (["policy.strategy=zero3"], "policy.strategy"),
        (["policy.device=tpu"], "policy.device"),
        (["policy.gpus_per_worker=-1"], "policy.gpus_per_worker"),
        (["policy.gpus_per_worker=2"], "policy.num_workers for more GPUs"),
        (["policy.cpus_per_worker=-1"], "policy.cpus_per_worker"),
        (["policy.refit_bucket_bytes=0"], "policy.refit_bucket_bytes"),
        (["policy.placement_strategy=RANDOM"], "policy.placement_strategy"),
        (["policy.device=cuda"], "policy.device=cuda"),  # this machine has no CUDA and no cluster.address is set
        (
            ["policy.generation.drafter_training.enabled=true", "policy.generation.drafter_training.top_k=21"],
            "drafter_training.top_k",
        ),
        (
            ["policy.generation.drafter_training.enabled=true", "policy.generation.drafter_training.every=0"],
            "drafter_training.every",
        ),
        (
            ["policy.generation.drafter_training.enabled=true", "policy.generation.drafter_training.max_sequences=-1"],
            "drafter_training.max_sequences",
        ),
        (
            [
                "policy.generation.drafter_training.enabled=true",
                "policy.generation.vllm_kwargs.speculative_config=null",
            ],
            "needs speculation",
        ),
        (["policy.generation.acceptance_canary.action=ignore"], "acceptance_canary.action"),
        (["policy.generation.acceptance_canary.min_ratio=1.5"], "acceptance_canary.min_ratio"),
        (["policy.generation.speculation_control.mode=always"], "speculation_control.mode"),
        (
            [
                "policy.generation.speculation_control.mode=adaptive",
                "policy.generation.vllm_kwargs.speculative_config=null",
            ],
            "needs speculation",
        ),
        (
            [
                "policy.generation.speculation_control.mode=adaptive",
                "policy.generation.vllm_kwargs.speculative_config.method=ngram",
                "policy.generation.vllm_kwargs.speculative_config.model=null",
                "policy.generation.vllm_kwargs.speculative_config.draft_sample_method=null",
            ],
            "mode=adaptive with speculative_config.method='ngram'",
        ),
        (
            ["policy.generation.speculation_control.mode=fixed", "policy.generation.vllm_kwargs.async_scheduling=true"],
            "async_scheduling",
        ),
        (
            ["policy.generation.speculation_control.mode=adaptive", "policy.generation.speculation_control.k_max=2"],
            "speculation_control.k_max=2",
        ),
        (
            [
                "policy.generation.speculation_control.mode=adaptive",
                "policy.generation.speculation_control.buckets=[2,4]",
            ],
            "speculation_control.buckets",
        ),
        (
            [
                "policy.generation.speculation_control.mode=adaptive",
                "policy.generation.speculation_control.explore=0.9",
            ],
            "speculation_control.explore",
        ),
        (
            [
                "policy.generation.speculation_control.mode=adaptive",
                "policy.generation.speculation_control.explore_steps=0",
            ],
            "speculation_control.explore_steps",
        ),
        (
            [
                "policy.generation.speculation_control.mode=adaptive",
                "policy.generation.speculation_control.min_gain=-0.1",
            ],
            "speculation_control.min_gain",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(SPEC, overrides)
    assert needle in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: {max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    loop = tmp_path / "loop.yaml"
    loop.write_text("defaults: [loop.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(loop)


def test_drafter_with_other_vocab_is_refused(tmp_path):
    import json

    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 151936}))
    with pytest.raises(ConfigError, match="vocab_size 151936"):
        prepare_models(load_config(SPEC, [f"policy.generation.vllm_kwargs.speculative_config.model={d}"]))


def test_entry_point_fails_fast_with_the_key(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/run_grpo.py"),
            "--config",
            str(SPEC),
            "grpo.lr=1",
            f"logger.log_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert "grpo.lr" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written
