"""The toggles a user reaches for: switching speculation in one line, task arguments, methods the backend cannot
run, ``--print-config`` and ``--help``. Pure config logic: no engine starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_specdec.config import ConfigError, load_config, load_config_as_written
from rl_specdec.config.layers import SPEC_KEY, apply_overrides, read_yaml
from rl_specdec.config.vllm_kwargs import check_backend_runs
from rl_specdec.toy.resolve import prepare_models
from rl_specdec.vllm_ext.methods import method as method_row

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "configs" / "grpo_spec.yaml"
BASE = ROOT / "configs" / "grpo_base.yaml"
EAGLE3 = ROOT / "configs" / "qwen3_eagle3.yaml"
S = SPEC_KEY
# One line to each method from grpo_spec.yaml (draft_model, toy:drafter); a drafter method names its model.
SWITCHES = {
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "mtp": {"method": "mtp"},
    "eagle3": {"method": "eagle3", "model": "Tengyunw/qwen3_8b_eagle3"},
    "draft_model": {"method": "draft_model", "model": "Qwen/Qwen3-0.6B"},
}
ON_GPU = ["policy.device=cuda", "cluster.address=auto"]  # as on a GPU cluster: the CPU backend check steps aside


def _spec(raw):
    from omegaconf import OmegaConf

    node = OmegaConf.select(raw, S)
    return None if node is None else OmegaConf.to_container(node)


def _child(tmp_path, spec_yaml: str) -> Path:
    f = tmp_path / "child.yaml"
    f.write_text(
        f"defaults: [{SPEC}]\npolicy:\n  generation:\n    vllm_kwargs:\n      speculative_config: {spec_yaml}\n"
    )
    return f


@pytest.mark.parametrize("method", sorted(SWITCHES))
def test_command_line_method_switch_starts_from_its_defaults(method):
    edits = SWITCHES[method]
    spec = _spec(apply_overrides(read_yaml(SPEC), [f"{S}.{k}={v}" for k, v in edits.items()]))
    if method == "draft_model":  # the same method: an edit in place, the other keys stay
        assert spec == {"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 3,
                        "draft_sample_method": "probabilistic"}  # fmt: skip
    else:
        assert spec == {"method": method, **dict(method_row(method).defaults), **edits}  # toy:drafter is not inherited


@pytest.mark.parametrize("method", sorted(SWITCHES))
def test_yaml_child_and_command_line_dict_replace_the_inherited_config(tmp_path, method):
    written = {**SWITCHES[method], "num_speculative_tokens": 2}
    flow = "{" + ", ".join(f"{k}: {v}" for k, v in written.items()) + "}"
    assert _spec(read_yaml(_child(tmp_path, flow))) == written
    assert _spec(apply_overrides(read_yaml(SPEC), [f"{S}={flow}"])) == written


def test_single_key_edit_keeps_the_rest_and_null_turns_speculation_off():
    spec = _spec(apply_overrides(read_yaml(SPEC), [f"{S}.num_speculative_tokens=5"]))
    assert spec == {"method": "draft_model", "model": "toy:drafter", "num_speculative_tokens": 5,
                    "draft_sample_method": "probabilistic"}  # fmt: skip
    assert _spec(apply_overrides(read_yaml(SPEC), [f"{S}=null"])) is None
    back = _spec(apply_overrides(read_yaml(BASE), [f"{S}.method=draft_model", f"{S}.model=toy:drafter"]))
    assert back == {"method": "draft_model", "model": "toy:drafter", **dict(method_row("draft_model").defaults)}


@pytest.mark.parametrize("device", [ON_GPU, ["policy.device=cpu"]])
@pytest.mark.parametrize("method", sorted(SWITCHES))
def test_every_switch_validates_on_any_machine(method, device):
    """Validation is a property of the config, not of this machine: eagle3 validates on a CPU machine too."""
    edits = [f"{S}.{k}={v}" for k, v in SWITCHES[method].items()]
    cfg = load_config_as_written(SPEC, device + edits)
    assert cfg.policy.generation.vllm_kwargs["speculative_config"]["method"] == method


@pytest.mark.parametrize("method", ["mtp"])
def test_methods_the_cpu_backend_cannot_run_are_refused_where_the_run_starts(method, monkeypatch):
    from rl_specdec.grpo import run

    def started(*_a, **_k):
        raise AssertionError("the run started something before the backend check")

    monkeypatch.setattr(run, "MetricsLogger", started)
    monkeypatch.setattr(run, "prepare_task", started)
    edits = [f"{S}.{k}={v}" for k, v in SWITCHES[method].items()]
    cfg = load_config(SPEC, ["policy.device=cpu"] + edits)  # it validates: a run may go elsewhere
    with pytest.raises(ConfigError, match=rf"method='{method}' does not run on vLLM's CPU backend.*method=ngram"):
        run.setup(cfg)


def test_backend_check_names_the_key_the_reason_and_the_fix():
    check_backend_runs({"method": "mtp"}, on_cpu=False)
    for method in ("draft_model", "eagle3", "ngram"):
        check_backend_runs({"method": method}, on_cpu=True)
    with pytest.raises(ConfigError, match=r"speculative_config.method='mtp' does not run on vLLM's CPU"):
        check_backend_runs({"method": "mtp"}, on_cpu=True)
    check_backend_runs({"method": "suffix"}, on_cpu=True, has_arctic_inference=True)
    with pytest.raises(ConfigError, match=r"method='suffix' needs the arctic-inference.*install_arctic_inference"):
        check_backend_runs({"method": "suffix"}, on_cpu=False, has_arctic_inference=False)


def test_task_arguments_are_checked_against_the_task_signature():
    load_config(SPEC, ["task.kwargs.max_len=9"])
    with pytest.raises(ConfigError) as e:
        load_config(SPEC, ["task.kwargs.max_lenn=8"])
    msg = str(e.value)
    assert "task.kwargs.max_lenn is not an argument of task 'sorting'" in msg
    assert "Did you mean task.kwargs.max_len?" in msg and "min_len, max_len, dataset_size" in msg


def _run_grpo(*args, env=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "examples/run_grpo.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def print_config(monkeypatch, capsys):
    """examples/run_grpo.py's main(argv) in this process: a child would spend ~20 s importing vLLM again to check
    the config against its declarations. The console settings main() makes, and its facts file, are put back
    afterwards."""
    import importlib.util
    import logging

    from rl_specdec.metrics.console import LEVEL_ENV, THIRD_PARTY_LOGGERS

    spec = importlib.util.spec_from_file_location("run_grpo_main", ROOT / "examples/run_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for var in (LEVEL_ENV, "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY"):
        # main() sets these with os.environ; monkeypatch undoes only what it recorded, and it records nothing when
        # deleting a variable that is not set: set first, so teardown removes what main() set (Ray workers of
        # later tests inherit this process's environment)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    loggers = [logging.getLogger(name) for name in ("", "rl_specdec", *THIRD_PARTY_LOGGERS)]
    levels = [lg.level for lg in loggers]

    def run(*args, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        code = module.main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    yield run
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)
    from rl_specdec.vllm_ext import facts

    facts.use_file(False)  # main() turned the facts file on; the tests' own process asks vLLM live
    facts.facts_path.cache_clear()


def test_print_config_shows_the_config_as_written_and_builds_nothing(tmp_path, print_config):
    cache = tmp_path / "cache"
    r = print_config("--config", str(SPEC), "--print-config", f"{S}.method=ngram", env={"RL_SPECDEC_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "model_name: toy:policy" in r.stdout and "method: ngram" in r.stdout and "precision: auto" in r.stdout
    assert "toy:drafter" not in r.stdout
    # no toy model was built: the cache holds at most this vLLM installation's facts (vllm_ext/facts.py)
    assert not cache.exists() or [p.name for p in cache.iterdir()] == ["vllm-facts"]
    # printing validates: a misspelled key fails, named, on a config this machine could not run either
    r = print_config("--config", str(EAGLE3), "--print-config", "policy.device=cpu", f"{S}.num_speculative_tokenz=3")
    assert r.returncode == 2 and f"{S}.num_speculative_tokenz is not a field of vLLM's SpeculativeConfig" in r.stderr


def test_print_config_prints_a_gpu_config_on_a_cpu_machine(print_config):
    """Printing does not ask whether this machine can run the method (eagle3 on vLLM's CPU build); a run does."""
    r = print_config("--config", str(EAGLE3), "--print-config", "policy.device=cpu")
    assert r.returncode == 0, r.stderr
    assert "method: eagle3" in r.stdout and "model_name: Qwen/Qwen3-8B" in r.stdout
    resolved = prepare_models(load_config(EAGLE3, ["policy.device=cpu"]))  # as --print-config --resolved: no fetch
    assert resolved.policy.model_name == "Qwen/Qwen3-8B"


def test_help_lists_every_shipped_config_with_one_line():
    r = _run_grpo("--help")
    assert r.returncode == 0
    for path in (ROOT / "configs").glob("*.yaml"):
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith(path.name))
        assert len(line.split(path.name, 1)[1].strip()) > 10
    assert "--resolved" in r.stdout and "wandb sync" in r.stdout and "docs/grpo.md" in r.stdout


def test_print_config_resolved_prints_what_each_engine_receives(print_config):
    """--print-config --resolved: the model folders and engine_args() (run-time k's settings included), the YAML on
    stdout parseable as a whole."""
    from omegaconf import OmegaConf

    r = print_config("--config", str(SPEC), "--print-config", "--resolved")
    assert r.returncode == 0, r.stderr
    engine = OmegaConf.create(r.stdout.split("# what each engine receives")[1].split("\n", 1)[1]).engine_args
    assert Path(engine.model, "config.json").is_file() and Path(engine.speculative_config.model).is_dir()
    assert engine.scheduler_cls.endswith("SettableKScheduler") and engine.per_request_spec_decode_metrics == "summary"
    # run-time k off: no scheduler of rl_specdec's (in process: the printed dict is engine_args()'s)
    from rl_specdec.config import engine_args

    gen = load_config(SPEC, ["policy.generation.speculation_control.mode=off"]).policy.generation
    assert "scheduler_cls" not in engine_args(gen, engine.model, 0, "ext")
