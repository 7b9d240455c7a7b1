"""Generation time per token of the longest rollout: the pooled columns for workloads whose tail is sampled.

On the long-tail and wide workloads the policy samples how long each rollout runs, and the longest one of a
step sets how long its generation phase takes. Which lengths a run draws is chance (lossless speculation
samples the same distribution, not the same tokens), and over a few steps it moves the generation phase by
more than speculation does. This table divides it out: per run, generation seconds over the summed length of
each step's longest rollout (ms per longest-rollout token, the cost speculation changes), then that rate
times the mean longest length of every variant of the workload (the length all of them draw in expectation).
The last column also puts back the train phase pooled over the workload (``step_pooled_s``, bench.py)::

    python -m benchmarks.grpo.bench --sections grpo --steps 6 --seeds 0,1 --set grpo.num_prompts_per_step=2 \\
        --variants "wide base;wide k=4;wide schedule corrected;wide adaptive"
"""

from __future__ import annotations

import statistics

from benchmarks.rollout.rollout_report import fmt


def per_run(rows: list[dict]) -> dict:
    """The longest rollout's mean length and the generation seconds per token of it, over ``rows``."""
    lens = [r.get("generation/response_length_max") for r in rows]
    if not rows or any(x is None for x in lens) or not sum(lens):
        return {"longest_len": None, "gen_s_per_longest_token": None}
    gen = sum(r["timing/generation"] for r in rows)
    return {"longest_len": statistics.fmean(lens), "gen_s_per_longest_token": gen / sum(lens)}


def length_pooled_table(stats: dict[str, dict], family, baseline_of) -> str:
    """A row per variant of a sampled-tail workload (``family`` "longtail" or "wide"); "" when none ran.

    Speed-up is the baseline's time over the variant's: above 1 where speculation pays."""
    names = [n for n in stats if family(n) in ("longtail", "wide") and stats[n].get("gen_s_per_longest_token")]
    if not names:
        return ""
    fams = {family(n) for n in names}
    pooled_len = {f: statistics.fmean(stats[n]["longest_len"] for n in names if family(n) == f) for f in fams}
    lines = [
        "| variant | longest rollout (tokens, mean over steps) | generation ms per longest-rollout token | speed-up "
        "| generation, length pooled (s) | speed-up | step, train and length pooled (s) | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    derived = {}
    for n in names:
        s = stats[n]
        gen = s["gen_s_per_longest_token"] * pooled_len[family(n)]
        step = s["step_pooled_s"] - s["generation_s"] + gen
        derived[n] = {"rate": s["gen_s_per_longest_token"], "gen": gen, "step": step}
    for n in names:
        base = derived.get(baseline_of(n))
        ratio = lambda k: fmt(base[k] / derived[n][k] if base else None, "{:.2f}x")  # noqa: E731  speed-up
        d = derived[n]
        lines.append(
            f"| {n} | {stats[n]['longest_len']:.0f} | {d['rate'] * 1e3:.2f} | {ratio('rate')} | {d['gen']:.2f} | "
            f"{ratio('gen')} | {d['step']:.2f} | {ratio('step')} |"
        )
    return "\n".join(lines)
