"""What a stop by an engine's death saves, and why it is refused (pure logic; the real SIGKILLs are in
test_engine_restart.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_specdec.grpo.recovery import CANARY, REFIT, EngineRecovery, Updated


def _run(pipeline=None, finished=2, **restart):
    cfg = SimpleNamespace(**{"enabled": True, "max_restarts": 3, "max_per_hour": 3, **restart})
    drafter = SimpleNamespace(finished=[], after_refit=lambda gen, timer: drafter.finished.append(gen) or {})
    latest = SimpleNamespace(latest=lambda: ("ckpt/step_000002", {"step": 2}))
    return SimpleNamespace(
        cfg=SimpleNamespace(policy=SimpleNamespace(generation=SimpleNamespace(engine_restart=cfg))),
        checkpoints=latest,
        off_policy=pipeline is not None,
        finished=finished,
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
    run = _run()
    recovery, saved = _recovery(run)
    where = recovery._save_for_stop(REFIT.after(Updated(3, lambda: {"train/loss": 0.5})))
    assert saved == [(3, {"train/loss": 0.5, "faults/incomplete_step": 1.0}, False)]
    assert run.drafter.finished == [None]  # the drafter's step finished, not refit into the dead engines
    assert "step_000003" in where and "resume=true" in where


@pytest.mark.parametrize(
    ("updated", "pipeline"), [(None, None), (Updated(3, dict), object())], ids=["generating", "pipelined"]
)
def test_before_the_update_or_pipelined_the_stop_saves_nothing_new(updated, pipeline):
    run = _run(pipeline=pipeline)
    recovery, saved = _recovery(run)
    where = recovery._save_for_stop(CANARY if updated is None else REFIT.after(updated))
    assert all(step == 2 for step, _, _ in saved) and "step_000002" in where


# ---- the run's own restarts (run.max_restarts) -----------------------------------------------------


def _attempts(*outcomes):
    """An attempt that raises each outcome in turn (or returns it, when it is a dict); records its calls."""
    calls = []

    def attempt(cfg, restarts):
        calls.append((cfg.resume, restarts))
        out = outcomes[len(calls) - 1]
        if isinstance(out, BaseException):
            raise out
        return out

    return attempt, calls


def _cfg(max_restarts=2, max_per_hour=3):
    from rl_specdec.config import load_config

    return load_config(None, [f"run.max_restarts={max_restarts}", f"run.max_per_hour={max_per_hour}"])


def test_a_dead_process_restarts_the_run_resumed_within_its_bound(monkeypatch):
    from rl_specdec.errors import GenerationEngineDied, PolicyWorkerDied
    from rl_specdec.grpo import restarts
    from rl_specdec.rollout import placement

    monkeypatch.setattr(placement, "stop_ray", lambda: [])
    attempt, calls = _attempts(PolicyWorkerDied("rank 0 died"), GenerationEngineDied("engine 0 died"), {"ok": 1})
    assert restarts.train_restarting(_cfg(2), attempt) == {"ok": 1}
    assert calls == [(False, 0), (True, 1), (True, 2)]  # resumed from the newest checkpoint, counted

    attempt, calls = _attempts(PolicyWorkerDied("a"), PolicyWorkerDied("b"), PolicyWorkerDied("c"))
    with pytest.raises(PolicyWorkerDied, match="c"):  # past run.max_restarts: the last death ends the run
        restarts.train_restarting(_cfg(2), attempt)
    assert len(calls) == 3
    attempt, calls = _attempts(PolicyWorkerDied("a"), PolicyWorkerDied("b"))
    with pytest.raises(PolicyWorkerDied, match="b"):
        restarts.train_restarting(_cfg(5, max_per_hour=1), attempt)
    assert len(calls) == 2


@pytest.mark.parametrize("error", [ValueError("a bug"), KeyboardInterrupt()])
def test_other_errors_and_the_default_never_restart(monkeypatch, error):
    from rl_specdec.errors import PolicyWorkerDied
    from rl_specdec.grpo import restarts
    from rl_specdec.rollout import placement

    monkeypatch.setattr(placement, "stop_ray", lambda: [])
    attempt, calls = _attempts(error, {"ok": 1})
    with pytest.raises(type(error)):
        restarts.train_restarting(_cfg(2), attempt)
    attempt, calls = _attempts(PolicyWorkerDied("rank 0 died"), {"ok": 1})
    with pytest.raises(PolicyWorkerDied):  # run.max_restarts=0, the default
        restarts.train_restarting(_cfg(0), attempt)
    assert calls == [(False, 0)]


def test_run_restarts_need_checkpoints():
    from rl_specdec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"run.max_restarts=2 .*checkpoint.enabled=true"):
        load_config(None, ["run.max_restarts=2", "checkpoint.enabled=false"])
    with pytest.raises(ConfigError, match=r"run.max_restarts=-1 must be >= 0"):
        load_config(None, ["run.max_restarts=-1"])


def test_a_loss_carried_through_a_join_keeps_each_deaths_own_cause():
    """``EnginesLost.then``: a redo returns the caller's own result, and a second loss while redoing carries the
    second death's error (what the handler names) and the same finish."""
    from rl_specdec.errors import EnginesLost

    first, second = RuntimeError("engine 0 killed"), RuntimeError("engine 0 killed again")
    tries = iter([second, None])

    def redo():
        if (error := next(tries)) is not None:
            lost = EnginesLost("again", [0], redo)
            lost.__cause__ = error
            raise lost
        return ["a", "b"]

    lost = EnginesLost("lost", [0], redo)
    lost.__cause__ = first
    joined = lost.then("".join)
    assert joined.__cause__ is first and joined.engines == [0]
    with pytest.raises(EnginesLost) as again:
        joined.redo()
    assert again.value.__cause__ is second
    assert again.value.redo() == "ab"
