"""The processes a command starts, by kind, with their CPU seconds: a profile of the test suite's process starts.

    python scripts/suite_profile.py --out results/suite_profile.json -- python -m pytest tests -q -n 2

Polls /proc twice a second for the descendants of the command, names each by its last process title (Ray sets
``ray::VllmWorker``, ``ray::PolicyWorker``, ...), and sums the user and system CPU each was last seen with. A
process that lives less than one poll is missed, so the counts are lower bounds. Linux only; nothing but the
standard library, so it runs before the install too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
KINDS = (  # (kind, substring of the command line), the first match wins
    ("engine actor", "ray::VllmWorker"),
    ("engine actor", "ray::AsyncVllmWorker"),
    ("engine core", "EngineCore"),
    ("policy worker", "ray::PolicyWorker"),
    ("drafter actor", "ray::RayDrafter"),
    ("other ray actor", "ray::"),
    ("ray gcs", "gcs_server"),
    ("ray raylet", "raylet"),
    ("ray other", "/ray/"),
    ("pytest worker", "[pytest-xdist"),  # xdist sets a worker's title to "[pytest-xdist running] <test>"
    ("pytest worker", "-c from xdist"),
    ("pytest worker", "execnet"),
    ("grpo driver", "run_grpo"),
)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids[ppid].append(int(d))
    return kids


def _descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def _sample(pid: int) -> tuple[str, float] | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return cmd, (int(fields[11]) + int(fields[12])) / TICK


def kind_of(cmd: str) -> str:
    return next((kind for kind, mark in KINDS if mark in cmd), "other")


def top_titles(records, n: int = 20) -> list[dict]:
    """The costliest process titles (a command line's first 60 characters), to tell apart what one kind lumps."""
    by: dict[str, dict[str, float]] = defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
    for cmdline, cpu in records:
        t = by[cmdline[:60]]
        t["processes"] += 1
        t["cpu_s"] += cpu
    rows = sorted(by.items(), key=lambda kv: -kv[1]["cpu_s"])[:n]
    return [{"title": title, "processes": v["processes"], "cpu_s": round(v["cpu_s"], 1)} for title, v in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    seen: dict[tuple[int, float], list] = {}  # (pid, first seen) -> [cmd, cpu s]
    first: dict[int, float] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            s = _sample(pid)
            if s is None:
                continue
            start = first.setdefault(pid, time.monotonic())
            rec = seen.setdefault((pid, start), [s[0], 0.0])
            if s[0]:
                rec[0] = s[0]
            rec[1] = max(rec[1], s[1])
        alive = set(_descendants(proc.pid))
        for pid in [p for p in first if p not in alive]:
            del first[pid]  # a reused pid is a new process
        time.sleep(args.every)
    wall = time.monotonic() - t0
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
    for cmdline, cpu in seen.values():
        k = by_kind[kind_of(cmdline)]
        k["processes"] += 1
        k["cpu_s"] += cpu
    report = {"cmd": cmd, "rc": proc.returncode, "wall_s": round(wall, 1), "by_kind": dict(by_kind)}
    report["top_titles"] = top_titles(seen.values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nprocesses started, wall {wall / 60:.1f} min:", file=sys.stderr)
    for kind, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["cpu_s"]):
        print(f"  {kind:16s} {v['processes']:5d} processes {v['cpu_s']:8.0f} CPU s", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
