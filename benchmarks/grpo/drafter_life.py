"""The drafter over a long run: frozen against trained online, and a cold start.

The ``staleness`` section of ``bench.py``: three GRPO runs of the default
config on the same seed, which differ only in the drafter:

frozen
    ``configs/grpo_spec.yaml`` at vLLM's fixed k=3 (``speculation_control``
    off, so every step drafts): the toy drafter, distilled from the initial
    policy, never refit.
online
    the same, with ``policy.generation.drafter_training.enabled=true``: after
    every step the drafter is distilled on that step's rollouts against the
    policy's top-k log-probs and refit into the engine.
cold start
    online training from a drafter of the right shape with random weights
    (``toy:drafter-untrained``), for ``--cold-steps`` steps.

With ``--drafter eagle3`` the three runs use an EAGLE-3 head instead (``HEAD_RUNS``:
``toy:eagle3``, and ``toy:eagle3-untrained`` for the cold start), trained online
inside the policy's update.

The cost of online training is measured by the ``grpo`` section (variant
``grpo_spec drafter online``, every seed), not here: one seed's step times
swing too much to carry a 5% claim.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.rollout.rollout_report import fmt

SPEC = "policy.generation.vllm_kwargs.speculative_config"
ONLINE = "policy.generation.drafter_training.enabled=true"
# online training at a bounded cost: every 2nd step, on 16 of the step's 128 rollouts (1/16 of the work)
LIGHT = [ONLINE, "policy.generation.drafter_training.every=2", "policy.generation.drafter_training.max_sequences=16"]
FIXED = ["policy.generation.speculation_control.mode=off"]  # vLLM's k=3 at every step: acceptance is measured
RUNS: dict[str, tuple[str, list[str]]] = {
    "frozen": ("configs/grpo_spec.yaml", FIXED),
    "online": ("configs/grpo_spec.yaml", FIXED + [ONLINE]),
    "online light": ("configs/grpo_spec.yaml", FIXED + LIGHT),
    "cold start": ("configs/grpo_spec.yaml", FIXED + [ONLINE, f"{SPEC}.model=toy:drafter-untrained"]),
}
# the same three runs with an EAGLE-3 head for the toy policy (toy:eagle3, trained at build), k=3 at every step
HEAD = [f"{SPEC}.method=eagle3", f"{SPEC}.num_speculative_tokens=3"]
HEAD_RUNS: dict[str, tuple[str, list[str]]] = {
    "frozen": ("configs/grpo_spec.yaml", FIXED + HEAD + [f"{SPEC}.model=toy:eagle3"]),
    "online": ("configs/grpo_spec.yaml", FIXED + HEAD + [f"{SPEC}.model=toy:eagle3", ONLINE]),
    "cold start": ("configs/grpo_spec.yaml", FIXED + HEAD + [f"{SPEC}.model=toy:eagle3-untrained", ONLINE]),
}
COLD_GOAL = 2.5  # acceptance length the cold start should reach within 50 steps


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _buckets(rows: list[dict], size: int) -> list[list[dict]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def staleness_table(series: dict[str, list[dict]], size: int = 20) -> str:
    """Acceptance length per ``size``-step bucket of each long run, side by side, and the policy's drift."""
    names = [n for n in series if n != "cold start"]
    lines = [
        "| steps | "
        + " | ".join(f"acceptance length, {n}" for n in names)
        + " | "
        + " | ".join(f"{n} / frozen" for n in names[1:])
        + " | "
        + " | ".join(f"drafter KL, {n}" for n in names[1:])
        + " | policy KL to start (frozen) | train reward (frozen) |",
        "|---|" + "---|" * (3 * len(names) - 2 + 2),
    ]
    for i, f in enumerate(_buckets(series["frozen"], size)):
        b = {n: _buckets(series[n], size)[i] if i < len(_buckets(series[n], size)) else [] for n in names}
        ln = {n: _mean(b[n], "spec_decode/acceptance_length") for n in names}
        lines.append(
            f"| {f[0]['step']}–{f[-1]['step']} | "
            + " | ".join(fmt(ln[n], "{:.3f}") for n in names)
            + " | "
            + " | ".join(fmt(ln[n] / ln["frozen"] if ln[n] and ln["frozen"] else None, "{:.3f}x") for n in names[1:])
            + " | "
            + " | ".join(fmt(_mean(b[n], "drafter/kl"), "{:.3f}") for n in names[1:])
            + f" | {fmt(_mean(f, 'train/kl'), '{:.3f}')} | {fmt(_mean(f, 'train/reward_mean'), '{:.2f}')} |"
        )
    return "\n".join(lines)


def staleness_verdict(series: dict[str, list[dict]], size: int = 20) -> str:
    out = []
    for name, rows in ((n, r) for n, r in series.items() if n != "cold start"):
        first, last = (
            _mean(rows[:size], "spec_decode/acceptance_length"),
            _mean(rows[-size:], "spec_decode/acceptance_length"),
        )
        if first and last:
            out.append(
                f"{name}: acceptance length {first:.3f} in steps 1–{size}, {last:.3f} in the last {size} steps "
                f"({last / first:.3f}x)"
            )
    return "; ".join(out) + "."


def cold_table(rows: list[dict], size: int = 5) -> str:
    """Acceptance length per ``size``-step bucket from an untrained drafter, and when it first reaches the goal."""
    lines = ["| steps | acceptance length | acceptance rate | drafter loss | drafter KL |", "|---|---|---|---|---|"]
    for b in _buckets(rows, size):
        lines.append(
            f"| {b[0]['step']}–{b[-1]['step']} | {fmt(_mean(b, 'spec_decode/acceptance_length'), '{:.3f}')} | "
            f"{fmt(_mean(b, 'spec_decode/acceptance_rate'), '{:.3f}')} | {fmt(_mean(b, 'drafter/loss'), '{:.3f}')} | "
            f"{fmt(_mean(b, 'drafter/kl'), '{:.3f}')} |"
        )
    reached = next(
        (
            b[-1]["step"]
            for b in _buckets(rows, size)
            if (m := _mean(b, "spec_decode/acceptance_length")) and m >= COLD_GOAL
        ),
        None,
    )
    lines.append("")
    lines.append(
        f"First {size}-step bucket with a mean acceptance length of {COLD_GOAL} or more: "
        + (f"steps up to {reached}." if reached else f"none in {len(rows)} steps.")
    )
    return "\n".join(lines)


def cost_text(stats: dict[str, dict]) -> str:
    """Online drafter training against the frozen drafter and grpo_base, from the grpo section (every seed)."""
    fr, base = stats.get("grpo_spec"), stats.get("grpo_base")
    variants = [n for n in ("grpo_spec drafter online", "grpo_spec drafter light") if n in stats]
    if not (fr and variants):
        return (
            "_run the grpo section with grpo_spec and 'grpo_spec drafter online' "
            "(or 'grpo_spec drafter light') for the cost._"
        )
    lines = [
        "| variant | step (s, median) | speed-up vs frozen | train pooled (s) | speed-up vs frozen | train phase (s) | "
        "drafter train (s, its actor) | generation (s) | acceptance length | speed-up vs grpo_base |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in ["grpo_spec", *variants]:
        s = stats[n]
        lines.append(
            f"| {n}{' (frozen)' if n == 'grpo_spec' else ''} | {s['step_s']:.2f} | {fr['step_s'] / s['step_s']:.3f}x "
            f"| {s['step_pooled_s']:.2f} | "
            f"{fr['step_pooled_s'] / s['step_pooled_s']:.3f}x | {s['train_s']:.2f} | "
            f"{fmt(s.get('drafter_train_s'), '{:.2f}')} | {s['generation_s']:.2f} | "
            f"{fmt(s['acceptance_length'], '{:.2f}')} | "
            f"{fmt(base['step_s'] / s['step_s'] if base else None, '{:.3f}x')} |"
        )
    return "\n".join(lines)


def plot(series: dict[str, list[dict]], path: Path, plt) -> None:
    """Acceptance length per step (10-step mean) of each run, and the online drafter's KL to the policy."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for c, (name, rows) in enumerate(series.items()):
        steps = [r["step"] for r in rows]
        length = [r.get("spec_decode/acceptance_length") for r in rows]
        axes[0].plot(
            steps,
            [statistics.fmean(x for x in length[max(0, i - 9) : i + 1] if x is not None) for i in range(len(length))],
            color=f"C{c}",
            label=name,
        )
        if any(r.get("drafter/kl") is not None for r in rows):
            axes[1].plot(steps, [r.get("drafter/kl") for r in rows], ".", ms=3, color=f"C{c}", label=name)
    axes[0].axhline(COLD_GOAL, color="grey", lw=0.6, ls="--")
    axes[0].set(xlabel="step", ylabel="acceptance length (10-step mean)", title="the drafter while the policy trains")
    axes[1].set(xlabel="step", ylabel="KL(policy || drafter), rollout positions", title="online drafter training")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
