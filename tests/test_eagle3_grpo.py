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
    "policy.generation.speculation_control.mode=fixed",  # run-time k, its k=0 steps plain
]


@pytest.fixture(scope="module")
def online(tmp_path_factory, toy_head):  # the run builds toy:eagle3 unless the session did
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


def test_a_resumed_run_serves_and_goes_on_with_the_trained_head(online, tmp_path, monkeypatch, task_prompts, toy_head):
    """The policy's checkpoint holds the head, its optimizer and its schedule: a run resumed from step 2 drafts
    with the head of step 2 from its first rollout, and trains it on, not the one built at the start.

    What the engines draft with is read from the engines: their first drafts (the head's argmax given the true
    prefix) once the resumed run is set up, against the same engines after the checkpoint's head is sent by
    hand, and after the head built at the start is (the control: a different head drafts differently here)."""
    import shutil

    from engine_debug import DebugVllmGeneration, first_drafts
    from rl_specdec.grpo import loop
    from rl_specdec.heads.eagle3 import load_head
    from rl_specdec.rollout import group

    d = tmp_path / "resumed"
    shutil.copytree(online, d, ignore=shutil.ignore_patterns("wandb"))
    shutil.rmtree(d / "checkpoints" / "step_000003")
    saved = load_head(d / "checkpoints" / "step_000002" / "policy" / "head").vllm_state_dict()
    built = load_head(toy_head).vllm_state_dict()
    assert not torch.equal(saved["fc.weight"], built["fc.weight"])  # it learned in steps 1-2

    drafts = {}
    real_setup = loop.setup

    def setup_and_read_drafts(cfg):
        run = real_setup(cfg)
        g = run.generation
        drafts["resumed"] = first_drafts(g, task_prompts, 3)[1]
        for name, sd in (("built", built), ("saved", saved)):  # ends with the checkpoint's head back in place
            g.update_weights(sd, target="drafter")
            drafts[name] = first_drafts(g, task_prompts, 3)[1]
        return run

    import ray

    from shared_ray import ensure_local_ray

    # the debug RPC that records drafts, in workers that can import it (a Ray already started is joined)
    ray.shutdown()
    ensure_local_ray()
    monkeypatch.setattr(group, "VllmGeneration", DebugVllmGeneration)
    monkeypatch.setattr(loop, "setup", setup_and_read_drafts)
    _train(d, "grpo.max_steps=3", "resume=true", *HEAD_ONLINE, "logger.wandb.enabled=false")
    assert sum(len(v) for v in drafts["resumed"].values()) > 50, drafts["resumed"]
    assert drafts["resumed"] == drafts["saved"], "the resumed engines do not draft with the checkpoint's head"
    assert drafts["built"] != drafts["saved"]
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["drafter/version"] == 3, "the resumed head started over instead of continuing from step 2"
