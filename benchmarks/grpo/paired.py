"""Paired GRPO: one training trajectory, and at every step every variant generates from the same weights and the
same prompts. What a speed-up of GRPO is measured with when chance must not decide it.

Two runs with different configs diverge after step 1, each training on its own samples, so their rollout
lengths and train phases differ by chance. Here one run trains (``--trained``, the first variant by default):
its engines' rollouts are the ones trained on. Every other variant is an engine group of its own config. It
takes every refit the run's engines take (the same buckets, verified), so at every step all variants hold the
trainer's weights, and it generates every rollout call of the step: the same prompts, the same sampling settings
and seeds, in an order that rotates by step. Validation runs on the trained run's engines alone.

The phases other than generation (rewards, the update, the refit, the drafter's upkeep) are the trained run's,
and shared: a variant's step is that time plus its own generation. So a step's ratio is what the variant's
generation changes, and nothing else. Per variant, against the baseline (the first variant):

* the generation speed-up of each step (the baseline's seconds over the variant's) and of each seed (pooled:
  seconds summed over steps), with a 95% interval over the steps of all seeds (a t-interval on log ratios);
* the step speed-up, and the bound Amdahl's law sets on it from generation's share of the baseline's step;
* generated tokens (lossless in distribution, not sample by sample: they differ by chance), acceptance length.

and, per step, the trained run's rollout lengths (median, p90, max): how much of each call is a long tail.

::

    python -m benchmarks paired --seeds 0,1 --steps 4      # the real model: none against configs/smollm2_spec.yaml

Writes ``paired.json`` (every step of every variant) and ``paired.md`` to ``--out`` (results/paired).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks import bench_common
from benchmarks.bench_common import log
from benchmarks.rollout.batch_sweep import KV, add_counter, variants_or_exit

DEFAULT_VARIANTS = "none: configs/smollm2_base.yaml; shipped: configs/smollm2_spec.yaml"
# the trained run: no validation and no checkpoints (neither is timed), no pipelining (the steps must be whole)
TRAINED = ["grpo.val_every=0", "checkpoint.enabled=false", "logger.wandb.enabled=false", "grpo.max_staleness=0"]


class PairedGeneration:
    """The trained run's engine group in its place, with the other variants' groups beside it: every refit goes
    to all of them, and every rollout call (temperature > 0) runs on all of them, timed; the trained group's
    output is the one returned. Anything else is the trained group's."""

    def __init__(self, trained_name: str, trained, others: dict):
        self.groups = {trained_name: trained, **others}
        self.trained_name, self.trained = trained_name, trained
        self.calls: list[dict[str, dict]] = []  # per rollout call: variant -> {s, tokens, counters}
        self.others_refit_s = 0.0  # seconds the other groups' refits took (not the trained run's work)

    def generate(self, prompt_token_ids, sampling):
        if sampling.temperature == 0:  # validation: the trained run's, untimed here
            return self.trained.generate(prompt_token_ids, sampling)
        names = list(self.groups)
        shift = len(self.calls) % len(names)
        record, out = {}, None
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            res = self.groups[name].generate(prompt_token_ids, sampling)
            record[name] = {
                "s": time.perf_counter() - t0,
                "tokens": sum(len(ids) for ids in res.token_ids),
                "counters": res.spec_counters,
            }
            out = res if name == self.trained_name else out
        self.calls.append(record)
        return out

    def update_weights_buckets(self, buckets) -> None:
        buckets = list(buckets)  # every group reads them
        self.trained.update_weights_buckets(buckets)
        t0 = time.perf_counter()
        self.refit_others(buckets)
        self.others_refit_s += time.perf_counter() - t0

    def refit_others(self, buckets) -> None:
        """The other groups to the trainer's weights (the run's own engines took them at set-up)."""
        buckets = list(buckets)
        for name, g in self.groups.items():
            if name != self.trained_name:
                g.update_weights_buckets(buckets)

    def shutdown_others(self) -> None:
        for name, g in self.groups.items():
            if name != self.trained_name:
                g.shutdown()

    def __getattr__(self, name):
        return getattr(self.trained, name)


def step_rows(calls: list[dict[str, dict]], walls: list[float]) -> list[dict]:
    """Per step: every variant's generation seconds, and the shared rest (the step's wall time, less the other
    groups' refits, less every variant's generation)."""
    rows = []
    for i, (rec, wall) in enumerate(zip(calls, walls)):
        rest = wall - sum(v["s"] for v in rec.values())
        rows.append({"step": i + 1, "rest_s": rest, **{n: v for n, v in rec.items()}})
    return rows


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high): a 95% t-interval on the log ratios (the point itself for one ratio)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), math.exp(m), math.exp(m)
    from scipy.stats import t

    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def summarise(rows_by_seed: dict[int, list[dict]], names: list[str]) -> list[dict]:
    """Per variant (but the baseline): generation and step speed-ups per step (interval), per seed (pooled)
    and overall, the Amdahl bound, tokens and acceptance length."""
    from rl_specdec.metrics import compute_spec_decode_metrics

    base, out = names[0], []
    rows = [r for rs in rows_by_seed.values() for r in rs]
    for n in names[1:]:
        gen = [r[base]["s"] / r[n]["s"] for r in rows]
        step = [(r["rest_s"] + r[base]["s"]) / (r["rest_s"] + r[n]["s"]) for r in rows]
        per_seed = {s: sum(r[base]["s"] for r in rs) / sum(r[n]["s"] for r in rs) for s, rs in rows_by_seed.items()}
        g_all = sum(r[base]["s"] for r in rows) / sum(r[n]["s"] for r in rows)
        share = sum(r[base]["s"] for r in rows) / sum(r["rest_s"] + r[base]["s"] for r in rows)
        step_all = sum(r["rest_s"] + r[base]["s"] for r in rows) / sum(r["rest_s"] + r[n]["s"] for r in rows)
        counters: dict = {}
        for r in rows:
            for key, v in r[n]["counters"].items():
                counters[key] = add_counter(counters.get(key), v)
        acc = compute_spec_decode_metrics(None, counters).get("spec_decode/acceptance_length") if counters else None
        out.append(
            {
                "variant": n,
                "steps": len(rows),
                "generation": g_all,
                "generation_per_step": interval(gen),
                "generation_per_seed": per_seed,
                "step": step_all,
                "step_per_step": interval(step),
                "generation_share": share,
                "amdahl_bound": 1 / ((1 - share) + share / g_all),
                "tokens": (sum(r[base]["tokens"] for r in rows), sum(r[n]["tokens"] for r in rows)),
                "acceptance_length": acc,
            }
        )
    return out


def table(summary: list[dict], base: str) -> str:
    head = (
        f"| variant (against {base}) | generation: pooled | per step (95% CI) | per seed | step: pooled "
        "| per step (95% CI) | Amdahl bound (gen. share) | tokens (base / variant) | L |"
    )
    lines = [head, "|" + "---|" * 9]
    for s in summary:
        g, st = s["generation_per_step"], s["step_per_step"]
        seeds = ", ".join(f"{v:.2f}x" for v in s["generation_per_seed"].values())
        acc = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "–"
        lines.append(
            f"| {s['variant']} | **{s['generation']:.2f}x** | {g[0]:.2f}x ({g[1]:.2f}-{g[2]:.2f}) | {seeds} "
            f"| **{s['step']:.2f}x** | {st[0]:.2f}x ({st[1]:.2f}-{st[2]:.2f}) "
            f"| {s['amdahl_bound']:.2f}x ({100 * s['generation_share']:.0f}%) "
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


def run_seed(variants, trained: str, seed: int, steps: int, out: Path) -> list[dict]:
    """One trained run of ``steps`` steps with every other variant's engines beside it; the per-step rows."""
    from rl_specdec.config import load_config
    from rl_specdec.grpo.run import setup
    from rl_specdec.grpo.step import grpo_step
    from rl_specdec.grpo.stop import StopSignals
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.placement import stop_ray
    from rl_specdec.toy.resolve import prepare_models

    by_name = {n: (c, o) for n, c, o in variants}
    common = [f"seed={seed}", KV, f"cluster.num_cpus={4 * len(variants) + 2}"]
    config, overrides = by_name[trained]
    extra = [f"grpo.max_steps={steps}", f"logger.log_dir={out / f'seed{seed}'}"]
    cfg = load_config(config, overrides + common + TRAINED + extra)
    with StopSignals(cfg.checkpoint.grace_s, None) as stop:
        run = setup(cfg)
        run.stop, paired, walls, lengths = stop, None, [], []
        try:
            others = {}
            for n, (c, o) in by_name.items():
                if n != trained:
                    log(f"seed {seed}: starting {n}: {c} {' '.join(o)}")
                    oc = prepare_models(load_config(c, o + common))
                    others[n] = VllmGeneration(oc.policy.model_name, oc.policy.generation, oc.cluster, seed=seed)
            paired = run.generation = PairedGeneration(trained, run.generation, others)
            paired.refit_others(run.policy.state_dict_buckets())
            for step in range(steps):
                t0, refits0 = time.perf_counter(), paired.others_refit_s
                row = grpo_step(run, step)
                walls.append(time.perf_counter() - t0 - (paired.others_refit_s - refits0))
                lengths.append([row.get(f"generation/response_length_{q}", float("nan")) for q in LENGTHS])
                log(
                    f"seed {seed} step {step + 1}: "
                    + ", ".join(f"{n} {v['s']:.1f} s" for n, v in paired.calls[-1].items())
                    + f"; train {row.get('timing/train', 0):.1f} s; lengths "
                    + "/".join(f"{v:.0f}" for v in lengths[-1])
                )
        finally:
            if paired is not None:
                paired.shutdown_others()
                run.generation = paired.trained
            run.shutdown()
            stop_ray()
    rows = step_rows(paired.calls, walls)
    for r, lens in zip(rows, lengths):
        r["lengths"] = lens
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="name: config [key=value ...]; ... (first: baseline)")
    p.add_argument("--trained", default=None, help="the variant whose rollouts are trained on (default: the first)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=4)
    bench_common.add_out(p, "paired", "paired.json and .md")
    args = p.parse_args(argv)
    variants = variants_or_exit(p, args.variants)
    names = [v[0] for v in variants]
    trained = args.trained or names[0]
    if trained not in names:
        p.error(f"--trained {trained!r} is not one of the variants ({', '.join(names)})")
    head = bench_common.header()
    print(f"# paired GRPO: {head}", flush=True)
    out = Path(args.out)
    rows = {s: run_seed(variants, trained, s, args.steps, out) for s in (int(x) for x in args.seeds.split(","))}
    summary = summarise(rows, names)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": head,
        "command": "python -m benchmarks paired " + " ".join(sys.argv[1:]),
        "trained": trained,
        "variants": [{"name": n, "config": c, "overrides": o} for n, c, o in variants],
        "steps": {str(s): r for s, r in rows.items()},
        "summary": summary,
    }
    (out / "paired.json").write_text(json.dumps(result, indent=1))
    with bench_common.markdown_report(out, "paired.md", "Paired GRPO", head):
        print(f"trained on {trained}'s rollouts; every variant generates each step's rollouts from the same weights")
        print(table(summary, names[0]))
        print(f"\n{lengths_line(rows)}")
    print(f"written to {out / 'paired.json'} and {out / 'paired.md'}")


if __name__ == "__main__":
    main()
