"""One-step off-policy GRPO (``grpo.max_staleness=1``) end to end: real Ray, real vLLM engines, the toy.

Speculation is off where runs are compared sample for sample (plain sampling with per-request seeds is
bit-reproducible; see test_grpo.py's engine-death test), and the trainer is fp32, so the engine's log-probs
equal the trainer's to fp32 rounding and tell which weights generated a sample.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from rl_specdec.config import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "grpo.max_steps=4",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_every=2",
    "grpo.val_num_prompts=8",
    "grpo.self_check_prompts=0",
    "grpo.max_staleness=1",
    "policy.generation.max_new_tokens=28",
    "policy.generation.vllm_kwargs.enforce_eager=true",
    "policy.generation.vllm_kwargs.speculative_config=null",
    "policy.generation.speculation_control.mode=off",  # where a test sets speculation back: vLLM's fixed k
    "policy.precision=fp32",
    "logger.progress_bar=false",
    "logger.wandb.enabled=false",
    "checkpoint.every=1",
    "checkpoint.keep=4",
]


def _train(log_dir: Path, *extra: str):
    from rl_specdec.grpo.loop import train

    return train(load_config(ROOT / "configs/grpo_spec.yaml", RUN + [f"logger.log_dir={log_dir}", *extra]))


def _rows(log_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def _state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pipelined")
    _train(d)
    return d


def _gap(model_dir: Path, ro) -> float:
    """The largest |log p - the engine's log-prob| over the rollouts' tokens, under the weights in ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for prompt, ids, lps in zip(ro.prompt_ids, ro.out.token_ids, ro.out.logprobs):
            seq = torch.tensor([prompt + ids])
            logp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1)  # position t predicts token t+1
            mine = logp[len(prompt) - 1 :].gather(-1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
            worst = max(worst, (mine - torch.tensor(lps)).abs().max().item())
    return worst


def test_step_t_plus_1_trains_on_rollouts_of_version_t(pipelined):
    """Rows: staleness 0 at step 1, then 1; the overlap is logged. Checkpoint s carries step s+1's rollouts,
    stamped version s-1, and their log-probs are those of checkpoint s-1's weights, not of checkpoint s's."""
    from rl_specdec.grpo.rollouts import load_rollouts

    rows = _rows(pipelined)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["train/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["train/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(0.0 <= r["timing/overlap"] <= 1.0 for r in rows)
    assert all(r["timing/generation_wait"] >= 0.0 for r in rows[:-1]) and "timing/generation_wait" not in rows[-1]
    assert rows[-1]["timing/overlap"] == 0.0  # the last step starts no generation
    assert rows[0]["train/logprob_mismatch"] < 1e-3  # step 1 trains on-policy
    assert "val/accuracy" in rows[1] and "val/accuracy" in rows[3]
    ckpts = pipelined / "checkpoints"
    for s in (1, 2, 3):
        ro = load_rollouts(ckpts / f"step_{s:06d}")
        assert ro.step == s and ro.versions == [s - 1] * 16, (s, ro.step, set(ro.versions))
        assert _state(ckpts / f"step_{s:06d}")["pipeline"] == {
            "max_staleness": 1,
            "rollouts": "rollouts.json",
            "dropped": False,
        }
    assert load_rollouts(ckpts / "step_000004") is None  # the last step starts no generation
    ro = load_rollouts(ckpts / "step_000002")  # generated with W_1 while step 2 (W_1 -> W_2) trained
    generated_by = _gap(ckpts / "step_000001/policy/model", ro)
    not_by = _gap(ckpts / "step_000002/policy/model", ro)
    assert generated_by < 1e-4 and not_by > 10 * generated_by, (generated_by, not_by)


def test_an_engine_death_then_sigterm_mid_pipeline_each_keep_the_rollouts_and_the_run_resumes_exactly(
    pipelined, tmp_path, monkeypatch
):
    """Two stops of one run, each resumed from what it saved, ending as the uninterrupted run ends.

    An engine dies while step 3's successor is in flight: the run stops with checkpoint 2, which carries step 3's
    rollouts. The printed resume, a real run_grpo.py process, takes SIGTERM while it trains step 3 on them, with
    step 4's rollouts generating beside it: step 3 finishes and is checkpointed with those rollouts (exit 143,
    nothing left running). The last resume trains on them, and every row and the final weights are the
    uninterrupted run's."""
    from safetensors.torch import load_file
    from test_stops import Run, paused, stop_line

    from rl_specdec.errors import GenerationEngineDied
    from rl_specdec.grpo.checkpoint import verify
    from rl_specdec.grpo.pipeline import PipelinedSteps
    from rl_specdec.grpo.rollouts import load_rollouts

    real_take = PipelinedSteps.take

    def kill_engine_at_step_3(self, step):
        if step == 2:  # 0-based: the third step; its rollouts come from checkpoint 2, its successor's never finish
            os.kill(self.run.generation.placements[0]["pid"], signal.SIGKILL)
        return real_take(self, step)

    monkeypatch.setattr(PipelinedSteps, "take", kill_engine_at_step_3)
    with pytest.raises(GenerationEngineDied, match="max_staleness=1"):  # a replacement would mix two versions
        _train(tmp_path)
    monkeypatch.setattr(PipelinedSteps, "take", real_take)
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    ro = load_rollouts(tmp_path / "checkpoints/step_000002")
    assert ro is not None and ro.step == 2 and set(ro.versions) == {1}

    hooked = [sys.executable, str(ROOT / "tests/run_grpo_hooked.py"), "--config", "configs/grpo_spec.yaml"]
    run = Run([*hooked, *RUN, f"logger.log_dir={tmp_path}", "resume=true"], {"RL_SPECDEC_TEST_PAUSE": "train:1:4"})
    try:
        run.wait_for(paused(tmp_path))
        run.signal(signal.SIGTERM)
        assert run.finish() == 143, run.output
        assert run.leftovers() == []
    finally:
        run.kill()  # what is left when the test failed while it ran
    line = stop_line(run, "stopped by SIGTERM")
    ckpt = tmp_path / "checkpoints/step_000003"
    assert line.startswith(f"stopped by SIGTERM after step 3: checkpoint {ckpt}; resume with: "), line
    assert verify(ckpt) is None and _state(ckpt)["pipeline"]["dropped"] is False
    ro = load_rollouts(ckpt)  # step 4's, generated with W_2 while step 3 trained
    assert ro is not None and ro.step == 3 and set(ro.versions) == {2}
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]

    _train(tmp_path, "resume=true")
    a, b = _rows(pipelined), _rows(tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4], "a gap or a duplicate step in metrics.jsonl"
    for x, y in zip(a, b):
        assert y["generation/num_tokens"] == x["generation/num_tokens"], x["step"]
        assert y["train/reward_mean"] == pytest.approx(x["train/reward_mean"], abs=1e-6)
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-3, abs=1e-6)
        assert y["train/staleness"] == x["train/staleness"]
    wa, wb = (
        load_file(str(next((d / "checkpoints/step_000004/policy/model").glob("*.safetensors"))))
        for d in (pipelined, tmp_path)
    )
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_the_drafter_trains_on_the_same_schedule(tmp_path):
    """Speculation and online drafter training, one step off-policy: the drafter trains on every step's
    rollouts (their top-k log-probs come with them) and is refit between generations; spec_decode/* is there."""
    _train(
        tmp_path,
        "grpo.max_steps=3",
        "grpo.val_every=0",
        "checkpoint.enabled=false",
        "policy.generation.vllm_kwargs.speculative_config={method: draft_model, model: toy:drafter, "
        "num_speculative_tokens: 3, draft_sample_method: probabilistic}",
        "policy.generation.drafter_training.enabled=true",
    )
    rows = _rows(tmp_path)
    assert [r["drafter/version"] for r in rows] == [1, 2, 3]
    assert [r["train/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["spec_decode/num_drafts"] > 0 and 1.0 <= r["spec_decode/acceptance_length"] <= 4 for r in rows)
