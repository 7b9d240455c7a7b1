"""benchmarks/grpo/lockstep.py: runs that take turns step by step (bench.py --lockstep).

Real processes, each the real ring member (``lockstep.py member``), running a script whose GRPO step is a
timed sleep in place of a GRPO run (pure logic: what is tested is the turn-taking, not GRPO).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from benchmarks.grpo import lockstep

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for examples/run_grpo.py: main(argv) runs `steps` steps through rl_specdec.grpo.loop.step_and_log,
# each a sleep that records its span; `die` makes it exit without a word at that step; `linger` (seconds) starts,
# before its last step, a child that outlives the run (as Ray's workers outlive ray.shutdown) and records its end.
SCRIPT = textwrap.dedent(
    """
    import atexit, os, subprocess, sys, time
    from types import SimpleNamespace
    from rl_specdec.grpo import loop

    def fake_step(run, step):
        t0 = time.time()
        time.sleep(0.15)
        with open(run.spans, "a") as fh:
            fh.write(f"{run.name} {step + 1} {t0:.4f} {time.time():.4f}\\n")
        return {}

    loop.step_and_log = fake_step

    def main(argv):
        name, steps, die, spans = argv[0], int(argv[1]), int(argv[2]), argv[3]
        linger = float(argv[4]) if len(argv) > 4 else 0.0
        run = SimpleNamespace(cfg=SimpleNamespace(grpo=SimpleNamespace(max_steps=steps)), name=name, spans=spans)
        for step in range(steps):
            if step == die:
                os._exit(3)
            if linger and step == steps - 1:
                code = f"import time; time.sleep({linger}); open({spans!r} + '.child', 'w').write(str(time.time()))"
                subprocess.Popen([sys.executable, "-c", code])
                # and the process's own teardown (interpreter exit), after main returns
                atexit.register(lambda: (time.sleep(1.0), open(spans + ".exit", "w").write(str(time.time()))))
            loop.step_and_log(run, step)
        return 0
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "fake_run.py"
    path.write_text(SCRIPT)
    return path


def test_members_take_turns_and_one_that_dies_blocks_nobody(tmp_path):
    script, spans = _script(tmp_path), tmp_path / "spans.log"
    cmds = [
        [sys.executable, str(script), "0", "4", "-1", str(spans)],
        [sys.executable, str(script), "1", "4", "2", str(spans)],  # dies before its step 3
        [sys.executable, str(script), "2", "4", "-1", str(spans)],
    ]
    logs = [tmp_path / f"m{i}" / "run.log" for i in range(3)]
    rcs = lockstep.run_together(cmds, logs, tmp_path / "baton", log=lambda _: None)
    assert rcs == [0, 3, 0], [p.read_text()[-2000:] for p in logs]
    turns = lockstep.read_turns(tmp_path / "baton" / "turns.log")
    assert lockstep.overlapping(turns) == []
    assert lockstep.overlapping(lockstep.read_turns(spans)) == []
    # strict rounds: member 0, 1, 2 for steps 1 and 2, then 0 and 2 once member 1 has gone
    rounds = [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2), (0, 3), (2, 3), (0, 4), (2, 4)]
    assert [(i, s) for i, s, _, _ in turns] == rounds


def test_a_finished_run_holds_the_turn_until_its_processes_have_exited(tmp_path):
    """Member 0's last step leaves a child that exits 1.5 s after the run (as Ray's workers outlive
    ray.shutdown), and its own process takes 1 s more to exit: member 1's last step starts only once
    both have gone, so no teardown shares a step."""
    script, spans = _script(tmp_path), tmp_path / "spans.log"
    cmds = [
        [sys.executable, str(script), "0", "2", "-1", str(spans), "1.5"],
        [sys.executable, str(script), "1", "2", "-1", str(spans)],
    ]
    logs = [tmp_path / f"m{i}" / "run.log" for i in range(2)]
    assert lockstep.run_together(cmds, logs, tmp_path / "baton", log=lambda _: None) == [0, 0]
    turns = lockstep.read_turns(tmp_path / "baton" / "turns.log")
    assert [(i, s) for i, s, _, _ in turns] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    child_end = float(Path(str(spans) + ".child").read_text())
    assert turns[-1][2] >= child_end > turns[-2][3], (turns, child_end)
    own_exit = float(Path(str(spans) + ".exit").read_text())
    assert turns[-1][2] >= own_exit > turns[-2][3], (turns, own_exit)


def test_without_the_baton_the_same_steps_overlap(tmp_path):
    """Negative control: the overlap check finds the clashes of the same members run side by side, unturned.

    Each waits for the other to finish importing before its first step: under load one process's imports may
    take longer than the other's four steps, and then nothing would overlap whatever the check does."""
    script, spans = _script(tmp_path), tmp_path / "spans.log"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import pathlib, runpy, time; m = runpy.run_path({str(script)!r})\n"
                f"pathlib.Path({str(spans)!r} + '.ready{i}').touch()\n"
                f"while not pathlib.Path({str(spans)!r} + '.ready{1 - i}').exists(): time.sleep(0.01)\n"
                f"raise SystemExit(m['main']([{str(i)!r}, '4', '-1', {str(spans)!r}]))",
            ]
        )
        for i in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(lockstep.overlapping(lockstep.read_turns(spans))) >= 1


def test_a_member_waits_for_its_turn(tmp_path):
    lockstep.Baton.start(tmp_path)
    second = lockstep.Baton(tmp_path, 1, 2)
    assert second.turn() == 0
    t0 = time.time()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, pathlib; from benchmarks.grpo import lockstep; "
            f"time.sleep(0.3); lockstep.Baton(pathlib.Path({str(tmp_path)!r}), 0, 2).pass_on()",
        ],
        cwd=ROOT,
    )
    second.wait()
    assert time.time() - t0 >= 0.3
    assert proc.wait(timeout=60) == 0
    second.finish()
    assert second.turn() == 0  # handed back to the member still in the ring


def test_a_ring_that_does_not_fit_in_memory_is_refused_before_it_starts():
    """Three or four runs of the wide pair in one ring do not fit 24 GiB (Ray killed workers in both); two do."""
    from benchmarks.grpo import bench_variants

    four = ["wide base", "wide k=4", "wide schedule corrected", "wide adaptive"]
    why = bench_variants.lockstep_memory_problem(four, total_gib=23.4)
    assert why and "4 runs of the wide pair" in why and "at most 2 wide variants" in why, why
    assert "3 runs of the wide pair" in bench_variants.lockstep_memory_problem(four[:3], total_gib=23.4)
    assert bench_variants.lockstep_memory_problem(four[:2], total_gib=23.4) is None
    assert bench_variants.lockstep_memory_problem(four, total_gib=64) is None
    assert bench_variants.lockstep_memory_problem(["grpo_base", "grpo_spec", "grpo_spec controller"], 23.4) is None
    real = bench_variants.lockstep_memory_problem(["smollm2 base", "smollm2 ngram"], total_gib=23.4)
    assert real and "2 runs of the real model" in real and "Run them without --lockstep" in real, real
