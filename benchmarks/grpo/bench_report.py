"""bench.py's report: the GRPO tables, the verdict and the plots, from the runs' figures."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.grpo.bench_runs import mean_or_none
from benchmarks.grpo.bench_variants import (
    OVERLAP_VARIANTS,
    PHASES,
    PRECISION_VARIANTS,
    TRAINER_VARIANTS,
    baseline_of,
    family,
)
from benchmarks.rollout.rollout_report import fmt


# ---- tables -----------------------------------------------------------------------
def grpo_table(stats: dict[str, dict]) -> str:
    def ratio(s, k):  # a speed-up over the variant's base: above 1 is faster
        base = stats.get(baseline_of(s["name"]), stats.get("grpo_base", {}))
        return fmt(base[k] / s[k] if base.get(k) and s.get(k) else None, "{:.2f}x")

    lines = [
        "| variant | speculation | step (s, median) | per seed | speed-up | step, train pooled (s) | speed-up | "
        "generation (s) | per seed | generation speed-up | train (s) | per seed | train speed-up (not speculation's: "
        "the machine's drift and the sampled work) | samples trained | refit (s) | validation (s) | gen tokens/s | "
        "acceptance length | reward first→last 10% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seeds = lambda s, k: ", ".join(f"{x:.2f}" for x in s.get(f"{k}_per_seed", [s[k]]))  # noqa: E731
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s.get('speculation', '')} | {s['step_s']:.2f} | {seeds(s, 'step_s')} | {ratio(s, 'step_s')} "
            f"| {fmt(s.get('step_pooled_s'), '{:.2f}')} | {ratio(s, 'step_pooled_s')} | {s['generation_s']:.2f} | "
            f"{seeds(s, 'generation_s')} | {ratio(s, 'generation_s')} | "
            f"{s['train_s']:.2f} | {seeds(s, 'train_s')} | {ratio(s, 'train_s')} | {s.get('train_samples', 0):.0f} | "
            f"{s['refit_s']:.2f} | {s['validation_s']:.2f} | "
            f"{s['gen_tokens_per_s']:.0f} | "
            f"{fmt(s['acceptance_length'], '{:.2f}')} | {s['reward_first']:.2f}→{s['reward_last']:.2f} |"
        )
    return "\n".join(lines)


def phase_table(stats: dict[str, dict]) -> str:
    lines = ["| variant | " + " | ".join(PHASES) + " | other |", "|---|" + "---|" * (len(PHASES) + 1)]
    for name, s in stats.items():
        tot = s["step_mean_s"]
        shares = [s[f"{p}_s"] / tot for p in PHASES]
        lines.append(f"| {name} | " + " | ".join(f"{x:.0%}" for x in shares) + f" | {max(1 - sum(shares), 0):.0%} |")
    return "\n".join(lines)


def tail_table(stats: dict[str, dict]) -> str:
    lines = [
        "| variant | 50% done (s) | 90% done (s) | 100% done (s) | 100% / 50% | last 10% of rollouts: share of the "
        "phase | longest / median length | generation phase (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        d50, d90, d100 = s["done50_s"], s["done90_s"], s["done100_s"]
        lines.append(
            f"| {name} | {fmt(d50, '{:.2f}')} | {fmt(d90, '{:.2f}')} | {fmt(d100, '{:.2f}')} | "
            f"{fmt(d100 / d50 if d50 and d100 else None, '{:.1f}x')} | "
            f"{fmt(s.get('last10_share'), '{:.0%}')} | {fmt(s.get('len_max_over_median'), '{:.1f}x')} | "
            f"{s['generation_s']:.2f} |"
        )
    return "\n".join(lines)


def staleness_table(rows: list[dict], buckets: int = 10) -> str:
    lines = [
        "| steps | acceptance rate | acceptance rate, position 1 | acceptance length | KL to start | train reward |",
        "|---|---|---|---|---|---|",
    ]
    n = len(rows)
    size = max(1, n // buckets)
    for i in range(0, n, size):
        b = rows[i : i + size]
        lines.append(
            f"| {b[0]['step']}–{b[-1]['step']} | {fmt(mean_or_none(b, 'spec_decode/acceptance_rate'), '{:.3f}')} | "
            f"{fmt(mean_or_none(b, 'spec_decode/acceptance_rate_pos_1'), '{:.3f}')} | "
            f"{fmt(mean_or_none(b, 'spec_decode/acceptance_length'), '{:.3f}')} | "
            f"{fmt(mean_or_none(b, 'train/kl'), '{:.4f}')} | "
            f"{fmt(mean_or_none(b, 'train/reward_mean'), '{:.2f}')} |"
        )
    return "\n".join(lines)


def peer_table(trl: dict, stats: dict[str, dict]) -> str:
    lines = [
        "| trainer | generation | step (s, median) | rollout (s, mean) | rollout tokens/s | steps measured |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("grpo_base", "grpo_spec"):
        if name in stats:
            s = stats[name]
            lines.append(
                f"| rl_specdec {name} | vLLM engine (Ray "
                f"actor){' + ' + s['speculation'] if s.get('speculation', 'none') != 'none' else ''} | "
                f"{s['step_s']:.2f} | {s['generation_s']:.2f} | {s['gen_tokens_per_s']:.0f} | "
                f"{s['steps']:.0f}{' x ' + str(len(s['seeds'])) + ' seeds' if len(s.get('seeds', [])) > 1 else ''} |"
            )
    t = trl["summary"]
    lines.append(
        f"| TRL {t['trl_version']} GRPOTrainer | {t['generation']} | {t['step_s']:.2f} | {t['generate_s']:.2f} | "
        f"{t['rollout_tokens_per_s']:.0f} | {t['steps_measured']} |"
    )
    return "\n".join(lines)


def verdict_text(stats: dict[str, dict]) -> str:
    """Each variant against the grpo_base with the same engine layout; the best
    speculative variant; a batch-size schedule against the best fixed k."""

    def base_name(n: str) -> str:
        return baseline_of(n) if baseline_of(n) in stats else "grpo_base"

    def ratio(n: str, k: str = "step_s") -> str:  # a speed-up: above 1 is faster
        return f"{stats[base_name(n)][k] / stats[n][k]:.2f}x faster than {base_name(n)}"

    spec = {
        n: s
        for n, s in stats.items()
        if s.get("speculation", "none") != "none" and n not in TRAINER_VARIANTS | PRECISION_VARIANTS | OVERLAP_VARIANTS
    }
    out = []
    groups = (
        ("one engine", {n: s for n, s in spec.items() if "2x1" not in n and not family(n)}),
        ("two engines", {n: s for n, s in spec.items() if "2x1" in n}),
        ("long-tail task", {n: s for n, s in spec.items() if family(n) == "longtail"}),
        ("wide pair", {n: s for n, s in spec.items() if family(n) == "wide"}),
    )
    for label, group in groups:
        if group:
            best = min(group, key=lambda n: group[n]["step_s"])
            out.append(
                f"Fastest speculative variant, {label}: **{best}** ({group[best]['speculation']}), "
                f"{group[best]['step_s']:.2f} s/step = "
                f"{ratio(best)}; train pooled {group[best]['step_pooled_s']:.2f} s = {ratio(best, 'step_pooled_s')}; "
                f"generation phase {group[best]['generation_s']:.2f} s = {ratio(best, 'generation_s')}."
            )
    one = {
        n: s
        for n, s in spec.items()
        if "2x1" not in n and not n.startswith("longtail") and s["speculation"].startswith("draft_model")
    }
    sched = {n: s for n, s in one.items() if "k by batch" in s["speculation"]}
    fixed = {n: s for n, s in one.items() if "k by batch" not in s["speculation"]}
    if sched and fixed:
        bf = min(fixed, key=lambda n: fixed[n]["step_s"])
        bs = min(sched, key=lambda n: sched[n]["step_s"])
        won = [sched[bs][k] < fixed[bf][k] for k in ("step_s", "step_pooled_s")]
        out.append(
            f"Batch-size schedule ({bs}) vs the best fixed k ({bf}): {sched[bs]['step_s']:.2f} vs "
            f"{fixed[bf]['step_s']:.2f} s/step, "
            f"train pooled {sched[bs]['step_pooled_s']:.2f} vs {fixed[bf]['step_pooled_s']:.2f} s, "
            f"generation {sched[bs]['generation_s']:.2f} vs {fixed[bf]['generation_s']:.2f} s "
            f"({'the schedule wins' if all(won) else 'fixed k wins' if not any(won) else 'no clear winner'})."
        )
    return " ".join(out)


def policy_workers_text(stats: dict[str, dict]) -> str:
    two, one = stats["grpo_spec policy 2x"], stats["grpo_spec"]
    return (
        f"Two policy workers (DDP over gloo, the same update as one) against one, grpo_spec: {two['step_s']:.2f} vs "
        f"{one['step_s']:.2f} s/step, "
        f"train phase {two['train_s']:.2f} vs {one['train_s']:.2f} s, refit {two['refit_s']:.2f} vs "
        f"{one['refit_s']:.2f} s."
    )


# ---- plots --------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grpo(runs: dict[str, list[dict]], stats: dict[str, dict], path: Path) -> None:
    """Left: median step and mean generation time per variant. Right: the mean per-phase split."""
    plt = _plt()
    names = list(stats)
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(names) + 2.2), sharey=True)
    y = list(range(len(names)))
    axes[0].barh([i - 0.2 for i in y], [stats[n]["step_s"] for n in names], height=0.4, label="step (median)")
    axes[0].barh(
        [i + 0.2 for i in y], [stats[n]["generation_s"] for n in names], height=0.4, label="generation phase (mean)"
    )
    if "grpo_base" in stats:
        axes[0].axvline(stats["grpo_base"]["step_s"], color="grey", ls="--", lw=1)
        axes[0].axvline(stats["grpo_base"]["generation_s"], color="grey", ls=":", lw=1)
    axes[0].set(
        yticks=y, yticklabels=names, xlabel="seconds", title="GRPO step and generation time (dashed: grpo_base)"
    )
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7, loc="lower right")
    left = [0.0] * len(names)
    for p in PHASES:
        vals = [stats[n][f"{p}_s"] for n in names]
        axes[1].barh(y, vals, left=left, label=p)
        left = [a + v for a, v in zip(left, vals)]
    axes[1].set(xlabel="mean seconds per step", title="per-phase split")
    axes[1].legend(fontsize=7, loc="lower right")
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tail(runs: dict[str, list[dict]], stats: dict[str, dict], path: Path) -> None:
    """Left: mean time until 50/90/100% of a step's rollouts were done.

    Right: the 100% time per step of one seed (10-step mean).
    """
    plt = _plt()
    names = [
        n
        for n in runs
        if runs[n] and runs[n][0].get("generation/time_to_100pct_done") is not None and stats[n].get("done100_s")
    ]
    if not names:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.3 * len(names) + 2.6))
    y = list(range(len(names)))
    for off, pct in ((-0.27, 50), (0.0, 90), (0.27, 100)):
        axes[0].barh([i + off for i in y], [stats[n][f"done{pct}_s"] for n in names], height=0.27, label=f"{pct}% done")
    axes[0].set(
        yticks=y,
        yticklabels=names,
        xlabel="seconds into the generation step (mean over steps after the first)",
        title="when the rollouts finished",
    )
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7, loc="lower right")
    for n in names:
        rows = runs[n]
        axes[1].plot(
            [r["step"] for r in rows],
            _rolling([r["generation/time_to_100pct_done"] for r in rows], 10),
            label=n,
            lw=2 if n in ("grpo_base", "grpo_spec") else 1,
        )
    axes[1].set(
        xlabel="step",
        ylabel="seconds until 100% done (10-step mean)",
        title=f"the last rollout of each step (seed {stats[names[0]]['seeds'][0]})",
    )
    axes[1].legend(fontsize=6, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(rows: list[dict], path: Path) -> None:
    plt = _plt()
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    acc = [r.get("spec_decode/acceptance_rate") for r in rows]
    length = [r.get("spec_decode/acceptance_length") for r in rows]
    axes[0].plot(steps, acc, ".", ms=3, alpha=0.5, label="per step")
    axes[0].plot(steps, _rolling(acc, 10), "-", label="10-step mean")
    axes[0].plot(
        steps,
        _rolling([r.get("spec_decode/acceptance_rate_pos_1") for r in rows], 10),
        "-",
        label="position 1 (10-step mean)",
    )
    axes[0].set(xlabel="step", ylabel="acceptance rate", title="frozen drafter vs drifting policy")
    ax2 = axes[0].twinx()
    ax2.plot(steps, _rolling(length, 10), "r-", lw=0.8)
    ax2.set_ylabel("acceptance length (10-step mean)", color="r")
    axes[0].legend(fontsize=7)
    kl = [r.get("train/kl") for r in rows]
    # the k3 KL estimate on sampled tokens is heavy-tailed: a rolling median, and the
    # axis cut at the 98th percentile (the few steps above it are noted in the legend)
    shown = sorted(x for x in kl if x is not None)
    top = shown[int(0.98 * (len(shown) - 1))] * 1.3 if shown else None
    above = sum(1 for x in shown if top is not None and x > top)
    axes[1].plot(steps, kl, ".", ms=3, alpha=0.5, label="per step" + (f" ({above} above the axis)" if above else ""))
    axes[1].plot(steps, _rolling(kl, 10, statistics.median), "-", label="10-step median")
    if top:
        axes[1].set_ylim(0, top)
    axes[1].legend(fontsize=7)
    axes[1].set(xlabel="step", ylabel="KL(policy || start)", title="policy drift")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rolling(xs: list, w: int, stat=statistics.fmean) -> list:
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - w + 1) : i + 1] if x is not None]
        out.append(stat(win) if win else None)
    return out
