"""Render a run's curves from metrics.jsonl, for people without wandb.

    python -m rl_specdec.plot LOG_DIR [LOG_DIR ...] [--out FILE.png] [--summary]

Panels: reward and accuracy, spec-decode acceptance rate and length (with the
per-position acceptance rates), time per phase, the log-prob mismatch
between generation and training, and (with run-time k) the k each
batch-size bucket ran per step. Several log dirs are overlaid (e.g.
grpo_spec against grpo_base).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(log_dir: str | Path) -> list[dict]:
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the logger.log_dir of a run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict], key: str):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(log_dirs: list[str], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(d).name: read_metrics(d) for d in log_dirs}
    fig, axes = plt.subplots(2, 4, figsize=(21, 8.5))
    ax = axes.ravel()
    for name, rows in runs.items():
        x, y = _series(rows, "train/reward_mean")
        ax[0].plot(x, y, label=f"{name} train reward")
        x, y = _series(rows, "val/accuracy")
        if x:
            ax[0].plot(x, y, "o--", label=f"{name} val accuracy")
        x, y = _series(rows, "spec_decode/acceptance_rate")
        if x:
            ax[1].plot(x, y, label=f"{name} acceptance rate")
            i = 1
            while any(f"spec_decode/acceptance_rate_pos_{i}" in r for r in rows):
                xs, ys = _series(rows, f"spec_decode/acceptance_rate_pos_{i}")
                ax[1].plot(xs, ys, ":", label=f"{name} rate pos {i}")
                i += 1
            xs, ys = _series(rows, "spec_decode/acceptance_length")
            ax[2].plot(xs, ys, label=f"{name} acceptance length")
        for phase in ("generation", "train", "refit", "reward", "validation"):
            xs, ys = _series(rows, f"timing/{phase}")
            if xs:
                ax[3].plot(xs, ys, label=f"{name} {phase}")
        x, y = _series(rows, "train/logprob_mismatch")
        ax[4].plot(x, y, label=f"{name} mean |logp_train - logp_gen|")
        x, y = _series(rows, "generation/tokens_per_s")
        ax[5].plot(x, y, label=f"{name} generation tok/s")
        _k_per_bucket(ax[6], name, rows)
    titles = [
        "reward / accuracy",
        "spec_decode acceptance rate",
        "spec_decode acceptance length",
        "time per phase (s)",
        "log-prob mismatch (on-policy check)",
        "rollout throughput",
        "k per batch-size bucket (run-time k)",
    ]
    ax[7].axis("off")
    for a, t in zip(ax, titles):
        a.set_title(t)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _k_per_bucket(ax, name: str, rows: list[dict]) -> None:
    """The k each batch-size bucket ran per step (``spec_decode/k_bucket_{lo}_{hi}``), one line per bucket."""
    keys = sorted({k for r in rows for k in r if k.startswith("spec_decode/k_bucket_")}, key=_bucket_lo)
    for key in keys:
        x, y = _series(rows, key)
        lo, hi = key.rsplit("_", 2)[-2:]
        ax.plot(x, y, drawstyle="steps-post", label=f"{name} {lo}-{hi} running")


def _bucket_lo(key: str) -> int:
    return int(key.rsplit("_", 2)[-2])


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(log_dir: str) -> str:
    """A markdown summary of a run: reward first vs last 10% of steps, time split, acceptance."""
    all_rows = read_metrics(log_dir)
    rows = [r for r in all_rows if r["step"] > 0]
    n = len(rows)
    k = max(1, n // 10)
    first, last = rows[:k], rows[-k:]
    total = sum(r.get("timing/step", 0.0) for r in rows)
    lines = [
        f"run: {log_dir} ({n} steps, {total:.0f} s in steps, {total / max(n, 1):.2f} s/step)",
        "",
        "| | first 10% of steps | last 10% of steps |",
        "| --- | --- | --- |",
    ]
    for key in (
        "train/reward_mean",
        "train/accuracy",
        "spec_decode/acceptance_rate",
        "spec_decode/acceptance_length",
        "train/logprob_mismatch",
    ):
        if any(key in r for r in rows):
            lines.append(
                f"| {key} | {_mean([r.get(key) for r in first]):.4g} | {_mean([r.get(key) for r in last]):.4g} |"
            )
    vals = [(r["step"], r["val/accuracy"]) for r in all_rows if "val/accuracy" in r]
    if vals:
        lines.append(
            f"| val/accuracy | {vals[0][1]:.3f} (step {vals[0][0]}) | {vals[-1][1]:.3f} (step {vals[-1][0]}) |"
        )
    phases = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    lines += ["", "| phase | total s | share of step time |", "| --- | --- | --- |"]
    for ph in phases:
        t = sum(r.get(ph, 0.0) for r in rows)
        lines.append(f"| {ph} | {t:.1f} | {100 * t / max(total, 1e-9):.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_dirs", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: <first log dir>/curves.png)")
    p.add_argument("--summary", action="store_true", help="also print a markdown summary of each run")
    a = p.parse_args(argv)
    try:
        if a.summary:
            for d in a.log_dirs:
                print(summarize(d), end="\n\n")
        out = plot(a.log_dirs, a.out or str(Path(a.log_dirs[0]) / "curves.png"))
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
