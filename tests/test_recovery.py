"""What a stop by an engine's death saves, and why it is refused (pure logic; the real SIGKILLs are in
test_engine_restart.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_specdec.grpo.recovery import EngineRecovery
from rl_specdec.grpo.step import Updated


def _run(updated=None, pipeline=None, finished=2, **restart):
    cfg = SimpleNamespace(**{"enabled": True, "max_restarts": 3, "max_per_hour": 3, **restart})
    drafter = SimpleNamespace(finished=[], after_refit=lambda gen, timer: drafter.finished.append(gen) or {})
    latest = SimpleNamespace(latest=lambda: ("ckpt/step_000002", {"step": 2}))
    return SimpleNamespace(
        cfg=SimpleNamespace(policy=SimpleNamespace(generation=SimpleNamespace(engine_restart=cfg))),
        checkpoints=latest,
        pipeline=pipeline,
        updated=updated,
        finished=finished,
        step_in_progress=True,
        last_row={},
        drafter=drafter,
        timer=None,
        stop=SimpleNamespace(resume_hint=lambda: "resume with resume=true"),
    )


def _recovery(run):
    saved = []

    def checkpoint(run, step, row, complete=True):
        saved.append((step, row, complete))
        return f"ckpt/step_{step:06d}"

    return EngineRecovery(run, checkpoint), saved


@pytest.mark.parametrize(
    ("restart", "pipeline", "words"),
    [
        ({"enabled": False}, None, "engine_restart.enabled=false"),
        ({"max_restarts": 0}, None, "max_restarts=0"),
        ({"max_per_hour": 0}, None, "max_per_hour=0"),
        ({}, object(), "max_staleness=1"),
    ],
)
def test_a_refused_replacement_names_its_setting(restart, pipeline, words):
    recovery, _ = _recovery(_run(pipeline=pipeline, **restart))
    assert words in recovery._refused()


def test_after_the_update_the_stop_saves_the_updated_step_marked_incomplete():
    run = _run(updated=Updated(3, lambda: {"train/loss": 0.5}))
    recovery, saved = _recovery(run)
    where = recovery._save_for_stop()
    assert saved == [(3, {"train/loss": 0.5, "faults/incomplete_step": 1.0}, False)]
    assert run.drafter.finished == [None]  # the drafter's step finished, not refit into the dead engines
    assert "step_000003" in where and "resume=true" in where


@pytest.mark.parametrize(
    ("updated", "pipeline"), [(None, None), (Updated(3, dict), object())], ids=["generating", "pipelined"]
)
def test_before_the_update_or_pipelined_the_stop_saves_nothing_new(updated, pipeline):
    run = _run(updated=updated, pipeline=pipeline)
    recovery, saved = _recovery(run)
    where = recovery._save_for_stop()
    assert all(step == 2 for step, _, _ in saved) and "step_000002" in where
