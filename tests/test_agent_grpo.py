"""The loop trains the tool-using agent task: ``configs/agent_spec.yaml``, every episode through vLLM's OpenAI
app on a real async engine in a Ray actor, with the real ``openai`` client, tool calls parsed by vLLM's hermes
parser, and the model's own tokens spliced into each next prompt (checked at every turn; a mismatch would stop
the run). One run of two steps, one step off-policy; then, with speculation off, a run stopped by SIGTERM
mid-episode, resumed from its checkpoint with an engine lost mid-episode, against an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
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


def test_agent_episodes_train_through_the_server_with_speculation_one_step_off_policy(tool_toy, tmp_path):
    """Step 2's episodes play while step 1 trains (``grpo.max_staleness=1``), and checkpoint 1 carries them; the
    draft model distils on every model turn's top-k log-probs the servers returned, and each of its refits into
    the async engine is verified."""
    from rl_specdec.grpo.rollouts import load_rollouts
    from rl_specdec.rollout.serving.episodes import EpisodeOutput

    online = "policy.generation.drafter_training.enabled=true"
    _train("agent_spec.yaml", tmp_path, "grpo.max_steps=2", "grpo.max_staleness=1", online)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["train/staleness"] for r in rows[1:]] == [0.0, 1.0]
    # every model token's log-prob, as the trainer computes it on the spliced episode, is the engine's (step 1
    # trains on-policy; step 2 on episodes of the weights before it)
    assert rows[1]["train/logprob_mismatch_max"] < 1e-3
    carried = load_rollouts(tmp_path / "checkpoints/step_000001")
    assert isinstance(carried.out, EpisodeOutput) and carried.step == 1 and set(carried.versions) == {0}
    assert len(carried.out.episodes) == 16 and all(x.turns for x in carried.out.episodes)
    assert all(len(t.top_logprobs) == len(t.ids) for x in carried.out.episodes for t in x.turns)
    assert [r["drafter/version"] for r in rows[1:]] == [1.0, 2.0]
    assert (tmp_path / "checkpoints/step_000002/drafter").is_dir()
    assert all(r["drafter/loss"] > 0 and r["drafter/kl"] >= 0 for r in rows[1:])
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2] and rows[0]["self_check/p_value"] > 0
    for r in rows[1:]:
        missing = [k for k in EPISODE_KEYS if k not in r]
        assert not missing, missing
        # the tool toy calls the tool in about half of its episodes, and those episodes have a second turn
        assert r["episodes/tool_call_rate"] > 0.1
        assert r["episodes/turns_mean"] == pytest.approx(1.0 + r["episodes/tool_call_rate"])
        assert r["episodes/turn_2_response_length_mean"] > 0
        assert 0.2 < r["episodes/model_token_share"] < 0.9  # the prompt and the tool result are not the model's
        assert r["spec_decode/num_drafts"] > 0 and r["spec_decode/acceptance_length"] >= 1.0  # every turn counts
        # each turn's acceptance, from the servers' per-request counters: together they are the step's
        per_turn = [r[f"spec_decode/turn_{i}_num_drafts"] for i in (1, 2) if f"spec_decode/turn_{i}_num_drafts" in r]
        assert len(per_turn) == 2 and sum(per_turn) == r["spec_decode/num_drafts"], (per_turn, r)
        assert all(1.0 <= r[f"spec_decode/turn_{i}_acceptance_length"] <= 4.0 for i in (1, 2))


class KillMidEpisodes:
    """SIGKILL engine ``engine``'s process once, ``after_s`` into step index ``at``'s episodes (0-based), with
    them in flight; records which episodes each round played and every engine process seen."""

    def __init__(self, monkeypatch, at: int, engine: int = 0, after_s: float = 0.3):
        from rl_specdec.grpo import episodes, loop

        self.rounds: list[list[int]] = []
        self.pids: set[int] = set()
        self.killed = None
        real_step, real_episodes = loop.grpo_step, episodes.EpisodeSource._episodes
        armed = [False]

        def step(run, i):
            armed[0] = i == at and self.killed is None
            return real_step(run, i)

        async def plays(source, todo, sampling, t0):
            placements = source.run.generation.placements
            self.pids.update(p["pid"] for p in placements)
            if armed[0]:
                armed[0], self.killed = False, placements[engine]["pid"]
                threading.Timer(after_s, os.kill, (self.killed, signal.SIGKILL)).start()
            self.rounds.append(sorted(todo))
            return await real_episodes(source, todo, sampling, t0)

        monkeypatch.setattr(loop, "grpo_step", step)
        monkeypatch.setattr(episodes.EpisodeSource, "_episodes", plays)


def sigterm_in_episodes(log_dir: Path, *extra: str) -> None:
    """A real run_grpo.py process, sent SIGTERM while step 2's episodes are in flight: the step is dropped at
    once, step 1 is checkpointed, exit 143, and nothing it started is left running."""
    from test_stops import NATIVE_DUMP, Run, paused, stop_line

    from rl_specdec.grpo.checkpoint import verify

    hooked = [sys.executable, str(ROOT / "tests/run_grpo_hooked.py"), "--config", "configs/agent_base.yaml"]
    args = [*hooked, *SMALL, "grpo.max_steps=2", f"logger.log_dir={log_dir}", *extra]
    run = Run(args, {"RL_SPECDEC_TEST_PAUSE": "episodes:2:60"})
    try:
        run.wait_for(paused(log_dir))
        t0 = time.monotonic()
        run.signal(signal.SIGTERM)
        assert run.finish() == 143, run.output
        assert time.monotonic() - t0 < 50, "the stop waited for the episodes it drops"
        assert run.leftovers() == []
    finally:
        run.kill()  # what is left when the test failed while it ran
    assert "dropping the step in progress" in run.output and not any(s in run.output for s in NATIVE_DUMP)
    ckpt = log_dir / "checkpoints/step_000001"
    assert stop_line(run, "stopped by SIGTERM").startswith(f"stopped by SIGTERM after step 1: checkpoint {ckpt}")
    assert verify(ckpt) is None and [r["step"] for r in _rows(log_dir)] == [1]


def test_an_agent_run_resumes_and_replays_a_dead_engines_episodes_as_the_uninterrupted_run(
    tool_toy, tmp_path, monkeypatch
):
    """Speculation off: plain sampling with per-request seeds is bit-reproducible, so the resumed step's episodes
    are the uninterrupted run's (test_stops.py's reasoning), and so are the episodes a replacement engine plays
    again. The first run is stopped by SIGTERM in step 2's episodes; the resumed run's engine is killed with
    step 2's episodes in flight. (Which episodes a death
    replays when other engines survive is tests/test_episodes.py's.)"""
    quiet = ["grpo.val_every=0", "grpo.self_check_prompts=0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    _train("agent_base.yaml", full, "grpo.max_steps=2", *quiet)
    sigterm_in_episodes(cut, *quiet)
    kill = KillMidEpisodes(monkeypatch, at=1)
    _train("agent_base.yaml", cut, "grpo.max_steps=2", "resume=true", *quiet)
    a, b = _rows(full), _rows(cut)
    assert [r["step"] for r in b] == [1, 2], "a gap or a duplicate step in metrics.jsonl"
    for x, y in zip(a, b):
        for key in ("generation/num_tokens", "train/reward_mean", "episodes/turns_mean", "episodes/right_key"):
            assert y[key] == x[key], (x["step"], key)
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-3, abs=1e-6)
    assert b[-1]["faults/engine_restarts"] == 1 and kill.killed is not None
    n = 4 * 4  # episodes a step: grpo.num_prompts_per_step x num_generations_per_prompt
    assert kill.rounds == [list(range(n)), list(range(n))], "every episode of the dead engine, once more"
    assert len(kill.pids) == 2  # the engine and its replacement
