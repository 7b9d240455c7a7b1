"""Nothing outlives the driver: a process that watches the driver and kills what it started once it is gone.

Ray's actors run in process groups of their own under the raylet, so a driver killed outright (SIGKILL, the
OOM killer) runs no handler, and killing its process group does not reach them; Ray notices the lost driver
only after a while (about a minute here). :func:`start` launches this module, in a session of its own, right
after the driver starts a local Ray instance. Every ``period_s`` it notes the driver's descendants started
since (Ray's GCS, raylet, agents and workers, the engines' and trainers' processes under them), while the tree
is whole; when the driver is gone, it SIGKILLs every one of them still running and exits.
:func:`~rl_specdec.rollout.placement.stop_ray` ends it on a normal exit. It runs as a script and imports
only psutil, so it starts in a fraction of a second and holds a few MB.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

PERIOD_S = 0.5


def start(driver_pid: int, since: float) -> subprocess.Popen:
    """Watch ``driver_pid``; on its death, kill its descendants created after ``since`` (a ``time.time()``)."""
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(driver_pid), repr(since)],  # as a script: no package import
        start_new_session=True,  # a kill of the driver's process group leaves the watchdog to clean up
        stdin=subprocess.DEVNULL,
    )


def _alive(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    return False


def watch(driver_pid: int, since: float, period_s: float = PERIOD_S) -> list[int]:
    """Until the driver is gone, note its descendants created after ``since``; then kill those still running.
    Returns the pids killed."""
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return []
    me, seen = psutil.Process().pid, {}
    while _alive(driver):
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in driver.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if p.pid != me and p.create_time() >= since - 1.0:
                        seen.setdefault(p.pid, p)  # the Process keeps its create time: a reused pid is not it
        time.sleep(period_s)
    killed = []
    for p in seen.values():
        if _alive(p):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
                killed.append(p.pid)
    return killed


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]))
