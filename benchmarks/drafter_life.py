"""The drafter over a long run: frozen against trained online, and a cold start.

The ``staleness`` section of ``bench.py``: three GRPO runs of the default
config on the same seed, which differ only in the drafter:

frozen
    ``configs/grpo_spec.yaml`` as shipped: the toy drafter, distilled from the
    initial policy, never refit.
online
    the same, with ``policy.generation.drafter_training.enabled=true``: after
    every step the drafter is distilled on that step's rollouts against the
    policy's top-k log-probs and refit into the engine.
cold start
    online training from a drafter of the right shape with random weights
    (``toy:drafter-untrained``), for ``--cold-steps`` steps.

The cost of online training is measured by the ``grpo`` section (variant
``grpo_spec drafter online``, every seed), not here: one seed's step times
swing too much to carry a 5% claim.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rollout import fmt

SPEC = "policy.generation.vllm_kwargs.speculative_config"
ONLINE = "policy.generation.drafter_training.enabled=true"
RUNS: dict[str, tuple[str, list[str]]] = {
    "frozen": ("configs/grpo_spec.yaml", []),
    "online": ("configs/grpo_spec.yaml", [ONLINE]),
    "cold start": ("configs/grpo_spec.yaml", [ONLINE, f"{SPEC}.model=toy:drafter-untrained"]),
}
COLD_GOAL = 2.5  # acceptance length the cold start should reach within 50 steps


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _buckets(rows: list[dict], size: int) -> list[list[dict]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def staleness_table(frozen: list[dict], online: list[dict], size: int = 20) -> str:
    """Acceptance length and rate per ``size``-step bucket, frozen and online side by side."""
    lines = [
        "| steps | acceptance length, frozen | acceptance length, online | online / frozen | acceptance rate, frozen | acceptance rate, online | drafter KL (online) | policy KL to start (frozen, online) | train reward (frozen, online) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f, o in zip(_buckets(frozen, size), _buckets(online, size)):
        lf, lo = _mean(f, "spec_decode/acceptance_length"), _mean(o, "spec_decode/acceptance_length")
        lines.append(
            f"| {f[0]['step']}–{f[-1]['step']} | {fmt(lf, '{:.3f}')} | {fmt(lo, '{:.3f}')} | {fmt(lo / lf if lf and lo else None, '{:.3f}x')} | "
            f"{fmt(_mean(f, 'spec_decode/acceptance_rate'), '{:.3f}')} | {fmt(_mean(o, 'spec_decode/acceptance_rate'), '{:.3f}')} | "
            f"{fmt(_mean(o, 'drafter/kl'), '{:.3f}')} | {fmt(_mean(f, 'train/kl'), '{:.3f}')}, {fmt(_mean(o, 'train/kl'), '{:.3f}')} | "
            f"{fmt(_mean(f, 'train/reward_mean'), '{:.2f}')}, {fmt(_mean(o, 'train/reward_mean'), '{:.2f}')} |"
        )
    return "\n".join(lines)


def staleness_verdict(frozen: list[dict], online: list[dict], size: int = 20) -> str:
    out = []
    for name, rows in (("frozen", frozen), ("online", online)):
        first, last = _mean(rows[:size], "spec_decode/acceptance_length"), _mean(rows[-size:], "spec_decode/acceptance_length")
        if first and last:
            out.append(f"{name}: acceptance length {first:.3f} in steps 1–{size}, {last:.3f} in the last {size} steps ({last / first:.3f}x)")
    return "; ".join(out) + "."


def cold_table(rows: list[dict], size: int = 5) -> str:
    """Acceptance length per ``size``-step bucket from an untrained drafter, and when it first reaches the goal."""
    lines = ["| steps | acceptance length | acceptance rate | drafter loss | drafter KL |", "|---|---|---|---|---|"]
    for b in _buckets(rows, size):
        lines.append(
            f"| {b[0]['step']}–{b[-1]['step']} | {fmt(_mean(b, 'spec_decode/acceptance_length'), '{:.3f}')} | "
            f"{fmt(_mean(b, 'spec_decode/acceptance_rate'), '{:.3f}')} | {fmt(_mean(b, 'drafter/loss'), '{:.3f}')} | {fmt(_mean(b, 'drafter/kl'), '{:.3f}')} |"
        )
    reached = next((b[-1]["step"] for b in _buckets(rows, size) if (m := _mean(b, "spec_decode/acceptance_length")) and m >= COLD_GOAL), None)
    lines.append("")
    lines.append(
        f"First {size}-step bucket with a mean acceptance length of {COLD_GOAL} or more: "
        + (f"steps up to {reached}." if reached else f"none in {len(rows)} steps.")
    )
    return "\n".join(lines)


def cost_text(stats: dict[str, dict]) -> str:
    """Online drafter training against the frozen drafter and grpo_base, from the grpo section (every seed)."""
    on, fr, base = stats.get("grpo_spec drafter online"), stats.get("grpo_spec"), stats.get("grpo_base")
    if not (on and fr):
        return "_run the grpo section with the variants grpo_spec and 'grpo_spec drafter online' for the cost._"
    text = (
        f"Online drafter training, median step {on['step_s']:.2f} s against {fr['step_s']:.2f} s frozen ({on['step_s'] / fr['step_s']:.3f}x; "
        f"train pooled {on['step_pooled_s']:.2f} vs {fr['step_pooled_s']:.2f} s, {on['step_pooled_s'] / fr['step_pooled_s']:.3f}x); "
        f"generation {on['generation_s']:.2f} vs {fr['generation_s']:.2f} s; acceptance length {fmt(on['acceptance_length'], '{:.2f}')} vs {fmt(fr['acceptance_length'], '{:.2f}')}."
    )
    if base:
        text += f" Against grpo_base: {on['step_s'] / base['step_s']:.3f}x (frozen {fr['step_s'] / base['step_s']:.3f}x)."
    return text


def plot(series: dict[str, list[dict]], path: Path, plt) -> None:
    """Acceptance length per step (10-step mean) of each run, and the online drafter's KL to the policy."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for name, rows in series.items():
        steps = [r["step"] for r in rows]
        length = [r.get("spec_decode/acceptance_length") for r in rows]
        axes[0].plot(steps, [statistics.fmean(x for x in length[max(0, i - 9) : i + 1] if x is not None) for i in range(len(length))], label=name)
        if any(r.get("drafter/kl") is not None for r in rows):
            axes[1].plot(steps, [r.get("drafter/kl") for r in rows], ".", ms=3, label=name)
    axes[0].axhline(COLD_GOAL, color="grey", lw=0.6, ls="--")
    axes[0].set(xlabel="step", ylabel="acceptance length (10-step mean)", title="the drafter while the policy trains")
    axes[1].set(xlabel="step", ylabel="KL(policy || drafter), rollout positions", title="online drafter training")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
