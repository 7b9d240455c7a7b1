"""``python -m benchmarks``: every command is listed and takes --help, every study runs as a module from the
repository's root (``python -m benchmarks.studies.<name> --help``), the GRPO command's defaults come from the shipped
config, and no two GRPO variants run the same settings. No engine starts: only parsers and configs are exercised.
Nothing puts a folder on the path: ``python -m`` and ``python -c`` run from the root find ``benchmarks`` there."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = (
    "grpo",
    "paired",
    "staleness",
    "peer",
    "rollout",
    "cost-table",
    "batch-sweep",
    "gpu-whatif",
    "gpu-torch",
    "gpu-head",
    "refit",
    "exactness",
)
# every module of benchmarks/studies/ that runs
STUDIES = tuple(
    sorted(p.stem for p in (ROOT / "benchmarks" / "studies").glob("*.py") if '__name__ == "__main__"' in p.read_text())
)

# One process per group, each importing torch once: `python -m benchmarks <command> --help` is __main__.main,
# and `python -m benchmarks.studies.<name> --help` is runpy.run_module, as `python -m` runs it (from the root).
RUNNER = textwrap.dedent(
    """
    import runpy, sys
    kind, names = sys.argv[1], sys.argv[2:]
    codes = {}
    for name in names:
        if kind == "command":
            from benchmarks.__main__ import main
            call = lambda: main([name, "--help"])
        else:
            sys.argv = [name, "--help"]
            call = lambda: runpy.run_module(name, run_name="__main__", alter_sys=True)
        try:
            codes[name] = call()
        except SystemExit as e:
            codes[name] = e.code
    print("CODES", repr(codes))
    """
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _codes(proc: subprocess.CompletedProcess) -> dict:
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CODES ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return eval(line[len("CODES ") :])  # noqa: S307  (our runner's repr of a dict of names and exit codes)


def test_help_lists_every_command_and_each_command_and_study_takes_help():
    with ThreadPoolExecutor(3) as pool:
        top = pool.submit(_run, "-m", "benchmarks", "--help")
        commands = pool.submit(_run, "-c", RUNNER, "command", *COMMANDS)
        studies = pool.submit(_run, "-c", RUNNER, "study", *(f"benchmarks.studies.{s}" for s in STUDIES))
    listed = {line.split()[0] for line in top.result().stdout.split("commands:")[1].splitlines() if line.strip()}
    assert top.result().returncode == 0 and listed == set(COMMANDS)
    got = _codes(commands.result())
    assert got == {c: 0 for c in COMMANDS}, commands.result().stderr[-2000:]
    assert "usage: python -m benchmarks grpo" in commands.result().stdout  # the tool's help names the command
    got = _codes(studies.result())
    assert got == {f"benchmarks.studies.{s}": 0 for s in STUDIES}, studies.result().stderr[-2000:]


def test_an_unknown_command_is_refused_with_the_choices():
    proc = _run("-m", "benchmarks", "exactnes")
    assert proc.returncode == 2 and "unknown command 'exactnes'" in proc.stderr and "grpo" in proc.stderr


QUIET_PROBE = """
import os, sys, types
import benchmarks.__main__ as cli
module = types.ModuleType("probe")
module.main = lambda argv: print("LEVELS", os.environ.get("VLLM_LOGGING_LEVEL"), os.environ.get("RL_SPECDEC_LOG_LEVEL"))
sys.modules["probe"] = module
cli.COMMANDS["probe"] = cli.Command("probe", "main", "?")
sys.exit(cli.main(["probe"]))
"""


def test_a_command_runs_with_a_quiet_console_unless_asked():
    """vLLM and Ray log at ERROR in a command and the engines it starts, set before the command's module loads;
    RL_SPECDEC_LOG_LEVEL=info brings their lines back."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "RL_SPECDEC_LOG_LEVEL")}
    for given, want in ((None, "LEVELS ERROR ERROR"), ("info", "LEVELS INFO INFO")):
        extra = {"RL_SPECDEC_LOG_LEVEL": given} if given else {}
        proc = subprocess.run(
            [sys.executable, "-c", QUIET_PROBE], cwd=ROOT, env={**env, **extra}, capture_output=True, text=True
        )
        assert proc.returncode == 0 and want in proc.stdout.splitlines(), proc.stdout + proc.stderr


def test_grpo_steps_default_to_the_shipped_config_and_quick_runs_the_default_against_its_baseline():
    from benchmarks.grpo import bench_args
    from rl_specdec.config import load_config

    shipped = load_config(ROOT / "configs/grpo_spec.yaml").grpo.max_steps
    b = bench_args.parse(["--variants", "grpo_base;draft k=2"], "doc", "grpo")
    assert b.steps == shipped and b.sections == ["grpo"] and b.out == Path("results/grpo")
    assert b.args.lockstep is False  # only --quick turns it on by itself
    q = bench_args.parse(["--quick"], "doc", "grpo")
    assert q.names == ["grpo_base", "grpo_spec"] and q.steps == bench_args.QUICK_STEPS and q.args.lockstep
    assert bench_args.parse(["--quick", "--steps", "7", "--no-lockstep"], "doc", "grpo").steps == 7
    assert bench_args.parse(["--variants", "grpo_base"], "doc", "staleness").sections == ["grpo", "staleness"]
    with pytest.raises(SystemExit):
        bench_args.parse(["--sections", "grpo"], "doc", "grpo")  # one section per command


def test_no_two_grpo_variants_run_the_same_settings():
    """Each variant's effective config (as bench_runs runs it, with a --steps of its own) differs from every
    other's, but for the deliberate pairs: the A/A control, and the precision pins (one of each pair is what
    precision=auto picks on a given machine)."""
    from benchmarks.grpo.bench_variants import GRPO_VARIANTS, PRECISION_VARIANTS, REPO
    from rl_specdec.config import load_config

    allowed = {"grpo_base again"} | PRECISION_VARIANTS
    seen: dict[str, str] = {}
    for name, (config, overrides) in GRPO_VARIANTS.items():
        cfg = dataclasses.asdict(load_config(REPO / config, ["grpo.max_steps=7", *overrides]))
        cfg.pop("logger")  # each run logs to its own folder
        key = repr(sorted(cfg.items()))
        twin = seen.get(key)
        assert twin is None or {name, twin} & allowed, f"{name!r} runs the settings of {twin!r}"
        seen.setdefault(key, name)


def test_a_precision_variant_is_compared_with_no_speculation_in_its_own_precision():
    from benchmarks.grpo.bench_variants import baseline_of

    assert baseline_of("smollm2 ngram bf16-mixed") == "smollm2 base bf16-mixed"
    assert baseline_of("grpo_spec fp32") == "grpo_base fp32"
    assert baseline_of("smollm2 ngram") == "smollm2 base"


def test_machine_label_names_vendor_family_cores_and_best_vector_extension(monkeypatch):
    import torch

    from rl_specdec import sysinfo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sysinfo, "usable_cores", lambda: 2)
    monkeypatch.setattr(sysinfo, "cpu_model", lambda: "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz")
    monkeypatch.setattr(sysinfo, "_cpu_flags", lambda: {"avx2", "avx512f", "amx_tile"})
    assert sysinfo.machine_label() == "Intel Xeon 2c AMX"
    monkeypatch.setattr(sysinfo, "cpu_model", lambda: "AMD EPYC 7B13 64-Core Processor")
    monkeypatch.setattr(sysinfo, "_cpu_flags", lambda: {"avx2"})
    assert sysinfo.machine_label() == "AMD EPYC 2c AVX2"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert sysinfo.machine_label() == "NVIDIA H100 80GB HBM3"


def test_train_phase_is_pooled_within_each_workload_and_kept_for_variants_that_change_it():
    """The real model's variants pool their train phase like the wide pair's; a variant whose train phase holds its
    own work (the head trained online) keeps its own, and no workload's mean leaks into another's."""
    from benchmarks.grpo.bench_runs import pool_train_time

    def run(step, train):
        return {"step_mean_s": step, "train_s": train}

    stats = {
        "smollm2 base": run(60.0, 46.0),
        "smollm2 eagle3 frozen": run(70.0, 44.0),
        "smollm2 eagle3 online": run(77.0, 47.0),
        "wide base": run(18.0, 11.0),
        "wide adaptive": run(17.0, 13.0),
    }
    pool_train_time(stats)
    assert stats["smollm2 base"]["step_pooled_s"] == pytest.approx(60.0 - 46.0 + 45.0)
    assert stats["smollm2 eagle3 frozen"]["step_pooled_s"] == pytest.approx(70.0 - 44.0 + 45.0)
    assert stats["smollm2 eagle3 online"]["step_pooled_s"] == 77.0
    assert stats["wide adaptive"]["step_pooled_s"] == pytest.approx(17.0 - 13.0 + 12.0)
