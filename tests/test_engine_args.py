"""From YAML to the engine: the typed speculation object and :func:`engine_args`, the one function that builds
what an engine receives.

``tests/fixtures/engine_args.json`` holds the engine arguments every shipped config (and a few run-time-k and
method overrides) gave before the speculative config was typed; they must come out the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_specdec.config import Speculation, checks, engine_args, load_config, precision
from rl_specdec.config.generation import GenerationConfig, SpeculationControlConfig
from rl_specdec.toy.resolve import prepare_models

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = json.loads((ROOT / "tests/fixtures/engine_args.json").read_text())
EXTENSION = "rl_specdec.rollout.engine_ext.RlSpecdecExtension"


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    """``auto`` resolves as on the machine the snapshot was taken on: no CUDA, no native bf16."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(checks, "cuda_available", lambda: False)


def test_the_snapshot_covers_every_shipped_config():
    assert {c["config"] for c in SNAPSHOT} == {p.name for p in (ROOT / "configs").glob("*.yaml")}


@pytest.mark.parametrize("case", SNAPSHOT, ids=lambda c: " ".join([c["config"], *c["overrides"]])[:80])
def test_every_config_gives_the_engine_arguments_it_gave(case, cpu_without_bf16):
    cfg = load_config(ROOT / "configs" / case["config"], case["overrides"])
    got = engine_args(cfg.policy.generation, cfg.policy.model_name, cfg.seed, EXTENSION, quiet=case.get("quiet", False))
    assert json.loads(json.dumps(got)) == case["engine_args"]


def test_the_extension_named_is_the_engines():
    from rl_specdec.rollout.engine_ext import EXTENSION as actual

    assert EXTENSION == actual


def test_a_changed_speculation_fails_the_comparison(cpu_without_bf16):
    """Negative control: the comparison sees a k of 4 instead of 3."""
    case = next(c for c in SNAPSHOT if c["config"] == "grpo_spec.yaml" and not c["overrides"])
    cfg = load_config(
        ROOT / "configs/grpo_spec.yaml", ["policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens=4"]
    )
    got = engine_args(cfg.policy.generation, cfg.policy.model_name, cfg.seed, EXTENSION)
    assert json.loads(json.dumps(got)) != case["engine_args"]


def test_speculation_is_typed_frozen_and_round_trips():
    raw = {
        "method": "draft_model",
        "model": "/d",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 2]],
        "draft_sample_method": "probabilistic",
    }
    spec = Speculation.from_vllm(raw)
    assert (spec.method, spec.model, spec.k, spec.schedule) == ("draft_model", "/d", 4, ((1, 8, 4), (9, 64, 2)))
    assert spec.to_vllm() == raw and not spec.is_head
    with pytest.raises(AttributeError):
        spec.k = 5  # frozen
    with pytest.raises(TypeError):
        spec.options["draft_sample_method"] = "greedy"  # read-only
    assert Speculation.from_vllm(None) is None
    assert Speculation.from_vllm({"method": "ngram", "num_speculative_tokens": 3}).model is None


def test_runtime_k_settings_come_from_the_object():
    spec = Speculation.from_vllm({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3})
    at = spec.to_vllm(SpeculationControlConfig(mode="fixed", k_max=5, draft_below=16))
    assert at["num_speculative_tokens"] == 5
    assert at["num_speculative_tokens_per_batch_size"] == [[1, 15, 3], [16, 1 << 16, 0]]
    assert spec.to_vllm(SpeculationControlConfig(mode="fixed"))["num_speculative_tokens_per_batch_size"] == [
        [1, 1 << 16, 3]
    ]


def test_a_generation_config_reads_speculation_as_the_object():
    gen = GenerationConfig(
        vllm_kwargs={"speculative_config": {"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}}
    )
    assert gen.speculation.is_head and gen.speculation.k == 2
    off = gen.without_speculation()
    assert off.speculation is None and gen.speculation is not None  # a copy; the original keeps its drafter


# ---- readers use the object -------------------------------------------------------------------------------

SPEC_KEYS = {"speculative_config", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}


def string_key_reads(source: str) -> list[int]:
    """Lines that read a speculative-config key by string: ``x["speculative_config"]`` or
    ``x.get("speculative_config")`` (and the k keys), a write (``x[...] = ...``) excepted."""
    import ast

    tree, lines = ast.parse(source), []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if node.args else None
        if isinstance(key, ast.Constant) and key.value in SPEC_KEYS:
            lines.append(node.lineno)
    return lines


def test_no_module_outside_the_config_room_reads_the_speculative_config_by_key():
    found = []
    for folder in ("rl_specdec", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent.name == "config" and path.parent.parent.name == "rl_specdec":
                continue
            found += [f"{path.relative_to(ROOT)}:{n}" for n in string_key_reads(path.read_text())]
    assert found == [], f"read GenerationConfig.speculation instead: {found}"


def test_the_key_reader_check_finds_a_read():
    """Negative control: both spellings are found, and a write is not."""
    src = 'a = kw["speculative_config"]\nb = kw.get("speculative_config")\nkw["speculative_config"] = None\n'
    assert string_key_reads(src) == [1, 2]


def test_loading_every_shipped_config_builds_and_fetches_nothing(tmp_path, monkeypatch):
    """An empty model cache and no network: every shipped config loads, and the cache stays empty. Negative
    control: preparing the models is seen building into it."""
    monkeypatch.setenv("RL_SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)
    assert not (tmp_path / "cache").exists()

    from rl_specdec.toy import build

    def fake_build(cfg=None, root=None, log=print):  # stands for the 90-s build: it writes into the cache
        (tmp_path / "cache" / "digits").mkdir(parents=True)
        return build.ToyModels(tmp_path / "cache" / "digits")

    monkeypatch.setattr(build, "build_toy_models", fake_build)
    with pytest.warns(UserWarning, match="vocabularies were not compared"):  # the fake folders hold no model
        prepare_models(load_config(ROOT / "configs/grpo_spec.yaml"))
    assert (tmp_path / "cache").exists()


def test_an_async_engine_on_cpu_gets_the_executor_that_carries_the_cpu_fix(cpu_without_bf16):
    """The async worker's engine arguments come from the same function; the executor is named, so the printed
    arguments are the ones the engine gets, and vLLM resolves it by name."""
    from rl_specdec.errors import ConfigError
    from rl_specdec.vllm_ext.worker import EXECUTOR_NAME, EXECUTOR_QUALNAME

    gen = load_config(ROOT / "configs/grpo_spec.yaml").policy.generation
    sync = engine_args(gen, "/p", 0, EXTENSION, on_cpu=True)
    got = engine_args(gen, "/p", 0, EXTENSION, asynchronous=True, on_cpu=True)
    assert "distributed_executor_backend" not in sync
    assert got == {**sync, "distributed_executor_backend": EXECUTOR_QUALNAME}
    assert EXECUTOR_QUALNAME == f"rl_specdec.vllm_ext.worker.{EXECUTOR_NAME}"
    assert "distributed_executor_backend" not in engine_args(gen, "/p", 0, EXTENSION, asynchronous=True, on_cpu=False)
    gen.vllm_kwargs["tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match="remove tensor_parallel_size"):
        engine_args(gen, "/p", 0, EXTENSION, asynchronous=True, on_cpu=True)


def test_generation_settings_made_in_code_are_checked_as_a_loaded_configs_are():
    from rl_specdec.config import generation_config
    from rl_specdec.errors import ConfigError

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    gen = generation_config("/p", {"speculative_config": spec}, num_engines=2)
    assert gen.num_engines == 2 and gen.speculation.k == 3
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        generation_config("/p", {"speculative_config": {**spec, "num_speculative_tokens": "abc"}})
    control = SpeculationControlConfig(mode="sometimes")
    with pytest.raises(ConfigError, match="speculation_control.mode='sometimes'"):
        generation_config("/p", {"speculative_config": spec}, speculation_control=control)


def test_the_typed_speculation_is_kept_and_follows_a_replaced_dict():
    spec = {"method": "draft_model", "model": "toy:drafter", "num_speculative_tokens": 3}
    gen = GenerationConfig(vllm_kwargs={"speculative_config": spec})
    first = gen.speculation
    assert gen.speculation is first  # typed once, not on each read
    gen.set_drafter_model("/d")
    assert gen.speculation.model == "/d" and spec["model"] == "toy:drafter"  # replaced, not edited in place
    gen.vllm_kwargs = {}
    assert gen.speculation is None


def test_resolution_returns_a_new_config_and_leaves_the_one_it_was_given_as_written():
    from rl_specdec.config import to_dict
    from rl_specdec.config.load import load_config_as_written, resolve

    written = load_config_as_written(ROOT / "configs/grpo_spec.yaml")
    before = to_dict(written)
    resolved = resolve(written)
    assert to_dict(written) == before  # nothing changed in place
    assert written.policy.generation.speculation_control.mode == "auto" and written.policy.device == "auto"
    assert resolved.policy.generation.speculation_control.mode == "fixed" and resolved.policy.device == "cpu"
    assert "dtype" not in written.policy.generation.vllm_kwargs and "dtype" in resolved.policy.generation.vllm_kwargs
