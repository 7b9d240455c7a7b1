"""fp32 against bf16-mixed in the default run: the ``grpo`` section's precision variants and their table.

Each variant pins ``policy.precision`` (the default, ``auto``, is bf16-mixed on a CPU with native bf16
and fp32 on one without); the engines follow the precision (bfloat16 under bf16-mixed), so the trainer's
master weights and AdamW state stay fp32 while both the train step and the rollouts compute in bf16.
``bench.py`` runs them seed-major (each seed runs every variant before the next seed starts)::

    python -m benchmarks.grpo.bench --sections grpo --steps 80 --seeds 0,1 \\
        --variants "grpo_spec fp32;grpo_spec bf16-mixed"
    python -m benchmarks.grpo.bench --sections grpo --steps 10 --seeds 0,1 --out results/precision_base \\
        --variants "grpo_base fp32;grpo_base bf16-mixed"
    python -m benchmarks grpo --steps 6 --seeds 0,1 --no-lockstep --out results/smollm2_precision \\
        --set grpo.val_every=3 \\
        --variants "smollm2 base fp32;smollm2 base bf16-mixed;smollm2 ngram fp32;smollm2 ngram bf16-mixed"

The table (:func:`precision_table`) gives, per variant, the phases and the step, the log-prob
mismatch between trainer and engines (``train/logprob_mismatch``: the mean over steps of each
step's mean, and the largest ``train/logprob_mismatch_max`` of any step) and held-out accuracy
before training and at the last validation.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.rollout.rollout_report import fmt

# variant prefix -> config: the default run, and the real model (its "smollm2 " names keep it in its family)
RUNS = {
    "grpo_base": "grpo_base",
    "grpo_spec": "grpo_spec",
    "smollm2 base": "smollm2_base",
    "smollm2 ngram": "smollm2_spec",
}
VARIANTS: dict[str, tuple[str, list[str]]] = {
    f"{run} {precision}": (f"configs/{config}.yaml", [f"policy.precision={precision}"])
    for run, config in RUNS.items()
    for precision in ("fp32", "bf16-mixed")
}
FP32_OF = {f"{run} bf16-mixed": f"{run} fp32" for run in RUNS}
# a precision variant's baseline: the same precision without speculation
BASELINE = {
    f"{run} {p}": f"{base} {p}"
    for run, base in (("grpo_spec", "grpo_base"), ("smollm2 ngram", "smollm2 base"))
    for p in ("fp32", "bf16-mixed")
}


def run_stats(log_dir: Path) -> dict:
    """The mismatch and held-out accuracy of one run, from its metrics.jsonl (step 0 included)."""
    rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    trained = [r for r in rows if r["step"] >= 1 and r.get("train/logprob_mismatch") is not None]
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    done = log_dir / "done.json"
    return {
        "mismatch_mean": statistics.fmean(r["train/logprob_mismatch"] for r in trained) if trained else None,
        "mismatch_max": max((r["train/logprob_mismatch_max"] for r in trained), default=None),
        "acc_first": val[0][1] if val else None,
        "acc_last": val[-1][1] if len(val) > 1 else None,
        "acc_last_step": val[-1][0] if len(val) > 1 else None,
        "wall_s": json.loads(done.read_text()).get("seconds") if done.exists() else None,
    }


def precision_table(
    stats: dict[str, dict], per_seed: dict[str, dict[int, dict]], dirs: dict[str, dict[int, Path]]
) -> str:
    """One row per seed of each variant of a precision pair: bench's ``step_stats`` (``per_seed``) and the
    run folder's mismatch and accuracy (``dirs``: variant -> seed -> folder); then the ratios fp32 /
    bf16-mixed of bench's means over seeds (``stats``; above 1: bf16-mixed is faster)."""
    names = [n for pair in FP32_OF.items() for n in pair[::-1] if n in stats]
    lines = [
        "| variant | seed | step (s, median) | train (s) | generation (s) | refit (s) | logprob_mismatch mean | "
        "logprob_mismatch max | held-out accuracy, step 0 → last | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        for sd, d in sorted(dirs.get(n, {}).items()):
            r = run_stats(d)
            acc = f"{fmt(r['acc_first'], '{:.3f}')} → {fmt(r['acc_last'], '{:.3f}')} (step {r['acc_last_step']})"
            s = per_seed[n][sd]
            lines.append(
                f"| {n} | {sd} | {s['step_s']:.2f} | {s['train_s']:.2f} | {s['generation_s']:.2f} | "
                f"{s['refit_s']:.2f} | {fmt(r['mismatch_mean'], '{:.2e}')} | {fmt(r['mismatch_max'], '{:.2e}')} | "
                f"{acc} | {fmt(r['wall_s'], '{:.0f}')} |"
            )
    for mixed, fp32 in FP32_OF.items():
        if mixed in stats and fp32 in stats:
            a, b = stats[fp32], stats[mixed]
            ratio = lambda k: f"{a[k] / b[k]:.2f}x"  # noqa: E731
            lines.append(
                f"| {fp32} / {mixed}, mean of seeds | | {ratio('step_s')} | {ratio('train_s')} | "
                f"{ratio('generation_s')} | {ratio('refit_s')} | | | | |"
            )
    return "\n".join(lines)
