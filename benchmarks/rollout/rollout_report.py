"""The tables and the plot of ``benchmarks/rollout/rollout.py``: tokens per second per method, k, temperature and
batch size, as speed-ups over no speculation measured in the same run, and one engine against one per core."""

from __future__ import annotations

from pathlib import Path

METHODS = ("none", "draft_model", "ngram", "suffix", "draft_model_schedule")


def fmt(x, spec="{:.3f}"):
    return "-" if x is None else spec.format(x)


def method_table(rows: list[dict]) -> str:
    base = {(r["temperature"], r["batch"]): r["tok_per_s"] for r in rows if r["method"] == "none"}
    lines = [
        "| method | k | T | batch | time/call (s) | tokens/call | tokens/s | acceptance rate | acceptance length | "
        "speed-up vs none |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["temperature"], r["batch"], METHODS.index(r["method"]), r.get("k") or 0)):
        b = base.get((r["temperature"], r["batch"]))
        k = "sched" if r["method"] == "draft_model_schedule" else ("-" if r.get("k") is None else r["k"])
        lines.append(
            f"| {r['method']} | {k} | {r['temperature']:g} | {r['batch']} | {r['time_s']:.3f} | {r['tokens']:.0f} | "
            f"{r['tok_per_s']:.0f} | "
            f"{fmt(r['acceptance_rate'], '{:.2f}')} | {fmt(r['acceptance_length'], '{:.2f}')} | "
            f"{fmt(r['tok_per_s'] / b if b else None, '{:.2f}x')} |"
        )
    return "\n".join(lines)


def speedup_table(rows: list[dict]) -> str:
    """The same runs as ``method_table`` at a glance: one row per (method, k), one
    column per (temperature, batch); each cell is tokens/s over no speculation."""
    base = {(r["temperature"], r["batch"]): r["tok_per_s"] for r in rows if r["method"] == "none"}
    cols = sorted(base)
    keyed = {}
    for r in rows:
        if r["method"] != "none":
            k = "sched" if r["method"] == "draft_model_schedule" else r.get("k")
            keyed.setdefault((METHODS.index(r["method"]), str(k), r["method"]), {})[(r["temperature"], r["batch"])] = r
    lines = [
        "| method | k | " + " | ".join(f"T={t:g} b={b}" for t, b in cols) + " | acceptance length (T=1, b=64) |",
        "|---|---|" + "---|" * (len(cols) + 1),
    ]
    for (_, k, method), cells in sorted(keyed.items()):
        acc = cells.get((1.0, 64), {}).get("acceptance_length")
        lines.append(
            f"| {method} | {k} | "
            + " | ".join(
                fmt(cells[c]["tok_per_s"] / base[c] if c in cells and base[c] else None, "{:.2f}x") for c in cols
            )
            + f" | {fmt(acc, '{:.2f}')} |"
        )
    return "\n".join(lines)


def engines_table(rows: list[dict]) -> str:
    base = {(r["method"], r["temperature"]): r["tok_per_s"] for r in rows if r["engines"] == 1}
    lines = [
        "| method | T | engines x cores | batch | time/call (s) | tokens/s | per-engine time (s) | vs 1 engine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["method"], r["temperature"], r["engines"])):
        b = base.get((r["method"], r["temperature"]))
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['engines']} x {r['cores']} | {r['batch']} | "
            f"{r['time_s']:.3f} | "
            f"{r['tok_per_s']:.0f} | {', '.join(f'{t:.2f}' for t in r['per_engine_time_s'])} | "
            f"{fmt(r['tok_per_s'] / b if b else None, '{:.2f}x')} |"
        )
    return "\n".join(lines)


def engines_verdict(rows: list[dict]) -> str:
    """One line per (method, T): is one engine per core at least as fast as one engine on all cores?"""
    out = []
    one = {(r["method"], r["temperature"]): r for r in rows if r["engines"] == 1}
    for r in rows:
        b = one.get((r["method"], r["temperature"]))
        if r["engines"] == 1 or b is None:
            continue
        ratio = r["tok_per_s"] / b["tok_per_s"]
        verdict = "not slower" if ratio >= 0.95 else "SLOWER"
        out.append(
            f"- {r['method']}, T={r['temperature']:g}: {r['engines']} engines x {r['cores']} core = "
            f"{r['tok_per_s']:.0f} tok/s, "
            f"1 engine x {b['cores']} cores = {b['tok_per_s']:.0f} tok/s: {ratio:.2f}x ({verdict})"
        )
    return "\n".join(out)


def plot_methods(rows: list[dict], path: Path) -> None:
    """Speed-up over no speculation against batch size: one panel per (temperature, method), one line per k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    base = {(r["temperature"], r["batch"]): r["tok_per_s"] for r in rows if r["method"] == "none"}
    panels = [m for m in ("draft_model", "ngram", "suffix") if any(r["method"] == m for r in rows)]
    if not panels or not base:
        return
    fig, axes = plt.subplots(
        len(temps), len(panels), figsize=(4.6 * len(panels), 3.4 * len(temps)), squeeze=False, sharey=True
    )
    for i, temp in enumerate(temps):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            members = [panel] + (["draft_model_schedule"] if panel == "draft_model" else [])
            keys = sorted(
                {(r["method"], r.get("k") or 0) for r in rows if r["method"] in members}, key=lambda x: (x[0], x[1])
            )
            for method, k in keys:
                pts = sorted(
                    (r["batch"], r["tok_per_s"] / base[(temp, r["batch"])])
                    for r in rows
                    if r["temperature"] == temp
                    and r["method"] == method
                    and (r.get("k") or 0) == k
                    and (temp, r["batch"]) in base
                )
                label = "schedule" if method == "draft_model_schedule" else f"k={k}"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    "k--" if method == "draft_model_schedule" else "-",
                    marker="o",
                    ms=3,
                    label=label,
                )
            ax.axhline(1.0, color="grey", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{panel}, T={temp:g}", fontsize=10)
            ax.grid(alpha=0.3)
            if i == len(temps) - 1:
                ax.set_xlabel("batch size (prompts per call)")
            if j == 0:
                ax.set_ylabel("tokens/s vs no speculation")
            ax.legend(fontsize=7)
    fig.suptitle("rollout speed-up over no speculation (one engine, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
