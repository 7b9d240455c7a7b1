"""The real model (SmolLM2-135M-Instruct, ``configs/smollm2_*.yaml``) in the ``grpo`` section: its variants and
the learning table. One invocation, both configs, two seeds::

    python -m benchmarks grpo --variants "smollm2 base;smollm2 ngram" --seeds 0,1 --steps 15 --lockstep

Each run validates greedily on the task's 200 held-out problems before training and every ``grpo.val_every``
steps (the configs' 5). The section's speed table compares ``smollm2 ngram`` with ``smollm2 base``; the
learning table (:func:`learning_table`) gives, per run, held-out accuracy at each validation, the gain from
step 0 to the last, and the log-prob mismatch between trainer and engine (whose equality across the two
configs is what "speculation is invisible to learning" means here).
"""

from __future__ import annotations

import json
from pathlib import Path

from precision_runs import run_stats
from rollout_report import fmt

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "smollm2 base": ("configs/smollm2_base.yaml", []),
    "smollm2 ngram": ("configs/smollm2_spec.yaml", []),
}


def _curve(log_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    return [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]


def learning_table(dirs: dict[str, dict[int, Path]]) -> str:
    """One row per run of the real model's variants (``dirs``: variant -> seed -> run folder)."""
    lines = [
        "| variant | seed | held-out accuracy by step | gain, step 0 → last | logprob_mismatch mean | "
        "logprob_mismatch max | wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        for seed, d in sorted(dirs.get(name, {}).items()):
            curve, r = _curve(d), run_stats(d)
            gain = curve[-1][1] - curve[0][1] if len(curve) > 1 else None
            lines.append(
                f"| {name} | {seed} | {', '.join(f'{s}: {a:.3f}' for s, a in curve)} | {fmt(gain, '{:+.3f}')} | "
                f"{fmt(r['mismatch_mean'], '{:.2e}')} | {fmt(r['mismatch_max'], '{:.2e}')} | "
                f"{fmt(r['wall_s'], '{:.0f}')} |"
            )
    return "\n".join(lines)
