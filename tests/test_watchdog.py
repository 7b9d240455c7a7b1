"""Nothing outlives the driver: a driver SIGKILLed (no handler runs) leaves no process it started behind.

Real processes, no Ray: the "driver" starts a child in a session of its own (as Ray's actors are), then the
watchdog, and is SIGKILLed. The end-to-end case, a real GRPO driver killed mid-run, is in test_stops.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

DRIVER = """
import importlib.util, subprocess, sys, time
spec = importlib.util.spec_from_file_location("watchdog", sys.argv[2])  # the module alone: no package import
watchdog = importlib.util.module_from_spec(spec)
spec.loader.exec_module(watchdog)
since = time.time()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
if sys.argv[1] == "watched":
    watchdog.start(__import__("os").getpid(), since)
print(child.pid, flush=True)
time.sleep(300)
"""


def _start_driver(mode: str) -> tuple[subprocess.Popen, psutil.Process]:
    from rl_specdec.rollout import watchdog

    args = [sys.executable, "-c", DRIVER, mode, watchdog.__file__]
    driver = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(driver.stdout.readline()))
    time.sleep(1.5)  # the watchdog has seen the tree
    return driver, child


def _gone_within(p: psutil.Process, seconds: float) -> float | None:
    t0 = time.time()
    _, alive = psutil.wait_procs([p], timeout=seconds)
    return None if alive else time.time() - t0


@pytest.mark.parametrize("mode", ["watched", "unwatched"])
def test_a_killed_driver_takes_what_it_started_with_it(mode):
    driver, child = _start_driver(mode)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    took = _gone_within(child, 15.0 if mode == "watched" else 3.0)
    if mode == "watched":
        assert took is not None and took < 15.0, "a process outlived the driver"
    else:  # negative control: a child in its own session survives its parent's SIGKILL
        assert took is None
        child.kill()
