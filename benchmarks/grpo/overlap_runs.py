"""Rollouts that overlap training: ``grpo.max_staleness`` 0 against 1, the ``grpo`` section's overlap variants.

Each config runs as shipped (``max_staleness: 0``, the sequential loop) and one step off-policy
(``max_staleness=1``: step t+1's rollouts generate with W_t while step t trains), on the default task (80
steps) and the long-tail task (its own 30 steps), each with and without speculation. Off-policy runs twice on
the default task: with the engine and the trainer sharing both cores (``off-policy``, the placement as
shipped) and with the cores split between them (``off-policy 1+1``); the long-tail task runs the split only.
The default task's sequential runs are ``grpo_base`` and ``grpo_spec`` themselves (nothing to add to them).
``bench.py`` runs them seed-major, so every seed runs every variant before the next seed starts::

    python -m benchmarks.grpo.bench --sections grpo --steps 80 --seeds 0,1 --out results/overlap --variants \\
        "$(python -m benchmarks.grpo.overlap_runs)"   # the 10 runs below, ";"-separated

The table (:func:`overlap_table`) gives, per run, the step and its phases, how long the step waited for
rollouts, ``timing/overlap`` (the share of the step when a generation and the update both ran), the
staleness trained on, acceptance length, the log-prob mismatch (``train/logprob_mismatch``: under
``max_staleness=1`` it holds one update's drift as well as the engines' numerical gap) and held-out
accuracy; then the off-policy / sequential ratio of the mean step over seeds (below 1: overlap pays).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from benchmarks.grpo import precision_runs
from benchmarks.rollout.rollout_report import fmt

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
_MODES = {"off-policy": OFF, "off-policy 1+1": OFF + SPLIT}
# each pair's sequential run: on the default task the variant as shipped (grpo_base, grpo_spec: nothing to add);
# on the long-tail task its own, pinned to the config's 30 steps as its off-policy run is
SEQUENTIAL = {n: n if n.startswith("grpo_") else f"{n} sequential" for n in _PAIRS}
VARIANTS: dict[str, tuple[str, list[str]]] = {
    **{seq: _PAIRS[n] for n, seq in SEQUENTIAL.items() if seq != n},
    **{
        f"{n} {mode}": (c, o + extra)
        for n, (c, o) in _PAIRS.items()
        for mode, extra in _MODES.items()
        if n.startswith("grpo_") or mode != "off-policy"  # the long-tail task: sequential and the split only
    },
}
SEQUENTIAL_OF = {off: SEQUENTIAL[n] for n in _PAIRS for off in VARIANTS if off.startswith(f"{n} off-policy")}
SPLIT_OF = {SEQUENTIAL[n]: f"{n} off-policy 1+1" for n in _PAIRS}
# every run of the pairs, each pair's sequential run first: the table's rows and what to pass to --variants
MEMBERS = [m for n in _PAIRS for m in (SEQUENTIAL[n], *(v for v in VARIANTS if v.startswith(f"{n} off-policy")))]


def baseline(name: str) -> str:
    """The variant an overlap variant's speed is compared with in bench's tables: its task's sequential run
    without speculation."""
    return SEQUENTIAL["longtail base" if name.startswith("longtail ") else "grpo_base"]


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
    names = [n for n in MEMBERS if n in stats]
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
                f"| {off}'s speed-up over {seq}, mean of seeds | | {b['step_s'] / a['step_s']:.2f}x | "
                f"{b['generation_s'] / a['generation_s']:.2f}x | {b['train_s'] / a['train_s']:.2f}x | | | | | | |"
            )
    return "\n".join(lines)


def phases(s: dict) -> dict[str, float]:
    """A sequential run's step split for the model (means over steps and seeds): generation's bulk, which more
    engines share, and its tail (the time from 90% to 100% of rollouts done: few requests run, so more engines
    do not shorten it), the train phase, and the rest (refit, validation, prompts, reward, logging)."""
    gen, tail = s["generation_s"], min((s.get("done100_s") or 0) - (s.get("done90_s") or 0), s["generation_s"])
    return {"bulk": gen - tail, "tail": tail, "train": s["train_s"], "rest": s["step_mean_s"] - gen - s["train_s"]}


IDEAL = (1.0, 1.0, 0.0)  # devices that scale ideally: the bulk and the train phase 1/n, the tail not at all


def modelled_step(ph: dict[str, float], devices: int, engines: int | None, scaling=IDEAL) -> float:
    """Step time modelled from a sequential run's phases (measured on all ``devices``). ``engines=None``: the
    sequential loop. ``engines=n``: one step off-policy, n devices for the engines and the rest for the trainer,
    disjoint, the two sides overlapping. ``scaling`` = (a, b, c): on fewer devices the bulk of generation
    takes (devices/n)^a as long, the train phase (devices/(devices-n))^b and the tail (devices/n)^c."""
    if engines is None:
        return sum(ph.values())
    a, b, c = scaling
    gen = ph["bulk"] * (devices / engines) ** a + ph["tail"] * (devices / engines) ** c
    return max(gen, ph["train"] * (devices / (devices - engines)) ** b) + ph["rest"]


def _measured_split(ph: dict[str, float], seq: dict, split: dict) -> str:
    """The 2-core split measured (``split``: the ``off-policy 1+1`` run) against the model fed with its own
    one-core slowdowns of each side: the exponents are log2 of each phase's time on 1 core over 2."""
    a = math.log2(split["generation_s"] / seq["generation_s"])
    b = math.log2(split["train_s"] / seq["train_s"])
    model = modelled_step(ph, 2, 1, (a, b, a)) / sum(ph.values())
    return f"1+1, one core per side: a = c = {a:.2f}, b = {b:.2f}: **{model:.2f}x**; measured **" + (
        f"{split['step_mean_s'] / seq['step_mean_s']:.2f}x**"
    )


def split_table(stats: dict[str, dict], devices: int = 8) -> str:
    """Per task measured sequentially: its phases, the model's step of one step off-policy against the
    sequential loop (below 1: overlap pays) on this machine's 2 cores split 1+1 (with the slowdowns the
    ``off-policy 1+1`` run measured, beside its measured ratio), and on ``devices`` ideal devices per split."""
    lines = [
        "| variant | generation bulk / tail, train, rest (s) | 2 cores, modelled and measured | "
        f"{devices} ideal devices, engines + trainer: modelled |",
        "|---|---|---|---|",
    ]
    for seq in dict.fromkeys(SEQUENTIAL_OF.values()):
        if seq not in stats:
            continue
        ph, split = phases(stats[seq]), stats.get(SPLIT_OF[seq])
        ideal = {e: modelled_step(ph, devices, e) / sum(ph.values()) for e in range(1, devices)}
        best = min(ideal, key=ideal.get)
        lines.append(
            f"| {seq} | {ph['bulk']:.2f} / {ph['tail']:.2f}, {ph['train']:.2f}, {ph['rest']:.2f} | "
            f"{_measured_split(ph, stats[seq], split) if split else '-'} | best {best}+{devices - best}: "
            f"**{ideal[best]:.2f}x**; " + ", ".join(f"{e}+{devices - e}: {r:.2f}x" for e, r in ideal.items()) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(";".join(MEMBERS))
