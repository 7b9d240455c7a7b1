"""End-to-end GRPO on the toy: real Ray, real vLLM with speculation, real wandb (offline)."""

import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest

from rl_specdec.config import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_every=2",
    "grpo.val_num_prompts=8",
    "grpo.self_check_prompts=8",
    "policy.generation.max_new_tokens=28",
    "logger.progress_bar=false",
    "checkpoint.every=2",
    "policy.generation.vllm_kwargs.enforce_eager=true",  # skip torch.compile: the tests need no speed
    # fp32, where on-policy means fp32 rounding (bf16-mixed's floor is ~2e-3: tests/test_precision.py)
    "policy.precision=fp32",
    # vLLM's fixed k=3, not the default's controller: every step drafts, so every spec_decode key and the
    # acceptance canary have drafts to read (the controller has its own runs: tests/test_spec_control.py)
    "policy.generation.speculation_control.mode=off",
]

# Every key a step must log (spec_decode per-position keys are checked separately).
REQUIRED = [
    "train/reward_mean",
    "train/reward_std",
    "train/accuracy",
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "train/logprob_mismatch",
    "train/logprob_mismatch_max",
    "train/ratio_error",
    "generation/tokens_per_s",
    "generation/response_length_mean",
    "generation/response_length_max",
    "generation/response_length_p90",
    "timing/generation",
    "timing/train",
    "timing/refit",
    "timing/reward",
    "timing/step",
    "spec_decode/num_drafts",
    "spec_decode/num_draft_tokens",
    "spec_decode/num_accepted_tokens",
    "spec_decode/acceptance_rate",
    "spec_decode/acceptance_length",
]
# On-policy check: generation and training log-probs of the same tokens, both fp32.
MISMATCH_THRESHOLD = 1e-3


def _rows(log_dir, with_baseline=False):
    rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows if with_baseline else [r for r in rows if r["step"] > 0]


def _train(log_dir, *extra):
    from rl_specdec.grpo.loop import train

    cfg = load_config(ROOT / "configs/grpo_spec.yaml", SMALL + [f"logger.log_dir={log_dir}", *extra])
    return train(cfg, progress=False)


ASYNC_ON = "policy.generation.vllm_kwargs.async_scheduling=true"  # asked for; vLLM's CPU platform drops it
DUMMY = "policy.generation.vllm_kwargs.load_format=dummy"  # random engine weights until the first sync
DRAFTER_ON = "policy.generation.drafter_training.enabled=true"
DRAFTER_KEYS = [
    "drafter/loss",
    "drafter/kl",
    "drafter/version",
    "timing/drafter_train",
    "timing/drafter_wait",
    "timing/drafter_refit",
]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_full")
    warnings = _Collect()
    logging.getLogger("rl_specdec").addHandler(warnings)
    try:
        _train(d, "grpo.max_steps=4", ASYNC_ON, DUMMY, DRAFTER_ON)
    finally:
        logging.getLogger("rl_specdec").removeHandler(warnings)
    (d / "warnings.txt").write_text("\n".join(warnings.messages))
    return d


def test_metrics_jsonl_has_every_key_finite(uninterrupted):
    # k: the most tokens a draft can have (with a batch-size schedule, the largest k in it)
    max_k = load_config(ROOT / "configs/grpo_spec.yaml", SMALL).policy.generation.vllm_kwargs["speculative_config"][
        "num_speculative_tokens"
    ]
    rows = _rows(uninterrupted)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        for k in REQUIRED:
            assert k in r and r[k] is not None and math.isfinite(r[k]), (r["step"], k)
        assert 0.0 <= r["spec_decode/acceptance_rate"] <= 1.0
        assert 1.0 <= r["spec_decode/acceptance_length"] <= max_k + 1
        assert r["spec_decode/num_drafts"] > 0
        for i in range(1, max_k + 1):
            assert 0.0 <= r[f"spec_decode/acceptance_rate_pos_{i}"] <= 1.0
        assert f"spec_decode/acceptance_rate_pos_{max_k + 1}" not in r
        assert r["train/logprob_mismatch"] < MISMATCH_THRESHOLD
        # the long tail: when 50/90/100% of the step's rollouts were done, inside the generation phase
        d50, d90, d100 = (r[f"generation/time_to_{p}pct_done"] for p in (50, 90, 100))
        assert 0.0 < d50 <= d90 <= d100 <= r["timing/generation"], r
    assert "val/accuracy" in rows[1] and "val/accuracy" in rows[3]
    for r in rows:  # the drafter trained and was refit at every step
        for k in DRAFTER_KEYS:
            assert k in r and r[k] is not None and math.isfinite(r[k]), (r["step"], k)
        assert r["spec_decode/canary"] == 0.0
    assert [r["drafter/version"] for r in rows] == [1, 2, 3, 4]
    # it drafted from the first step: the never-drafted warning has nothing to say (its positive run is below)
    assert "drafted nothing" not in (Path(uninterrupted) / "warnings.txt").read_text()
    baseline = _rows(uninterrupted, with_baseline=True)[0]
    assert baseline["step"] == 0 and "val/accuracy" in baseline
    assert baseline["self_check/p_value"] > 1e-6


def test_step_zero_validation_comes_from_the_trainers_weights(uninterrupted, hf_policy, tokenizer):
    """The engines started from random (dummy) weights; the sync before the first rollout must make the
    step-0 validation exactly what the real policy gives (greedy, transformers)."""
    from conftest import hf_greedy
    from rl_specdec.grpo.sources import VAL_SEED
    from rl_specdec.tasks import make_task

    cfg = load_config(ROOT / "configs/grpo_spec.yaml", SMALL)
    samples = make_task(cfg.task.name, **cfg.task.kwargs).validation_batch(seed=VAL_SEED, n=cfg.grpo.val_num_prompts)
    outs = hf_greedy(hf_policy, [tokenizer.encode(s.prompt) for s in samples], cfg.policy.generation.max_new_tokens)
    want = sum(
        o[-1:] == [tokenizer.eos_token_id] and tokenizer.decode(o[:-1]) == s.answer for o, s in zip(outs, samples)
    ) / len(samples)
    baseline = _rows(uninterrupted, with_baseline=True)[0]
    assert baseline["val/accuracy"] == pytest.approx(want, abs=1e-9)
    assert want > 0, "the real toy policy solves some validation problems; 0 would not tell dummy from real weights"


def test_resume_continues_with_the_trained_drafter(uninterrupted, tmp_path):
    """The checkpoint holds the drafter's weights and optimizer: a resumed run goes on from drafter version 2."""
    import shutil

    d = tmp_path / "resumed"
    shutil.copytree(uninterrupted, d, ignore=shutil.ignore_patterns("wandb"))
    shutil.rmtree(d / "checkpoints" / "step_000004")
    assert (d / "checkpoints" / "step_000002" / "drafter" / "model").is_dir()
    _train(d, "grpo.max_steps=3", "resume=true", DRAFTER_ON, "logger.wandb.enabled=false")
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["drafter/version"] == 3, "the resumed drafter started over instead of continuing from step 2"


def test_engine_yaml_says_what_the_engine_runs(uninterrupted):
    """async_scheduling was asked for and dropped by vLLM on CPU: one warning names it; honoured settings give none;
    with strict_engine_settings the same report stops the run."""
    import yaml

    (engine,) = yaml.safe_load((Path(uninterrupted) / "engine.yaml").read_text())["engines"]
    assert engine["async_scheduling"] is False
    assert engine["speculative/method"] == "draft_model" and engine["speculative/num_speculative_tokens"] == 3
    assert engine["backend"] == "cpu" and engine["cpu_expand_fix"] is True and engine["dtype"] == "float32"
    assert engine["load_format"] == "dummy"
    # the shipped KV budget holds max_num_seqs requests with the drafter's layers in it (256 MiB held 204 in fp32)
    from rl_specdec.rollout.engine_settings import kv_capacity

    assert kv_capacity(engine) >= engine["max_num_seqs"], (engine["kv_cache_blocks"], engine["block_size"])
    warned = [m for m in (Path(uninterrupted) / "warnings.txt").read_text().splitlines() if "the engine runs" in m]
    assert len(warned) == 1 and "vllm_kwargs.async_scheduling: requested True, the engine runs False" in warned[0], (
        warned
    )
    assert "vllm: " in (Path(uninterrupted) / "sysinfo.txt").read_text()
    # The same real report under strict_engine_settings: the check the engine group runs as its engines start,
    # before the first step (rollout/engines.py), stops the run instead of warning.
    from rl_specdec.errors import ConfigError
    from rl_specdec.rollout import engine_settings

    strict = load_config(
        ROOT / "configs/grpo_spec.yaml",
        SMALL + [ASYNC_ON, DUMMY, DRAFTER_ON, "policy.generation.strict_engine_settings=true"],
    )
    report = {k: v for k, v in engine.items() if k not in ("engine", "host", "cores")}
    with pytest.raises(ConfigError, match="vllm_kwargs.async_scheduling: requested True, the engine runs False"):
        engine_settings.check(strict.policy.generation, [report], warned.append)
    assert len(warned) == 1  # raised before warning
    assert [m.key for m in engine_settings.mismatches(strict.policy.generation, report)] == ["async_scheduling"]


def test_a_schedule_the_batch_never_thins_to_says_it_drafted_nothing(tmp_path):
    """Every rollout runs to a 4-token cap together, and the schedule drafts only while one request runs: no
    step drafts, the engines' reports say the batch never fell below many requests, and the run warns once."""
    warnings = _Collect()
    logging.getLogger("rl_specdec").addHandler(warnings)
    try:
        _train(
            tmp_path,
            "grpo.max_steps=3",
            "grpo.val_every=0",
            "grpo.self_check_prompts=0",
            "checkpoint.enabled=false",
            "logger.wandb.enabled=false",
            "policy.generation.max_new_tokens=4",  # shorter than every answer: all 16 rollouts end together
            "policy.generation.speculation_control.mode=fixed",
            "policy.generation.speculation_control.draft_below=2",  # k=3 at one running request, 0 from 2 up
        )
    finally:
        logging.getLogger("rl_specdec").removeHandler(warnings)
    rows = _rows(tmp_path)
    assert [r["spec_decode/num_drafts"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["spec_decode/drafted_step_fraction"] for r in rows] == [0.0, 0.0, 0.0]
    assert min(r["spec_decode/fewest_running_requests"] for r in rows) > 1, rows
    said = [m for m in warnings.messages if "drafted nothing" in m]
    assert len(said) == 1 and "only at 1 running requests" in said[0] and "draft_model drafter" in said[0], said


def test_wandb_offline_run_written(uninterrupted):
    runs = list((Path(uninterrupted) / "wandb").glob("offline-run-*"))
    assert runs, "wandb wrote no offline run"
    assert any(runs[0].glob("*.wandb"))


def test_canary_disable_restarts_the_engines_without_speculation(tmp_path, monkeypatch):
    """acceptance_canary.action=disable: a drafter wiped by a bad refit (random weights, injected after
    step 4) trips the canary at step 5; the engines restart without a drafter, get the trainer's
    weights at once (and again in that step's refit), and step 6 samples from them on-policy, without speculation."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.grpo import loop as grpo

    real_step, seen = grpo.grpo_step, {}

    def wipe_the_drafter_after_step_4(run, step):
        row = real_step(run, step)
        if step == 3:
            sd = AutoModelForCausalLM.from_pretrained(
                run.cfg.policy.generation.vllm_kwargs["speculative_config"]["model"]
            ).state_dict()
            g = torch.Generator().manual_seed(0)
            run.generation.update_weights(
                {k: torch.randn(v.shape, generator=g) * v.float().std() for k, v in sd.items()}, target="drafter"
            )
        seen[step] = run.generation.config.vllm_kwargs.get("speculative_config")
        return row

    monkeypatch.setattr(grpo, "grpo_step", wipe_the_drafter_after_step_4)
    _train(
        tmp_path,
        "grpo.max_steps=6",
        "grpo.val_every=0",
        "checkpoint.enabled=false",
        "logger.wandb.enabled=false",
        "policy.generation.acceptance_canary.action=disable",
    )
    rows = _rows(tmp_path)
    assert [r.get("spec_decode/canary") for r in rows] == [0.0, 0.0, 0.0, 0.0, 1.0, None]
    assert seen[3] is not None and seen[4] is None and seen[5] is None, seen
    assert "spec_decode/num_drafts" not in rows[5] and rows[5]["generation/num_tokens"] > 0
    assert rows[5]["train/logprob_mismatch"] < MISMATCH_THRESHOLD, (
        "the restarted engines do not hold the trainer's weights"
    )


def test_dashboard_panels_are_all_in_a_real_run(uninterrupted):
    """Every panel of the dashboard has its keys in a real speculative run with drafter training (run-time k's
    buckets are absent: this run does not use speculation_control)."""
    from rl_specdec import dashboard

    keys = dashboard.run_keys(uninterrupted)
    for section, panels in dashboard.SECTIONS.items():
        for p in panels:
            wanted = [k for k in p.keys + p.optional if k != "timing/checkpoint" or "timing/checkpoint" in keys]
            assert all(k in keys for k in wanted), (section, p.title, [k for k in wanted if k not in keys])
            if p.families and "k_bucket" not in p.families[0]:
                assert dashboard.panel_keys(p, keys), (section, p.title)
    shown = {title for rows in dashboard.layout(keys).values() for title, _ in rows}
    everything = {p.title for panels in dashboard.SECTIONS.values() for p in panels}
    assert everything - shown == {"k per batch-size bucket"}
    if importlib.util.find_spec("wandb_workspaces") is None:
        return  # the workspace object needs the package (pyproject extra `dashboard`)
    import wandb_workspaces.workspaces as ws

    workspace = dashboard.build_workspace("entity", "project", keys)
    assert isinstance(workspace, ws.Workspace)
    assert [s.name for s in workspace.sections] == list(dashboard.layout(keys))
