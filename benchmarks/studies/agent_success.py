"""Held-out success of the tool-using workload before and after a short GRPO run, over seeds.

Runs ``examples/agent_grpo.py --json`` once per seed, each in a fresh process
(its own Ray and engine), and prints a table: held-out success, tool-call rate
and right-key rate at temperature 1, before and after ``--steps`` GRPO steps.
The tool toy is built on first use (cached), before the first seed runs.

    python -m benchmarks.studies.agent_success                       # seeds 0 and 1, 30 steps
    python -m benchmarks.studies.agent_success --seeds 0 1 2 --steps 20 --out results/agent
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_grpo.py"


def run_seed(seed: int, args) -> dict:
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--json",
        "--seed",
        str(seed),
        "--steps",
        str(args.steps),
        "--eval",
        str(args.eval),
        "--spec",
        args.spec,
    ]
    print("$ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    print(out, end="", flush=True)
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval", type=int, default=128, help="held-out episodes before and after")
    ap.add_argument("--spec", choices=["draft_model", "ngram", "none"], default="draft_model")
    ap.add_argument("--out", default=None, help="folder for results.json and table.md")
    args = ap.parse_args(argv)

    import os

    from rl_specdec.toy.tools import build_tool_toy

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    build_tool_toy()  # once, before the seeds (each run would otherwise wait on the same build)
    runs = [run_seed(s, args) for s in args.seeds]
    lines = [
        "| seed | success before | success after | tool called before / after | right key before / after |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['seed']} | {b['correct']:.3f} | {a['correct']:.3f} | {b['called']:.2f} / {a['called']:.2f} | "
            f"{b['right_key']:.2f} / {a['right_key']:.2f} |"
        )
    mean_b = statistics.mean(r["before"]["correct"] for r in runs)
    mean_a = statistics.mean(r["after"]["correct"] for r in runs)
    lines.append(f"| mean | {mean_b:.3f} | {mean_a:.3f} | | |")
    note = (
        f"{args.steps} GRPO steps (16 episodes x 8 plays), speculation {args.spec}, "
        f"{args.eval} held-out episodes at temperature 1"
    )
    table = "\n".join(lines)
    print(table + "\n" + note)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"runs": runs, "args": vars(args)}, indent=2))
        (out / "table.md").write_text(table + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
