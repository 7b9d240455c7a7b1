"""The loop trains the tool-using agent task: ``configs/agent_spec.yaml``, every episode through vLLM's OpenAI
app on a real async engine in a Ray actor, with the real ``openai`` client, tool calls parsed by vLLM's hermes
parser, and the model's own tokens spliced into each next prompt (checked at every turn; a mismatch would stop
the run). One run of two steps, then a resume from its checkpoint with speculation off."""

from __future__ import annotations

import json
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
    "logger.progress_bar=false",
    "logger.wandb.enabled=false",
    "checkpoint.every=1",
    "policy.generation.vllm_kwargs.enforce_eager=true",
]
EPISODE_KEYS = [
    "episodes/turns_mean",
    "episodes/tool_call_rate",
    "episodes/model_token_share",
    "episodes/turn_1_response_length_mean",
    "episodes/called",
    "episodes/right_key",
    "generation/time_to_50pct_done",
    "generation/time_to_100pct_done",
]


def _train(config: str, log_dir: Path, *extra: str):
    from rl_specdec.grpo.loop import train

    cfg = load_config(ROOT / "configs" / config, SMALL + [f"logger.log_dir={log_dir}", *extra])
    return train(cfg, progress=False)


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_agent_episodes_train_through_the_server_with_speculation(tool_toy, tmp_path):
    _train("agent_spec.yaml", tmp_path, "grpo.max_steps=2")
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2] and rows[0]["self_check/p_value"] > 0
    for r in rows[1:]:
        missing = [k for k in EPISODE_KEYS if k not in r]
        assert not missing, missing
        # the tool toy calls the tool in about half of its episodes, and those episodes have a second turn
        assert r["episodes/tool_call_rate"] > 0.1
        assert r["episodes/turns_mean"] == pytest.approx(1.0 + r["episodes/tool_call_rate"])
        assert r["episodes/turn_2_response_length_mean"] > 0
        assert 0.2 < r["episodes/model_token_share"] < 0.9  # the prompt and the tool result are not the model's
        # every model token's log-prob, as the trainer computes it on the spliced episode, is the engine's
        assert r["train/logprob_mismatch_max"] < 1e-3
        assert r["spec_decode/num_drafts"] > 0 and r["spec_decode/acceptance_length"] >= 1.0  # every turn counts


def test_an_agent_run_resumes_with_the_batches_it_would_have_seen(tool_toy, tmp_path):
    """Speculation off: plain sampling with per-request seeds is bit-reproducible, so the resumed step's episodes
    are the uninterrupted run's (test_stops.py's reasoning)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    _train("agent_base.yaml", full, "grpo.max_steps=2", "grpo.val_every=0", "grpo.self_check_prompts=0")
    _train("agent_base.yaml", cut, "grpo.max_steps=1", "grpo.val_every=0", "grpo.self_check_prompts=0")
    _train("agent_base.yaml", cut, "grpo.max_steps=2", "grpo.val_every=0", "grpo.self_check_prompts=0", "resume=true")
    a, b = _rows(full), _rows(cut)
    assert [r["step"] for r in b] == [1, 2], "a gap or a duplicate step in metrics.jsonl"
    for x, y in zip(a, b):
        for key in ("generation/num_tokens", "train/reward_mean", "episodes/turns_mean", "episodes/right_key"):
            assert y[key] == x[key], (x["step"], key)
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-3, abs=1e-6)
