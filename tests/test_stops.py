"""Stops that lose nothing, each on a real process with real signals: SIGTERM, Ctrl-C, a second signal, the
grace period running out, a full disk, and a vLLM of another version (integration); and the stop's handlers and
lines in this process (fast).

Runs are ``examples/run_grpo.py`` in their own session (``tests/run_grpo_hooked.py`` holds a run inside a
phase, or fails a checkpoint write, when a test asks). Every process a run starts is recorded while it runs
(its descendants, polled), and none may be alive 10 s after it exits. Speculation is off where a resumed run
is compared with an uninterrupted one: plain sampling with per-request seeds is bit-reproducible (see
test_grpo.py's engine-death test).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOKED = ROOT / "tests/run_grpo_hooked.py"
RUN = [
    "--config",
    "configs/grpo_spec.yaml",
    "grpo.max_steps=5",
    "checkpoint.every=4",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_every=0",
    "grpo.self_check_prompts=0",
    "policy.generation.max_new_tokens=28",
    "policy.generation.vllm_kwargs.enforce_eager=true",
    "policy.generation.vllm_kwargs.speculative_config=null",
    "logger.progress_bar=false",
]
NO_WANDB = "logger.wandb.enabled=false"
NATIVE_DUMP = ("SIGTERM received", "PC: @", "Traceback")


class Run:
    """A command in its own session (as a job a scheduler or a shell starts), its descendants recorded."""

    started: list[Run] = []

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        Run.started.append(self)
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.seen: set[psutil.Process] = set()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._record, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _record(self) -> None:
        me = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                self.seen.update(me.children(recursive=True))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    def wait_for(self, cond, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        while not cond():
            assert self.proc.poll() is None, "the run ended early:\n" + self.output
            assert time.monotonic() < end, "timed out waiting:\n" + self.output
            time.sleep(0.1)

    def signal(self, signum: int, group: bool = False) -> None:
        """``group``: to the whole process group, as Ctrl-C in a terminal sends it."""
        self.seen.update(psutil.Process(self.proc.pid).children(recursive=True))
        (os.killpg if group else os.kill)(self.proc.pid, signum)

    def finish(self, timeout: float = 300.0) -> int:
        code = self.proc.wait(timeout)
        self.exited = time.monotonic()
        time.sleep(0.5)  # the reader thread takes the last lines
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def leftovers(self, within_s: float = 10.0) -> list[str]:
        """What the run started that is still alive ``within_s`` seconds after it exited (zombies are dead)."""
        assert self.seen, "no process of the run was recorded"
        while (alive := self._alive()) and time.monotonic() < self.exited + within_s:
            time.sleep(0.2)
        return alive

    def kill(self) -> None:
        """SIGKILL what is left of this run (a test that failed while it ran)."""
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.seen:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                continue

    def _alive(self) -> list[str]:
        alive = []
        for p in self.seen:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        return alive


@pytest.fixture(autouse=True)
def no_run_outlives_its_test():
    yield
    while Run.started:
        Run.started.pop().kill()


def grpo(log_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Run:
    return Run([sys.executable, str(HOOKED), *RUN, f"logger.log_dir={log_dir}", *extra], env)


def rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def paused(log_dir: Path):
    return lambda: (log_dir / "paused").exists()


def stop_line(run: Run, prefix: str) -> str:
    (line,) = [ln for ln in run.lines if ln.startswith(prefix)]
    return line


def assert_resumes_exactly(stopped: Path, resume: str, full: Path, stop_step: int) -> None:
    """The printed command continues at the next step and ends where the uninterrupted run ends."""
    resumed = Run(shlex.split(resume.replace("python ", f"{sys.executable} ", 1)))
    assert resumed.finish() == 0, resumed.output
    assert resumed.leftovers() == []
    a, b = rows(full), rows(stopped)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5], "a gap or a duplicate step in metrics.jsonl"
    for x, y in zip(a, b):
        assert y["generation/num_tokens"] == x["generation/num_tokens"], (x["step"], stop_step)
        assert y["train/reward_mean"] == pytest.approx(x["train/reward_mean"], abs=1e-6)
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-3, abs=1e-6)
    from safetensors.torch import load_file

    wa, wb = (
        load_file(str(next((d / "checkpoints/step_000005/policy/model").glob("*.safetensors"))))
        for d in (full, stopped)
    )
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Run]:
    """The run the stopped ones must end as, and the full-disk test's run: its step-4 checkpoint cannot be written
    and ``checkpoint.on_error=warn`` trains on. A failed write changes no rollout, loss or weight, so one run is
    both (a GRPO run's start is most of its 30 s)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    run = grpo(d, NO_WANDB, "checkpoint.every=2", "checkpoint.on_error=warn", env={"RL_SPECDEC_TEST_DISK_FULL": "4"})
    assert run.finish() == 0, run.output
    return d, run


@pytest.fixture(scope="module")
def full(uninterrupted) -> Path:
    return uninterrupted[0]


@pytest.mark.integration
def test_sigterm_then_ctrl_c_each_keep_their_step_and_the_run_resumes_exactly(tmp_path, full):
    """Two stops of one run, each resumed from what it saved, ending as the uninterrupted run ends.

    SIGTERM while step 2 trains: step 2 is finished, checkpointed (not due: every=4) and logged, everything is
    shut down, exit 143 with the resume command (wandb on: its process must go too). The resumed run takes
    SIGINT to its whole process group (Ray's processes too, as Ctrl-C in a terminal sends it) while step 4
    generates: the step is dropped at once and step 3 is checkpointed, although the policy workers took the
    signal too; exit 130. Neither stop prints a native stack dump or leaves a process behind."""
    from rl_specdec.grpo.checkpoint import verify

    ckpts = tmp_path / "checkpoints"
    run = grpo(tmp_path, env={"RL_SPECDEC_TEST_PAUSE": "train:2:4"})
    run.wait_for(paused(tmp_path))
    run.signal(signal.SIGTERM)
    assert run.finish() == 143, run.output
    assert not any(s in run.output for s in NATIVE_DUMP), run.output
    assert run.leftovers() == []
    line = stop_line(run, "stopped by SIGTERM")
    want = f"stopped by SIGTERM after step 2: checkpoint {ckpts / 'step_000002'}; resume with: python "
    assert line.startswith(want) and line.endswith(" resume=true"), line
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"] and verify(ckpts / "step_000002") is None
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]

    (tmp_path / "paused").unlink()
    # the printed command, with the hook that holds its second generation (step 4)
    resumed = grpo(tmp_path, "resume=true", env={"RL_SPECDEC_TEST_PAUSE": "generation:2:60"})
    resumed.wait_for(paused(tmp_path))
    t0 = time.monotonic()
    resumed.signal(signal.SIGINT, group=True)
    assert resumed.finish() == 130, resumed.output
    assert time.monotonic() - t0 < 50, "the stop waited for the generation it drops"
    assert not any(s in resumed.output for s in NATIVE_DUMP), resumed.output
    assert resumed.leftovers() == []
    line = stop_line(resumed, "stopped by SIGINT")
    assert line.startswith(f"stopped by SIGINT after step 3: checkpoint {ckpts / 'step_000003'}"), line
    assert verify(ckpts / "step_000003") is None
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]
    assert_resumes_exactly(tmp_path, line.split("resume with: ")[1], full, 3)


WAITER = """
import sys, time
import ray
from rl_specdec.config.generation import ClusterConfig
from rl_specdec.grpo.stop import StopSignals
from rl_specdec.rollout.placement import init_ray

with StopSignals(float(sys.argv[1]), "python again resume=true"):
    init_ray(ClusterConfig(num_cpus=2))

    @ray.remote
    class Busy:
        def ping(self):
            return 1

    actor = Busy.remote()
    ray.get(actor.ping.remote())
    print("ready", flush=True)
    time.sleep(120)  # a phase the stop finishes
"""


@pytest.mark.integration
@pytest.mark.parametrize("second_signal", [True, False], ids=["second-signal", "grace-runs-out"])
def test_a_second_signal_or_the_grace_period_exits_at_once(second_signal):
    """A run that does not stop in time: a second SIGTERM, or checkpoint.grace_s after a SIGINT, exits at once
    with the signal's status, names how to resume, kills the Ray processes, and prints no native stack dump."""
    run = Run([sys.executable, "-c", WAITER, "60" if second_signal else "2"])
    run.wait_for(lambda: "ready" in run.lines, timeout=120)
    t0 = time.monotonic()
    if second_signal:
        run.signal(signal.SIGTERM)
        time.sleep(1.0)
        run.signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 143, run.output
        assert "a second signal (SIGTERM): exited at once" in run.output, run.output
    else:
        run.signal(signal.SIGINT)
        assert run.finish(timeout=30) == 130, run.output
        assert "checkpoint.grace_s=2 ran out after SIGINT: exited at once" in run.output, run.output
        assert time.monotonic() - t0 > 1.5
    assert time.monotonic() - t0 < 15
    assert not any(s in run.output for s in NATIVE_DUMP), run.output
    assert run.leftovers() == []


@pytest.mark.integration
def test_a_driver_killed_outright_leaves_no_process_behind(tmp_path):
    """SIGKILL to the driver while step 2 trains, as the OOM killer sends it: no handler runs, yet every process
    the run started (Ray's, the engine's, the policy worker's) is gone within 15 s (rollout/watchdog.py), and the
    checkpoint on disk is intact. Without the watchdog, Ray's processes outlive the driver by about a minute."""
    run = grpo(tmp_path, NO_WANDB, "checkpoint.every=1", env={"RL_SPECDEC_TEST_PAUSE": "train:2:30"})
    run.wait_for(paused(tmp_path))
    run.signal(signal.SIGKILL)
    assert run.finish(timeout=30) == -signal.SIGKILL
    assert len(run.seen) >= 4 and run.leftovers(within_s=15.0) == []
    from rl_specdec.grpo.checkpoint import verify

    assert verify(tmp_path / "checkpoints" / "step_000001") is None


@pytest.mark.integration
def test_a_trainer_killed_while_it_streams_the_refit_is_named_as_the_trainer(tmp_path):
    """SIGKILL to the policy worker after the engines loaded the first bucket of a step's refit: the run stops
    (exit 1) naming the trainer, not an engine, with what is on disk and run.max_restarts; no traceback or Ray
    report follows on the console."""
    run = grpo(tmp_path, NO_WANDB, "checkpoint.every=50", env={"RL_SPECDEC_TEST_KILL_TRAINER_IN_REFIT": "2"})
    assert run.finish() == 1, run.output
    assert run.leftovers() == []
    (err,) = [ln for ln in run.lines if ln.startswith("error: ")]
    # Ray reports the death where it meets it: in the engines' wait on the stream (ProcessDied) or in the policy
    # group's own call (PolicyWorkerDied); either names the trainer, neither an engine
    assert "the trainer" in err and "policy worker" in err, err
    assert "GenerationEngineDied" not in run.output and "vLLM engine actor died" not in run.output, run.output
    (stopped,) = [ln for ln in run.lines if "GRPO stopped at step " in ln]
    assert "ProcessDied" in stopped or "PolicyWorkerDied" in stopped, stopped
    assert "there is no checkpoint yet (checkpoint.every=50" in stopped and "run.max_restarts=1" in stopped
    after = run.output[run.output.index("GRPO stopped") :]
    for raw in ("Traceback", "Unhandled error", "Exception ignored", "ActorDiedError"):
        assert raw not in after, after


@pytest.mark.integration
def test_a_full_disk_keeps_the_checkpoints_and_stops_naming_the_folder(tmp_path):
    """The step-4 checkpoint cannot be written (ENOSPC after the policy's files): the half-written folder is
    removed, step 2's is intact, and the run stops (exit 1) naming the folder and its free space."""
    from rl_specdec.grpo.checkpoint import verify

    run = grpo(tmp_path, NO_WANDB, "checkpoint.every=2", env={"RL_SPECDEC_TEST_DISK_FULL": "4"})
    assert run.finish() == 1, run.output
    assert run.leftovers() == []
    ckpts = tmp_path / "checkpoints"
    (err,) = [ln for ln in run.lines if ln.startswith("error: ")]
    assert f"could not write checkpoint step_000004 into {ckpts}: OSError: [Errno 28]" in err, err
    assert "MiB free of" in err and "step_000002" in err and "checkpoint.on_error=warn" in err, err
    assert "Traceback" not in run.output, run.output
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"] and verify(ckpts / "step_000002") is None


@pytest.mark.integration
def test_a_full_disk_with_on_error_warn_trains_on(uninterrupted):
    log_dir, run = uninterrupted
    assert "Training goes on without it (checkpoint.on_error=warn)" in run.output, run.output
    assert [r["step"] for r in rows(log_dir)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (log_dir / "checkpoints").iterdir()) == ["step_000002", "step_000005"]


@pytest.mark.integration
def test_another_vllm_version_is_a_config_error(tmp_path):
    """The gate (rl_specdec.vllm_ext) through run_grpo.py: exit 2 and one message, no traceback. (That the
    override key lets a config through: tests/test_vllm_ext.py, in this process.)"""
    run = grpo(tmp_path, env={"RL_SPECDEC_TEST_VLLM_VERSION": "0.40.0"})
    assert run.finish(timeout=120) == 2, run.output
    assert "Traceback" not in run.output, run.output
    (err,) = [ln for ln in run.lines if ln.startswith("config error: ")]
    assert "vLLM 0.40.0 is installed" in err and "policy.generation.allow_untested_vllm=true" in err, err


# ---- the handlers, in this process --------------------------------------------------------------------------


def test_a_signal_outside_a_droppable_phase_only_asks_for_a_stop():
    from rl_specdec.grpo.stop import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(60.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode; the grace timer starts
        assert stop.signum == signal.SIGTERM and stop._timer.is_alive()
    stop._timer.join(1.0)  # cancelled: it ends without exiting
    assert signal.getsignal(signal.SIGTERM) is before and not stop._timer.is_alive()


def test_a_signal_in_a_droppable_phase_interrupts_it():
    from rl_specdec.grpo.stop import StopSignals

    with StopSignals(60.0) as stop:
        with pytest.raises(KeyboardInterrupt):
            with stop.abandonable():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # interrupted, not waited for
        assert stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):  # nothing droppable starts once a stop was asked for
            with stop.abandonable():
                pass


def test_the_stop_line_names_the_checkpoint_and_the_resume_command(tmp_path):
    from rl_specdec.grpo.checkpoint import CheckpointManager
    from rl_specdec.grpo.stop import StopSignals

    stop = StopSignals(60.0, "python examples/run_grpo.py --config c.yaml resume=true")
    stop.signum = signal.SIGTERM
    e = stop.stopped(7, tmp_path / "step_000007")
    assert e.code == 143 and str(e) == (
        f"stopped by SIGTERM after step 7: checkpoint {tmp_path / 'step_000007'}; resume with: "
        "python examples/run_grpo.py --config c.yaml resume=true"
    )
    assert "while the run was starting" in str(stop.stopped(None, None))
    assert "before the first step finished: nothing to resume" in str(stop.stopped(0, None))
    assert "checkpoint.enabled=false" in str(stop.stopped(7, None))
    stop.checkpoints = CheckpointManager(str(tmp_path))
    stop.checkpoints.save(4, lambda p: os.makedirs(p), {"step": 4})
    stop.signum = signal.SIGINT
    e = stop.stopped(7, None)
    assert e.code == 130 and f"could not be written; the newest checkpoint is {tmp_path / 'step_000004'}" in str(e)
