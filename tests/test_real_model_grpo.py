"""GRPO on the real model: configs/smollm2_spec.yaml, scaled down to one step, then resumed for a second.

The whole loop on a pretrained chat model with its own tokenizer: its chat template renders the prompts, ngram
drafts, the trainer's fp32 log-probs of the engine's tokens agree with the engine's, the weights are refit
and verified, the checkpoint holds the converted model, and a resumed run goes on from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_specdec.config import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_every=2",
    "grpo.val_num_prompts=8",
    "grpo.self_check_prompts=4",
    "policy.generation.max_new_tokens=24",
    # ngram at k=3 on every step, through vLLM's own path: the shipped schedule drafts only at 2-3 running requests
    # (its run-time k is tested on the toy, tests/test_spec_control.py). Sampling is seeded, and these k give both
    # steps a right sample among their 8, so that both train
    "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens=3",
    "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens_per_batch_size=null",
    "policy.generation.speculation_control.mode=off",
    "policy.generation.vllm_kwargs.kv_cache_memory_bytes=268435456",
    "checkpoint.every=1",
    "logger.progress_bar=false",
    "logger.wandb.enabled=false",
    # gains as well as losses: the untrained model gets 3-9% of these right at temperature 1, against 3-4% of
    # losses alone, so that a step's 8 samples hold a right one and the step has an advantage to train on
    "task.kwargs.operations=[gain,lose]",
]
MISMATCH_MAX = 1e-3  # fp32 engine against fp32 trainer: ~5e-5 at most on this model


def _train(log_dir: Path, *extra: str) -> None:
    from rl_specdec.grpo.loop import train

    cfg = load_config(ROOT / "configs/smollm2_spec.yaml", SMALL + [f"logger.log_dir={log_dir}", *extra])
    train(cfg, progress=False)


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, smollm2) -> Path:
    """Step 1 (validation before it), checkpointed; then ``resume=true`` goes on to step 2 (validated)."""
    d = tmp_path_factory.mktemp("smollm2")
    _train(d, "grpo.max_steps=1")
    assert [r["step"] for r in _rows(d)] == [0, 1]
    _train(d, "grpo.max_steps=2", "resume=true")
    return d


def test_two_steps_generate_train_refit_and_validate(two_steps):
    rows = _rows(two_steps)
    assert [r["step"] for r in rows] == [0, 1, 2], "a gap or a duplicate step in metrics.jsonl"
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2] and rows[0]["self_check/p_value"] > 0.001
    for r in rows[1:]:
        assert r["generation/num_tokens"] > 0 and r["spec_decode/num_drafts"] > 0
        assert 0 < r["train/logprob_mismatch_max"] < MISMATCH_MAX, r["train/logprob_mismatch_max"]
        assert r["timing/refit"] > 0 and abs(r["train/grad_norm"]) > 0
    model = two_steps / "checkpoints/step_000002/policy/model"
    assert (model / "tokenizer.json").exists() and "<|im_end|>" in (model / "tokenizer_config.json").read_text()


def test_the_resumed_run_went_on_from_the_checkpoint(two_steps):
    """Step 2 was trained by the resumed run from step 1's weights and AdamW state."""
    import torch
    from safetensors.torch import load_file

    ckpts = two_steps / "checkpoints"
    opt = torch.load(ckpts / "step_000002/policy/optimizer.pt", weights_only=False)["optimizer"]
    assert {int(s["step"]) for s in opt["state"].values()} == {2}  # a fresh AdamW would count 1 step
    w1, w2 = (load_file(str(next((ckpts / f"step_00000{s}/policy/model").glob("*.safetensors")))) for s in (1, 2))
    assert any((w1[k] - w2[k]).abs().max() > 0 for k in w1), "step 2 did not train"
