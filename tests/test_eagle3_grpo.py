"""GRPO with an EAGLE-3 head trained online on the toy: real Ray, real vLLM, the head refit every step."""

import math
from pathlib import Path

import pytest
import torch
from test_grpo import MISMATCH_THRESHOLD, _rows, _train

pytestmark = pytest.mark.integration

S = "policy.generation.vllm_kwargs.speculative_config"
HEAD_ONLINE = [
    f"{S}.method=eagle3",
    f"{S}.model=toy:eagle3",
    "policy.generation.drafter_training.enabled=true",
    "policy.generation.speculation_control.mode=fixed",  # run-time k, with k=0 through vLLM's path
]


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3_online")
    _train(d, "grpo.max_steps=3", *HEAD_ONLINE)
    return d


def test_the_head_trains_every_step_and_drafts_losslessly(online):
    rows = _rows(online)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["drafter/version"] for r in rows] == [1, 2, 3]  # trained, refit (verified) and counted every step
    for r in rows:
        for k in ("drafter/loss", "drafter/agreement_1", "drafter/agreement_3", "timing/drafter_refit"):
            assert math.isfinite(r[k]), (r["step"], k)
        assert r["spec_decode/acceptance_length"] > 1.5, r  # the toy's head, trained at build, drafts well
        assert r["train/logprob_mismatch_max"] < MISMATCH_THRESHOLD  # what was sampled is what the policy scores
    settings = (Path(online) / "engine.yaml").read_text()
    assert "eagle3" in settings


def test_a_resumed_run_goes_on_with_the_trained_head(online, tmp_path):
    """The policy's checkpoint holds the head, its optimizer and its schedule: a run resumed from step 2 serves
    and trains the head of step 2, not the one built at the start."""
    import shutil

    from rl_specdec.heads.eagle3 import load_head
    from rl_specdec.toy.build import build_toy_models
    from rl_specdec.toy.heads import build_head

    d = tmp_path / "resumed"
    shutil.copytree(online, d, ignore=shutil.ignore_patterns("wandb"))
    shutil.rmtree(d / "checkpoints" / "step_000003")
    saved = load_head(d / "checkpoints" / "step_000002" / "policy" / "head").vllm_state_dict()
    built = load_head(build_head(build_toy_models(), log=lambda *_: None)).vllm_state_dict()
    assert not torch.equal(saved["fc.weight"], built["fc.weight"])  # it learned in steps 1-2
    _train(d, "grpo.max_steps=3", "resume=true", *HEAD_ONLINE, "logger.wandb.enabled=false")
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["drafter/version"] == 3, "the resumed head started over instead of continuing from step 2"
