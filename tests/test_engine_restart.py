"""An engine whose process is killed mid-run: checkpointed first, replaced, and the run goes on.

Real Ray actors and vLLM engines; the engine's process is sent SIGKILL while it generates a step's rollouts,
as the kernel's OOM killer would. Speculation is off in the runs whose results are compared bit for bit: vLLM
draws the drafter's probabilistic proposals from the engine's global RNG, not the per-request seeds, so with
speculation on a new engine samples the same distribution but not the same bits. Plain sampling with
per-request seeds is bit-reproducible, which makes "the run an uninterrupted one would have been" exact.
"""

import json
import os
import signal
from pathlib import Path

import psutil
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
    "logger.wandb.enabled=false",
    "checkpoint.every=3",  # step 2 is not due: an engine's death at step 3 must save it first
    "policy.generation.vllm_kwargs.enforce_eager=true",
    "policy.precision=fp32",
    "policy.generation.speculation_control.mode=off",
    "grpo.max_steps=4",
]
OFF = "policy.generation.vllm_kwargs.speculative_config=null"


def _rows(log_dir):
    rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def _train(log_dir, *extra):
    from rl_specdec.grpo.loop import train

    cfg = load_config(ROOT / "configs/grpo_spec.yaml", SMALL + [f"logger.log_dir={log_dir}", *extra])
    return train(cfg, progress=False)


def _weights(log_dir, step=4):
    from safetensors.torch import load_file

    return load_file(str(next((Path(log_dir) / f"checkpoints/step_{step:06d}/policy/model").glob("*.safetensors"))))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """An uninterrupted run without speculation: the reference."""
    d = tmp_path_factory.mktemp("plain")
    _train(d, OFF, "checkpoint.every=2")
    return d


class KillMidGeneration:
    """SIGKILL engine ``engine``'s process while it generates step ``at``'s rollouts (0-based), once.

    It wraps the group's ``submit``: the shards are sent, then the process is killed at once, so the engine dies
    with the call in flight (a toy step generates in a fraction of a second: a later kill would land in the
    train phase). It records every engine process it saw, old and new.
    """

    def __init__(self, monkeypatch, at: int, engine: int = 0):
        from rl_specdec.grpo import loop
        from rl_specdec.rollout.group import VllmGeneration

        self.at, self.engine, self.armed, self.killed = at, engine, False, None
        self.pids: set[int] = set()
        real_step, real_submit = loop.grpo_step, VllmGeneration.submit

        def step(run, i):
            self.armed = i == self.at and self.killed is None
            return real_step(run, i)

        def submit(group, prompts, sampling):
            self.pids.update(p["pid"] for p in group.placements)
            pending = real_submit(group, prompts, sampling)
            if self.armed:
                self.armed, self.killed = False, group.placements[self.engine]["pid"]
                os.kill(self.killed, signal.SIGKILL)
            return pending

        monkeypatch.setattr(loop, "grpo_step", step)
        monkeypatch.setattr(VllmGeneration, "submit", submit)


def _gone(pids, wait_s: float = 15.0):
    """The processes among ``pids`` still alive ``wait_s`` after the run (a killed actor exits asynchronously)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


class Chaos:
    """SIGKILLs on a schedule of (step index, process, phase), each once, across the run's restarts: an engine
    while it generates (``engine``), the policy worker as its train step starts (``policy``). Records every
    engine and policy worker process it saw."""

    def __init__(self, monkeypatch, schedule: list[tuple[int, str]]):
        from rl_specdec.grpo import loop
        from rl_specdec.policy.group import PolicyGroup
        from rl_specdec.rollout.group import VllmGeneration

        self.todo, self.step, self.done = list(schedule), -1, []
        self.pids: set[int] = set()
        real_step, real_submit, real_train = loop.grpo_step, VllmGeneration.submit, PolicyGroup.train_step

        def due(kind):
            if (self.step, kind) in self.todo:
                self.todo.remove((self.step, kind))
                self.done.append((self.step, kind))
                return True
            return False

        def step(run, i):
            self.step = i
            return real_step(run, i)

        def submit(group, prompts, sampling):
            self.pids.update(p["pid"] for p in group.placements)
            pending = real_submit(group, prompts, sampling)
            if due("engine"):
                os.kill(group.placements[0]["pid"], signal.SIGKILL)
            return pending

        def train_step(group, batch, loss_fn):
            self.pids.update(n["pid"] for n in group.nodes)
            if due("policy"):
                os.kill(group.nodes[0]["pid"], signal.SIGKILL)
                psutil.wait_procs([psutil.Process(group.nodes[0]["pid"])], timeout=10)
            return real_train(group, batch, loss_fn)

        monkeypatch.setattr(loop, "grpo_step", step)
        monkeypatch.setattr(VllmGeneration, "submit", submit)
        monkeypatch.setattr(PolicyGroup, "train_step", train_step)


def test_processes_killed_through_a_run_that_restarts_itself_and_it_ends_as_an_uninterrupted_one(
    plain, tmp_path, monkeypatch
):
    """The default config, speculation off, one engine replacement allowed and two run restarts: the engine is
    killed generating step 1 (replaced) and again generating step 2 (past the bound: the run restarts from step
    1, saved first), then the policy worker at step 3's update (the run restarts from step 2's checkpoint).
    The run finishes with contiguous steps, the uninterrupted run's rollouts, held-out accuracy and weights,
    and no process left."""
    chaos = Chaos(monkeypatch, [(0, "engine"), (1, "engine"), (2, "policy")])
    last = _train(
        tmp_path, OFF, "checkpoint.every=2", "policy.generation.engine_restart.max_restarts=1", "run.max_restarts=2"
    )
    assert chaos.done == [(0, "engine"), (1, "engine"), (2, "policy")]
    rows, ref = _rows(tmp_path), _rows(plain)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["faults/run_restarts"] for r in rows] == [0, 1, 2, 2] and last["faults/run_restarts"] == 2
    assert rows[0]["faults/engine_restarts"] == 1 and rows[0]["faults/time_lost_s"] > 0
    for a, b in zip(ref, rows):  # every step's rollouts, generated again from the same seeds, are the same
        assert b["generation/num_tokens"] == a["generation/num_tokens"], a["step"]
        assert b["train/reward_mean"] == pytest.approx(a["train/reward_mean"], abs=1e-6)
        assert b["train/logprob_mismatch_max"] < 1e-3  # the new engines hold the trainer's weights
    assert rows[3]["val/accuracy"] == ref[3]["val/accuracy"]
    wa, wb = _weights(plain), _weights(tmp_path)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    assert len(chaos.pids) >= 5 and not _gone(chaos.pids), "a process of the run outlived it"


def test_one_of_two_engines_dies_and_the_other_keeps_its_share(tmp_path, monkeypatch):
    """Two engines, one core each; engine 1 is killed: only it is replaced, and the run finishes with speculation."""
    from rl_specdec.rollout.group import VllmGeneration

    regenerated = []
    real_gather = VllmGeneration._gather

    def gather(group, refs, resubmit):
        def counted(j):
            regenerated.append((j, group.placements[0]["pid"]))
            return resubmit(j)

        return real_gather(group, refs, counted)

    monkeypatch.setattr(VllmGeneration, "_gather", gather)
    kill = KillMidGeneration(monkeypatch, at=1, engine=1)
    two = ["policy.generation.num_engines=2", "policy.generation.cpus_per_engine=1", "policy.cpus_per_worker=0"]
    _train(tmp_path, *two)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["faults/engine_restarts"] == 1
    assert [j for j, _ in regenerated] == [1], "only the dead engine's shard is generated again"
    survivor = regenerated[0][1]
    assert survivor != kill.killed and survivor in kill.pids  # engine 0 is the same process throughout
    assert rows[1]["spec_decode/num_drafts"] > 0 and rows[-1]["spec_decode/num_drafts"] > 0
    assert len(kill.pids) == 3 and not _gone(kill.pids)


def test_past_the_bound_a_death_at_refit_saves_the_updated_step_and_resume_loses_nothing(plain, tmp_path, monkeypatch):
    """max_restarts=0 and the engine killed in step 3's refit phase, after the policy's update: the run stops,
    and step 3 (updated, not refit, not validated, not due for a checkpoint) is saved first, marked incomplete;
    resume=true refits it into new engines and ends with the uninterrupted run's weights."""
    from rl_specdec.errors import GenerationEngineDied
    from rl_specdec.grpo import loop
    from rl_specdec.rollout.group import VllmGeneration

    real_step, real_refit, at = loop.grpo_step, VllmGeneration.update_weights_buckets, {"step": -1}
    pids: set[int] = set()

    def step(run, i):
        at["step"] = i
        return real_step(run, i)

    def refit(group, buckets, target="policy"):
        pids.update(p["pid"] for p in group.placements)
        if at["step"] == 2:
            os.kill(group.placements[0]["pid"], signal.SIGKILL)
            psutil.wait_procs([psutil.Process(group.placements[0]["pid"])], timeout=10)
        return real_refit(group, buckets, target)

    monkeypatch.setattr(loop, "grpo_step", step)
    monkeypatch.setattr(VllmGeneration, "update_weights_buckets", refit)
    with pytest.raises(GenerationEngineDied) as e:
        _train(tmp_path, OFF, "policy.generation.engine_restart.max_restarts=0")
    assert "max_restarts=0" in str(e.value) and "step_000003" in str(e.value) and "resume=true" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003"]
    state = json.loads((tmp_path / "checkpoints/step_000003/trainer_state.json").read_text())
    assert state["complete"] is False and state["metrics"]["faults/incomplete_step"] == 1.0
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    assert not _gone(pids)

    monkeypatch.undo()
    _train(tmp_path, OFF, "resume=true")
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["faults/incomplete_step"] == 1.0
    assert rows[3]["train/logprob_mismatch_max"] < 1e-3  # the new engines hold step 3's update
    wa, wb = _weights(plain), _weights(tmp_path)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_a_replacement_that_cannot_start_stops_the_run_with_the_step_saved(tmp_path, monkeypatch):
    """The new engine's model folder is gone (a real failed start in the new actor): the run stops with the
    reason, the last finished step is checkpointed, and no engine process is left."""
    from rl_specdec.errors import GenerationEngineDied
    from rl_specdec.grpo import loop

    kill = KillMidGeneration(monkeypatch, at=2)
    real_step = loop.grpo_step

    def step(run, i):
        if i == 2:
            run.generation.model = str(tmp_path / "no-such-model")
        return real_step(run, i)

    monkeypatch.setattr(loop, "grpo_step", step)
    with pytest.raises(GenerationEngineDied) as e:
        _train(tmp_path, OFF)
    assert "did not start" in str(e.value) and "step_000002" in str(e.value), str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    assert not _gone(kill.pids)
