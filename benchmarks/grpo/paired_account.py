"""The paired benchmark's accounting: what each variant's step costs, and the ratios against the baseline.

A step of the trained run holds, besides every variant's generation (timed apart), the phases all variants
share (prompts, rewards, the policy's update, its refit) and the trained variant's drafter work: the head's
part of the update (measured apart: the update's forwards and backwards run once more without the head, on the
same batch, and the difference is the head's, with its optimizer step), the drafter's wait and its refit.
A variant's step is the shared part, its own generation and its own drafter work; the baseline, and any variant
whose drafter does not train, pay no drafter work. Only the trained variant's drafter trains (the benchmark
refuses any other that would), so it is the only one charged.

Pure arithmetic on the rows of :func:`step_rows`; no engine, no torch.
"""

from __future__ import annotations

import math
import statistics


def drafter_seconds(row: dict, head_free_forward_backward_s: float | None) -> float:
    """The trained run's drafter work in one step, from the step's metrics ``row``: the head's part of the
    update when ``head_free_forward_backward_s`` (the same batch's forwards and backwards without the head) is
    given, plus the drafter's wait and refit. A draft model that overlaps the policy's update is charged only the
    part it keeps the step waiting."""
    s = row.get("timing/drafter_wait", 0.0) + row.get("timing/drafter_refit", 0.0)
    if head_free_forward_backward_s is not None and "train/forward_backward_s" in row:
        s += max(0.0, row["train/forward_backward_s"] - head_free_forward_backward_s)
        s += row.get("drafter/optimizer_s", 0.0)
    return s


def step_rows(calls: list[dict[str, dict]], walls: list[float], drafter: list[float], trained: str) -> list[dict]:
    """Per step: every variant's generation (``s``) and drafter work (``drafter_s``: the trained one's, 0 for
    the others), and the shared rest (``shared_s``: the step's wall time, less the work done only for the
    benchmark, less every generation, less the drafter's work)."""
    rows = []
    for i, (rec, wall, d) in enumerate(zip(calls, walls, drafter)):
        shared = wall - sum(v["s"] for v in rec.values()) - d
        per_variant = {n: {**v, "drafter_s": d if n == trained else 0.0} for n, v in rec.items()}
        rows.append({"step": i + 1, "shared_s": shared, **per_variant})
    return rows


def step_s(row: dict, name: str) -> float:
    """One variant's step: the shared phases, its generation, its drafter's work."""
    return row["shared_s"] + row[name]["s"] + row[name]["drafter_s"]


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high): a 95% t-interval on the log ratios (the point itself for one ratio)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), math.exp(m), math.exp(m)
    from scipy.stats import t

    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def ratios(rows: list[dict], base: str, name: str) -> dict:
    """Pooled ratios of ``name`` against ``base`` (higher is faster), Amdahl's bound and generation's share."""
    gen_b, gen_n = sum(r[base]["s"] for r in rows), sum(r[name]["s"] for r in rows)
    step_b, step_n = sum(step_s(r, base) for r in rows), sum(step_s(r, name) for r in rows)
    drafter_n = sum(r[name]["drafter_s"] for r in rows)
    g = gen_b / gen_n
    share = gen_b / step_b
    return {
        "generation": g,
        "step": step_b / step_n,
        "generation_share": share,
        "drafter_share": drafter_n / step_b,  # the variant's drafter work, in the baseline's step
        "drafter_s_per_step": drafter_n / len(rows),
        # Amdahl's law from generation's share of the baseline's step, with the variant's drafter work on top
        "amdahl_bound": 1 / ((1 - share) + share / g + (drafter_n - sum(r[base]["drafter_s"] for r in rows)) / step_b),
        # the most any generation speed-up could give, the drafter's work still paid
        "ceiling": step_b / (step_b - gen_b - sum(r[base]["drafter_s"] for r in rows) + drafter_n),
        # the accounting this replaced: the trained run's drafter work in every variant's step
        "step_drafter_shared": sum(r["shared_s"] + trained_drafter(r) + r[base]["s"] for r in rows)
        / sum(r["shared_s"] + trained_drafter(r) + r[name]["s"] for r in rows),
    }


def trained_drafter(row: dict) -> float:
    return sum(v["drafter_s"] for v in row.values() if isinstance(v, dict) and "drafter_s" in v)


def _length(counter_dicts) -> float | None:
    from benchmarks.rollout.batch_sweep import add_counter
    from rl_specdec.metrics import compute_spec_decode_metrics

    counters: dict = {}
    for c in counter_dicts:
        for key, v in c.items():
            counters[key] = add_counter(counters.get(key), v)
    return compute_spec_decode_metrics(None, counters).get("spec_decode/acceptance_length") if counters else None


def acceptance_length(rows: list[dict], name: str) -> float | None:
    return _length(r[name]["counters"] for r in rows)


def acceptance_per_turn(rows: list[dict], name: str) -> list[float | None]:
    """The acceptance length of each turn index over the rows (episodes: each turn's own counters; [] else)."""
    per_row = [r[name].get("turn_counters", []) for r in rows]
    return [_length(t[i] for t in per_row if len(t) > i) for i in range(max(map(len, per_row), default=0))]


def summarise(rows_by_seed: dict[int, list[dict]], names: list[str]) -> list[dict]:
    """Per variant (but the baseline): generation and step speed-ups per step (interval), per seed (pooled)
    and overall, the Amdahl bound, the drafter's work, tokens and acceptance length."""
    base, out = names[0], []
    rows = [r for rs in rows_by_seed.values() for r in rs]
    for n in names[1:]:
        out.append(
            {
                "variant": n,
                "steps": len(rows),
                **ratios(rows, base, n),
                "generation_per_step": interval([r[base]["s"] / r[n]["s"] for r in rows]),
                "generation_per_seed": {s: ratios(rs, base, n)["generation"] for s, rs in rows_by_seed.items()},
                "step_per_step": interval([step_s(r, base) / step_s(r, n) for r in rows]),
                "tokens": (sum(r[base]["tokens"] for r in rows), sum(r[n]["tokens"] for r in rows)),
                "acceptance_length": acceptance_length(rows, n),
                "acceptance_per_turn": acceptance_per_turn(rows, n),
            }
        )
    return out


def table(summary: list[dict], base: str) -> str:
    head = (
        f"| variant (against {base}) | generation: pooled | per step (95% CI) | per seed | step, costs in: pooled "
        "| per step (95% CI) | Amdahl bound (gen. share) | drafter s/step (share) | tokens (base / variant) | L |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in summary:
        g, st = s["generation_per_step"], s["step_per_step"]
        seeds = ", ".join(f"{v:.2f}x" for v in s["generation_per_seed"].values())
        acc = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "–"
        if any(s.get("acceptance_per_turn") or []):  # episodes: each turn's, in order
            acc += " (turns " + ", ".join(f"{v:.2f}" if v else "–" for v in s["acceptance_per_turn"]) + ")"
        lines.append(
            f"| {s['variant']} | **{s['generation']:.2f}x** | {g[0]:.2f}x ({g[1]:.2f}-{g[2]:.2f}) | {seeds} "
            f"| **{s['step']:.2f}x** | {st[0]:.2f}x ({st[1]:.2f}-{st[2]:.2f}) "
            f"| {s['amdahl_bound']:.2f}x ({100 * s['generation_share']:.0f}%) "
            f"| {s['drafter_s_per_step']:.2f} ({100 * s['drafter_share']:.0f}%) "
            f"| {s['tokens'][0]} / {s['tokens'][1]} | {acc} |"
        )
    return "\n".join(lines)


LENGTHS = ("median", "p90", "max")  # of the trained run's rollouts, each step (its metrics row)


def lengths_line(rows_by_seed: dict[int, list[dict]]) -> str:
    """The trained run's rollout lengths by step, per seed: how long-tailed each step's calls were."""
    per_seed = [
        f"seed {s}: " + ", ".join("/".join(f"{v:.0f}" for v in r["lengths"]) for r in rs if r.get("lengths"))
        for s, rs in rows_by_seed.items()
    ]
    return "rollout length (tokens) median/p90/max by step, trained run: " + "; ".join(per_seed)


def builds_line(builds: dict[str, float | None], machine: str) -> str:
    """Each variant's models' first-use build, once, apart from the steps: seconds, or unknown for a folder
    built before build times were kept."""
    parts = [f"{name} {f'{s:.0f} s' if s is not None else 'not recorded'}" for name, s in builds.items()]
    return f"first-use builds (once per cache, not in any step; {machine}): " + ("; ".join(parts) or "none")
