"""The real model (SmolLM2-135M-Instruct, ``configs/smollm2_*.yaml``) in the ``grpo`` section: its variants and
the learning table. One invocation, both configs, two seeds::

    python -m benchmarks grpo --variants "smollm2 base;smollm2 ngram" --seeds 0,1 --steps 12 --no-lockstep

(Two of its runs alive at once need more than 24 GiB, so they run one after the other, not in lockstep.)

Each run validates greedily on the task's 200 held-out problems before training and every ``grpo.val_every``
steps (the configs' 4). The section's speed table compares ``smollm2 ngram`` with ``smollm2 base``; the
learning table (:func:`learning_table`) gives, per run, held-out accuracy at each validation, the gain from
step 0 to the last, and the log-prob mismatch between trainer and engine (whose equality across the two
configs is what "speculation is invisible to learning" means here).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.grpo.precision_runs import run_stats
from benchmarks.rollout.rollout_report import fmt

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "smollm2 base": ("configs/smollm2_base.yaml", []),
    "smollm2 ngram": ("configs/smollm2_spec.yaml", []),
    # its EAGLE-3 head (pkg:smollm2-135m-instruct-eagle3, built at first use), frozen, and trained online
    "smollm2 eagle3 frozen": ("configs/smollm2_eagle3.yaml", ["policy.generation.drafter_training.enabled=false"]),
    "smollm2 eagle3 online": ("configs/smollm2_eagle3.yaml", ["policy.generation.drafter_training.enabled=true"]),
}


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(log_dir / "metrics.jsonl")]


def _acceptance(rows: list[dict], n: int = 3) -> str:
    """Mean acceptance length over the first ``n`` trained steps → the last ``n`` ("–" without speculation)."""
    a = [r["spec_decode/acceptance_length"] for r in rows if r["step"] >= 1 and "spec_decode/acceptance_length" in r]
    if len(a) < 2 * n:
        return "–"
    return f"{sum(a[:n]) / n:.2f} → {sum(a[-n:]) / n:.2f}"


def learning_table(dirs: dict[str, dict[int, Path]]) -> str:
    """One row per run of the real model's variants (``dirs``: variant -> seed -> run folder)."""
    lines = [
        "| variant | seed | held-out accuracy by step | gain, step 0 → last | logprob_mismatch mean | "
        "logprob_mismatch max | acceptance length, steps 1-3 → last 3 | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        for seed, d in sorted(dirs.get(name, {}).items()):
            rows, r = _rows(d), run_stats(d)
            curve = [(x["step"], x["val/accuracy"]) for x in rows if "val/accuracy" in x]
            gain = curve[-1][1] - curve[0][1] if len(curve) > 1 else None
            lines.append(
                f"| {name} | {seed} | {', '.join(f'{s}: {a:.3f}' for s, a in curve)} | {fmt(gain, '{:+.3f}')} | "
                f"{fmt(r['mismatch_mean'], '{:.2e}')} | {fmt(r['mismatch_max'], '{:.2e}')} | {_acceptance(rows)} | "
                f"{fmt(r['wall_s'], '{:.0f}')} |"
            )
    return "\n".join(lines)
