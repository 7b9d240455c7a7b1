"""GRPO runs that take turns step by step, so that the machine's drift falls on every variant alike.

On 2 shared cores a run's train phase, which speculation does not touch, drifts by 0.66x-2.12x per 10
steps, so two runs made one after the other (minutes apart) can differ by as much as speculation's
effect. ``bench.py --lockstep`` starts a seed's variants together instead, one process each, and a
baton lets one of them work at a time:

- the first holds it for its set-up and step-0 row (engines, compilation, the sampling check,
  validation), then one step, then hands it to the next, which does the same;
- from then on they alternate one GRPO step each: step s of every variant runs within one round
  of the others, under the same load;
- a run keeps the baton after its last step until every process it had started by then (Ray's,
  the engines') has exited, and then its own process: the parent hands its turn on when it sees the
  process end, so no teardown overlaps another run's last step; a run that dies leaves the ring alike.

Only the holder computes; the others wait in a poll of 10 ms, their engines idle. Steps are timed
inside each run as always (``timing/*``), so the waits are in no figure. Not for
``grpo.max_staleness=1``, whose generation runs beside the train step, outside the baton.

    python -m benchmarks.grpo.lockstep --baton DIR --index I --of N examples/run_grpo.py --config ... [k=v ...]

runs one member of the ring (``bench.py`` starts them; :func:`run_together`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.01
TEARDOWN_S = 120.0  # the longest a finished run waits for its processes to exit before handing the turn on


class Baton:
    """Member ``index`` of a ring of ``size`` processes that share ``folder``: the file ``turn`` names the
    member that may work, and ``done_<i>`` marks a member that has left the ring."""

    def __init__(self, folder: Path, index: int, size: int):
        if not 0 <= index < size:
            raise ValueError(f"--index {index} is outside the ring of {size} (0..{size - 1})")
        self.folder, self.index, self.size = Path(folder), index, size
        self.tree: list = []  # set after the last step: the processes the run had started

    @staticmethod
    def start(folder: Path) -> None:
        """A fresh ring whose first turn is member 0's."""
        folder.mkdir(parents=True, exist_ok=True)
        for f in [*folder.glob("done_*"), *folder.glob("turns.log")]:
            f.unlink()
        Baton(folder, 0, 1)._write(0)

    def turn(self) -> int:
        while True:
            try:
                return int((self.folder / "turn").read_text())
            except (FileNotFoundError, ValueError):  # between os.replace's steps on some file systems
                time.sleep(POLL_S)

    def wait(self) -> None:
        """Until it is this member's turn."""
        while self.turn() != self.index:
            time.sleep(POLL_S)

    def pass_on(self) -> None:
        """Hand the turn to the next member still in the ring (keep it if none is)."""
        for j in range(1, self.size):
            nxt = (self.index + j) % self.size
            if not (self.folder / f"done_{nxt}").exists():
                self._write(nxt)
                return

    def finish(self) -> None:
        """Leave the ring, handing the turn on if this member holds it."""
        (self.folder / f"done_{self.index}").touch()
        if self.turn() == self.index:
            self.pass_on()

    def _write(self, i: int) -> None:
        tmp = self.folder / f"turn.{os.getpid()}"
        tmp.write_text(str(i))
        os.replace(tmp, self.folder / "turn")


def hold_per_step(baton: Baton) -> None:
    """Make every GRPO step of this process wait for the baton, and hand it on after it (but the last)."""
    from rl_specdec.grpo import loop

    inner = loop.step_and_log

    def step_and_log(run, step: int):
        baton.wait()
        t0 = time.time()
        try:
            return inner(run, step)
        finally:
            with open(baton.folder / "turns.log", "a") as fh:  # what overlapping() checks
                fh.write(f"{baton.index} {step + 1} {t0:.4f} {time.time():.4f}\n")
            if step + 1 < run.cfg.grpo.max_steps:
                baton.pass_on()
            else:  # the processes whose teardown the next run must not share its last step with
                baton.tree = descendants()

    loop.step_and_log = step_and_log  # run_steps looks it up in the module at each step


def descendants() -> list:
    """This process's children, and theirs (Ray's daemons and workers, the engines), alive now."""
    import psutil

    return psutil.Process().children(recursive=True)


def wait_gone(procs: list, timeout_s: float = TEARDOWN_S) -> list:
    """Wait until ``procs`` have exited (Ray's workers go on exiting after ``ray.shutdown``, orphaned);
    returns those still alive after ``timeout_s``."""
    import psutil

    return psutil.wait_procs(procs, timeout=timeout_s)[1]


def read_turns(path: Path) -> list[tuple[int, int, float, float]]:
    """``turns.log``'s lines: (member, step, start, end), in the order the steps ended."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(int(i), int(s), float(a), float(b)) for i, s, a, b in rows]


def overlapping(turns: list[tuple[int, int, float, float]]) -> list[tuple[tuple, tuple]]:
    """Pairs of steps of different members whose times overlap (none, when the baton worked)."""
    spans = sorted(turns, key=lambda t: t[2])
    return [(a, b) for a, b in zip(spans, spans[1:]) if b[2] < a[3] and a[0] != b[0]]


def member(argv: list[str]) -> int:
    """One run of the ring: examples/run_grpo.py's main, with its steps on the baton."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baton", required=True, type=Path, help="the ring's folder")
    p.add_argument("--index", required=True, type=int)
    p.add_argument("--of", required=True, type=int, help="members in the ring")
    p.add_argument("script", help="examples/run_grpo.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = p.parse_args(argv)
    baton = Baton(ns.baton, ns.index, ns.of)
    spec = importlib.util.spec_from_file_location("run_grpo", ns.script)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hold_per_step(baton)
    baton.wait()  # the set-up and the step-0 row run alone
    try:
        return script.main(ns.args)
    finally:  # the turn goes on once this process has exited too (run_together), not before its own teardown
        left = wait_gone(baton.tree)
        if left:
            print(f"lockstep: {len(left)} processes still alive {TEARDOWN_S:.0f}s after the run; going on", flush=True)


def run_together(cmds: list[list[str]], logs: list[Path], folder: Path, log=print, cwd=None) -> list[int]:
    """Run the ``examples/run_grpo.py`` command lines ``cmds`` as one ring; each writes to its log. Returns the
    return codes. A member that exits, however it ends, leaves the ring, so the others never wait on it."""
    Baton.start(folder)
    here = str(Path(__file__).resolve())
    procs = []
    for i, (cmd, path) in enumerate(zip(cmds, logs)):
        ring = [cmd[0], here, "--baton", str(folder), "--index", str(i), "--of", str(len(cmds)), *cmd[1:]]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            procs.append(subprocess.Popen(ring, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd))
    rcs: list[int | None] = [None] * len(procs)
    while None in rcs:
        time.sleep(0.5)
        for i, pr in enumerate(procs):
            if rcs[i] is None and (rc := pr.poll()) is not None:
                rcs[i] = rc
                Baton(folder, i, len(procs)).finish()  # a member that died without leaving
                log(f"  member {i} ({logs[i].parent.name}) ended, rc {rc}")
    if (folder / "turns.log").exists():
        turns = read_turns(folder / "turns.log")
        clash = overlapping(turns)
        log(f"  {len(turns)} steps in turn, {len(clash)} overlapping" + (f": {clash[:3]}" if clash else ""))
    return rcs  # type: ignore[return-value]


if __name__ == "__main__":
    sys.exit(member(sys.argv[1:]))
