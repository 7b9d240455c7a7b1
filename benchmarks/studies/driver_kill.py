"""How long do the run's processes outlive a driver killed outright (SIGKILL, as the OOM killer sends it)?

    python -m benchmarks.studies.driver_kill                 # 2 trials (~2 min, 2 cores)

Each trial starts the default config (speculation off, small batch, no wandb) through
``tests/run_grpo_hooked.py``, holds it in step 2's train phase (``RL_SPECDEC_TEST_PAUSE``), records every
descendant of the driver (Ray's GCS, raylet, agents and workers, the engine's and the policy worker's
processes), SIGKILLs the driver, and reports the seconds until none of them is running
(rl_specdec/rollout/watchdog.py kills them; without it Ray's processes outlive the driver by about a minute).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.bench_common import cores_and_load, log

ROOT = Path(__file__).resolve().parents[2]
RUN = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_every=0",
    "grpo.self_check_prompts=8",
    "policy.generation.max_new_tokens=28",
    "policy.generation.vllm_kwargs.speculative_config=null",
    "logger.progress_bar=false",
    "logger.wandb.enabled=false",
    "checkpoint.every=1",
]


def _alive(procs: set[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def trial(timeout_s: float) -> tuple[int, float]:
    """(processes recorded, seconds from the SIGKILL until none runs)."""
    d = Path(tempfile.mkdtemp(prefix="driver_kill_"))
    args = [sys.executable, "tests/run_grpo_hooked.py", "--config", "configs/grpo_spec.yaml", *RUN]
    env = {**os.environ, "RL_SPECDEC_TEST_PAUSE": "train:2:60"}
    proc = subprocess.Popen(
        [*args, f"logger.log_dir={d}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    me, seen, end = psutil.Process(proc.pid), set(), time.monotonic() + timeout_s
    while not (d / "paused").exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"the run ended or timed out before step 2 trained (logs in {d})")
        seen.update(me.children(recursive=True))
        time.sleep(0.1)
    seen.update(me.children(recursive=True))
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    proc.wait()
    while (left := _alive(seen)) and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    for p in left:  # past 2 minutes: not the watchdog's doing, and not this machine's problem to keep
        p.kill()
    return len(seen), time.monotonic() - t0 if not left else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for a run to reach step 2")
    a = ap.parse_args(argv)
    cores, load = cores_and_load()
    log(f"{cores} cores, load average {load:.2f}")
    print("| trial | processes recorded | all gone after the SIGKILL (s) |\n|---|---|---|")
    for i in range(a.trials):
        n, s = trial(a.timeout)
        print(f"| {i} | {n} | {s:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
