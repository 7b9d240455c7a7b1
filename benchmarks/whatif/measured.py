"""The calibration the default run prints: this CPU's constants fitted once to the measured cost table in
docs/data, every cell's residual, and the generation phases of real GRPO runs of the same pair predicted
with those constants.

The runs are ``python -m benchmarks.grpo.bench --sections grpo --steps 5 --seeds 0,1 --variants "wide base;wide
k=4;wide schedule;wide threshold;wide adaptive"`` (docs/lab/wide_pair.md, "The wide GRPO workload"): their
metrics.jsonl are copied to docs/data/grpo_wide/. The toy pair's table (docs/data/cost_table_toy.json) is not
in this fit: fitted with the wide pair's, one set of constants misses 21 of 112 cells
(docs/lab/gpu.md, "How good the calibration is").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.whatif import calibrate as CAL
from benchmarks.whatif.grpo import grpo_errors
from benchmarks.whatif.report import table
from benchmarks.whatif.workload import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TABLES = ("docs/data/cost_table_wide.json",)
RUNS = (  # (metrics.jsonl, the run's policy, its num_speculative_tokens)
    ("docs/data/grpo_wide/wide_base_seed0.jsonl", "none", 0),
    ("docs/data/grpo_wide/wide_base_seed1.jsonl", "none", 0),
    ("docs/data/grpo_wide/wide_k4_seed0.jsonl", "fixed:4", 4),
    ("docs/data/grpo_wide/wide_k4_seed1.jsonl", "fixed:4", 4),
    ("docs/data/grpo_wide/wide_adaptive_seed0.jsonl", "controller:5", 5),
    ("docs/data/grpo_wide/wide_adaptive_seed1.jsonl", "controller:5", 5),
)
# LongTailSortTask(4, 8) prompts: ~5 tokens (the cost table's context_mean 23.0 = prompt + 36 / 2)
PROMPT_LEN = 5


def available() -> bool:
    return all((ROOT / p).exists() for p in TABLES)


def calibration_report(log=print) -> str:
    """The fit, its residuals, and the GRPO generation phases predicted (one line per run, every step's error)."""
    tables = [dict(t, _path=p) for t, p in zip(CAL.load_tables([str(ROOT / p) for p in TABLES]), TABLES)]
    theta, prepared, meas, pred = CAL.fit(tables, log=log)
    out = ["## Calibration on this CPU (measured tables, fitted once)\n", CAL.report(theta, prepared, meas, pred)]
    pair = prepared[0][1]
    rows, allerr = [], []
    for path, policy, k in RUNS:
        if not (ROOT / path).exists():
            continue
        _, e, name = grpo_errors(read_metrics(str(ROOT / path)), theta, pair, policy, k, prompt_len=PROMPT_LEN)
        allerr.append(e)
        steps = ", ".join(f"{v * 100:+.0f}%" + ("!" if abs(v) > CAL.TOLERANCE else "") for v in e)
        ok = int(np.sum(np.abs(e) <= CAL.TOLERANCE))
        rows.append([Path(path).name, name, f"{ok} of {len(e)}", f"{np.median(e) * 100:+.1f}%", steps])
    if rows:
        e = np.concatenate(allerr)
        out += [
            "\nThe generation phase of real GRPO steps of that pair, predicted with those constants "
            "(error = predicted / measured - 1; ! beyond 15%):\n",
            table(["run", "policy", f"steps within {CAL.TOLERANCE:.0%}", "median error", "error per step"], rows),
            f"\nIn all: {int(np.sum(np.abs(e) <= CAL.TOLERANCE))} of {len(e)} steps within {CAL.TOLERANCE:.0%}.",
        ]
    return "\n".join(out)
