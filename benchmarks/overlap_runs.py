"""Rollouts that overlap training: ``grpo.max_staleness`` 0 against 1, the ``grpo`` section's overlap variants.

Each config runs as shipped (``max_staleness: 0``, the sequential loop) and one step off-policy
(``max_staleness=1``: step t+1's rollouts generate with W_t while step t trains), on the default task (80
steps) and the long-tail task (its own 30 steps), each with and without speculation. Off-policy runs twice on
the default task: with the engine and the trainer sharing both cores (``off-policy``, the placement as
shipped) and with the cores split between them (``off-policy 1+1``); the long-tail task runs the split only.
``bench.py`` runs them seed-major, so every seed runs every variant before the next seed starts::

    python benchmarks/bench.py --sections grpo --steps 80 --seeds 0,1 --out results/overlap --variants \\
        "$(cd benchmarks && python overlap_runs.py)"   # the 10 variants below, ";"-separated

The table (:func:`overlap_table`) gives, per run, the step and its phases, how long the step waited for
rollouts, ``timing/overlap`` (the share of the step when a generation and the update both ran), the
staleness trained on, acceptance length, the log-prob mismatch (``train/logprob_mismatch``: under
``max_staleness=1`` it holds one update's drift as well as the engines' numerical gap) and held-out
accuracy; then the off-policy / sequential ratio of the mean step over seeds (below 1: overlap pays).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import precision_runs
from rollout import fmt

OFF = ["grpo.max_staleness=1"]
_LONGTAIL_STEPS = ["grpo.max_steps=30"]  # the long-tail config's own length, whatever --steps says
_PAIRS: dict[str, tuple[str, list[str]]] = {
    "grpo_base": ("configs/grpo_base.yaml", []),
    "grpo_spec": ("configs/grpo_spec.yaml", []),
    "longtail base": ("configs/grpo_base_longtail.yaml", _LONGTAIL_STEPS),
    "longtail spec": ("configs/grpo_spec_longtail.yaml", _LONGTAIL_STEPS),
}
# the 2 cores split: the engine's OpenMP threads bound to core 0, the trainer one thread (the scheduler puts it on
# the other core), so the two sides overlap without taking each other's cores
SPLIT = ["policy.generation.cpus_per_engine=1", "policy.cpus_per_worker=1", "policy.num_threads=1"]
_MODES = {"sequential": [], "off-policy": OFF, "off-policy 1+1": OFF + SPLIT}
VARIANTS: dict[str, tuple[str, list[str]]] = {
    f"{n} {mode}": (c, o + extra)
    for n, (c, o) in _PAIRS.items()
    for mode, extra in _MODES.items()
    if n.startswith("grpo_") or mode != "off-policy"  # the long-tail task: sequential and the split only
}
SEQUENTIAL_OF = {off: off.split(" off-policy")[0] + " sequential" for off in VARIANTS if "off-policy" in off}


def baseline(name: str) -> str:
    """The variant an overlap variant's speed is compared with in bench's tables: its task's sequential run
    without speculation."""
    return "longtail base sequential" if name.startswith("longtail ") else "grpo_base sequential"


def _mean(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _row(name: str, seed: int, s: dict, rows: list[dict], acc: dict) -> str:
    rs = rows[1:] if len(rows) > 1 else rows  # bench's step_stats skips the first step too
    first, last = acc["acc_first"], acc["acc_last"]
    gain = f" ({last - first:+.3f})" if first is not None and last is not None else ""
    return (
        f"| {name} | {seed} | {s['step_s']:.2f} | {s['generation_s']:.2f} | {s['train_s']:.2f} | "
        f"{fmt(_mean(rs, 'timing/generation_wait'), '{:.2f}')} | {fmt(_mean(rs, 'timing/overlap'), '{:.0%}')} | "
        f"{fmt(_mean(rs, 'train/staleness'), '{:.2f}')} | {fmt(s['acceptance_length'], '{:.2f}')} | "
        f"{fmt(acc['mismatch_mean'], '{:.2e}')} | {fmt(first, '{:.3f}')} → {fmt(last, '{:.3f}')}{gain} |"
    )


def overlap_table(
    stats: dict[str, dict],
    per_seed: dict[str, dict[int, dict]],
    runs: dict[str, dict[int, list[dict]]],
    dirs: dict[str, dict[int, Path]],
) -> str:
    """One row per seed of each variant of an overlap pair (``per_seed``: bench's ``step_stats``; ``runs``:
    the metrics rows; ``dirs``: the run folders), then each pair's off-policy / sequential ratios of bench's
    means over seeds (``stats``)."""
    names = [n for n in VARIANTS if n in stats]
    lines = [
        "| variant | seed | step (s, median) | generation (s) | train (s) | waited for rollouts (s) | "
        "timing/overlap | staleness | acceptance length | logprob_mismatch | held-out accuracy, step 0 → last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        for sd in sorted(per_seed[n]):
            lines.append(_row(n, sd, per_seed[n][sd], runs[n][sd], precision_runs.run_stats(dirs[n][sd])))
    for off, seq in SEQUENTIAL_OF.items():
        if off in stats and seq in stats:
            a, b = stats[off], stats[seq]
            lines.append(
                f"| {off} / {seq}, mean of seeds | | {a['step_s'] / b['step_s']:.2f}x | "
                f"{a['generation_s'] / b['generation_s']:.2f}x | {a['train_s'] / b['train_s']:.2f}x | | | | | | |"
            )
    return "\n".join(lines)


def phases(s: dict) -> dict[str, float]:
    """A sequential run's step split for the model (means over steps and seeds): generation's bulk, which more
    engines share, and its tail (the time from 90% to 100% of rollouts done: few requests run, so more engines
    do not shorten it), the train phase, and the rest (refit, validation, prompts, reward, logging)."""
    gen, tail = s["generation_s"], min((s.get("done100_s") or 0) - (s.get("done90_s") or 0), s["generation_s"])
    return {"bulk": gen - tail, "tail": tail, "train": s["train_s"], "rest": s["step_mean_s"] - gen - s["train_s"]}


def modelled_step(ph: dict[str, float], devices: int, engines: int | None) -> float:
    """Step time modelled from a sequential run's phases on ``devices`` devices. ``engines=None``: the sequential
    loop, every phase on all devices. ``engines=n``: one step off-policy with n devices for the engines and the
    rest for the trainer, disjoint; the bulk of generation and the train phase scale with their devices, the
    tail does not, and the two sides overlap."""
    if engines is None:
        return ph["bulk"] + ph["tail"] + ph["train"] + ph["rest"]
    gen = ph["bulk"] * devices / engines + ph["tail"]
    return max(gen, ph["train"] * devices / (devices - engines)) + ph["rest"]


def split_table(stats: dict[str, dict], devices: tuple[int, ...] = (2, 8)) -> str:
    """Per sequential variant measured: the modelled step of one step off-policy at each split of ``devices``
    devices, as a ratio to the sequential loop on all of them (below 1: overlap pays)."""
    lines = [
        "| variant | devices | generation bulk / tail / train / rest (s) | sequential (s) | "
        "off-policy, engines + trainer devices: step vs sequential |",
        "|---|---|---|---|---|",
    ]
    for seq in dict.fromkeys(SEQUENTIAL_OF.values()):
        if seq not in stats:
            continue
        ph = phases(stats[seq])
        for n in devices:
            base = modelled_step(ph, n, None)
            splits = ", ".join(f"{e}+{n - e}: {modelled_step(ph, n, e) / base:.2f}x" for e in range(1, n))
            split = " / ".join(f"{ph[k]:.2f}" for k in ("bulk", "tail", "train", "rest"))
            lines.append(f"| {seq} | {n} | {split} | {base:.2f} | {splits} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(";".join(VARIANTS))
