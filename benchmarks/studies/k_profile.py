"""How much any batch-size rule could gain over vLLM's schedule on the wide workload: every engine step of its
generation calls, at every k, by the number of requests running
(docs/lab/wide_pair.md, "Where the time goes, and the ceiling against the schedule").

The wide workload's generation calls (configs/grpo_spec_wide.yaml's prompts, ``--prompts`` x 8 samples a
step, its sampling settings, the untrained policy) are replayed on one run-time-k engine at each fixed k in
0..5 in turn, the order rotating per call. The fast path records every engine step
(benchmarks/step_records.py): its batch, the drafts it verified, the tokens it emitted and its time to the
next step's start. Decode steps that verified k drafts (or none, at k=0) give, per batch size and k, the
time per emitted token; the tokens every run emitted at each batch size, pooled, are the mix on which each
rule is priced:

* ``k=K``: K drafts at every batch size (``k=0`` is the fast path's plain step);
* ``schedule``: vLLM's ``num_speculative_tokens_per_batch_size``, set from the corrected cost table's best k
  per batch size (docs/performance.md, "Where it pays: the wide pair");
* ``oracle``: the best k per bucket of the controller's buckets, chosen on the other seeds' steps and
  priced on this seed's; chosen and priced on the same steps it is an upper bound (it picks noise too);
* a run's controller, with ``--controller-runs``: the k per bucket its last metrics row reports.

A rule's time is the sum over batch sizes of the mix's tokens times the rule's time per token there (its
bucket's where a batch size has no step at that k). So exploration, warm-up and calls' fixed costs are not
in it: it is the ceiling of a per-bucket rule on these calls, not a GRPO run::

    python -m benchmarks.studies.k_profile --steps 6 --seeds 0,1,2                  # 7 min on 2 cores
    python -m benchmarks.studies.k_profile --report docs/data/k_profile_wide.json \\
        --controller-runs "results/wide1[45]/runs/*/wide_adaptive*/metrics.jsonl"   # again, no engine
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.rollout.rollout import cores_and_load, log
from benchmarks.step_records import engine_group, importable
from benchmarks.whatif.report import table

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/grpo_spec_wide.yaml"
SCHEDULE = [[1, 2, 5], [3, 4, 4], [5, 16, 2], [17, 1024, 0]]  # the corrected schedule (bench variant)
KS = range(6)
KEYS = ("b", "tokens", "k_verify", "emitted", "period_s")


def buckets(n: int) -> list[tuple[int, int]]:
    """The controller's default buckets (speculation_control.buckets), cut at ``n`` running requests."""
    from rl_specdec.config.generation import SpeculationControlConfig
    from rl_specdec.rollout.runtime_k.controller import bucket_ranges

    return bucket_ranges(SpeculationControlConfig().buckets, n)


def replay(args) -> dict:
    """Every call at each k: {"calls": [{seed, step, k, wall_s, tokens, cells}], ...} (:func:`call_cells`)."""
    from benchmarks.studies.grpo_gap import workload
    from rl_specdec.config import load_config
    from rl_specdec.toy.resolve import prepare_models
    from rl_specdec.toy.wide import build_wide_models

    build_wide_models(log=log)
    import ray

    importable()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    overrides = [f"grpo.num_prompts_per_step={args.prompts}", "policy.generation.speculation_control.mode=fixed"]
    cfg = prepare_models(load_config(str(ROOT / CONFIG), overrides))
    g = engine_group(True)(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=0)
    g.engine_rpc("rl_specdec_step_records")  # installs the recorder; drops the start-up checks' steps
    calls, seeds = [], [int(s) for s in args.seeds.split(",")]
    total, t0 = len(seeds) * args.steps * len(KS), time.perf_counter()
    for seed in seeds:
        for step in range(args.steps):
            ids, sampling = workload(cfg, step, seed)
            for k in [*KS][step % len(KS) :] + [*KS][: step % len(KS)]:
                g.set_speculation(k)
                g.engine_rpc("rl_specdec_step_records")  # nothing of the previous k's call
                t = time.perf_counter()
                out = g.generate(ids, sampling)
                wall = time.perf_counter() - t
                recs = g.engine_rpc("rl_specdec_step_records")[0]
                row = {"seed": seed, "step": step + 1, "k": k, "wall_s": wall}
                row["tokens"] = sum(len(x) for x in out.token_ids)
                row["cells"] = call_cells([[r[f] for f in KEYS] for r in recs], k)
                calls.append(row)
                log(
                    f"  [{len(calls)}/{total}, {time.perf_counter() - t0:.0f} s] seed {seed} step {step + 1} k={k}: "
                    f"{wall:.2f} s, {row['tokens']} tokens, {len(recs)} engine steps"
                )
    g.shutdown()
    return {"config": CONFIG, "prompts": args.prompts, "samples": len(ids), "calls": calls}


def call_cells(records: list[list], k: int) -> dict[str, list]:
    """One call's decode steps at steady k: {"b": [seconds, tokens emitted, steps]} (prefill steps, and a k>0
    call's first step, which verifies nothing, left out)."""
    out: dict = {}
    for b, tokens, kv, emitted, period in records:
        if period is None or tokens > b * (1 + kv) or kv != k:
            continue
        cell = out.setdefault(str(b), [0.0, 0, 0])
        cell[0], cell[1], cell[2] = cell[0] + period, cell[1] + emitted, cell[2] + 1
    return out


def cells(calls: list[dict]) -> dict:
    """{(b, k): [seconds, tokens, steps]} over the calls."""
    out: dict = defaultdict(lambda: [0.0, 0, 0])
    for c in calls:
        for b, (s, n, steps) in c["cells"].items():
            cell = out[(int(b), c["k"])]
            cell[0], cell[1], cell[2] = cell[0] + s, cell[1] + n, cell[2] + steps
    return out


def per_token(cs: dict, b: int, k: int, bucket: tuple[int, int]) -> float:
    """Seconds per emitted token at batch b and k: b's own cell, else its bucket's."""
    if (b, k) in cs and cs[(b, k)][1]:
        return cs[(b, k)][0] / cs[(b, k)][1]
    s = [cs[(x, k)] for x in range(bucket[0], bucket[1] + 1) if (x, k) in cs]
    return sum(c[0] for c in s) / max(1, sum(c[1] for c in s)) if s else float("inf")


def mix(cs: dict) -> dict[int, int]:
    """Tokens emitted at each batch size, pooled over every k."""
    out: dict = defaultdict(int)
    for (b, _), (_, tokens, _) in cs.items():
        out[b] += tokens
    return dict(out)


def bucket_of(b: int, bs: list[tuple[int, int]]) -> tuple[int, int]:
    return next(r for r in bs if r[0] <= b <= r[1])


def price(cs: dict, tokens: dict[int, int], rule, bs) -> float:
    """Seconds for the mix ``tokens`` under ``rule(b) -> k``."""
    return sum(n * per_token(cs, b, rule(b), bucket_of(b, bs)) for b, n in tokens.items())


def best_per_bucket(cs: dict, tokens: dict[int, int], bs) -> dict[tuple[int, int], int]:
    """The k that prices each bucket's share of the mix lowest."""
    out = {}
    for r in bs:
        part = {b: n for b, n in tokens.items() if r[0] <= b <= r[1]}
        out[r] = min(KS, key=lambda k: price(cs, part, lambda b: k, bs)) if part else 0
    return out


def lookup_rule(by_bucket: dict, bs):
    return lambda b: by_bucket[bucket_of(b, bs)]


def schedule_rule(b: int) -> int:
    return next(k for lo, hi, k in SCHEDULE if lo <= b <= hi)


def controller_lookups(pattern: str | None) -> dict[str, dict]:
    """{run: {(lo, hi): k}} from each run's last ``spec_decode/k_bucket_LO_HI`` metrics."""
    out = {}
    for path in sorted(glob.glob(pattern or "", recursive=True)):
        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if "k_bucket" in x]
        if rows:
            last = {k: v for k, v in rows[-1].items() if k.startswith("spec_decode/k_bucket_")}
            key = str(Path(path).parent).replace("/runs/", " ").replace("results/", "")
            out[key] = {tuple(int(x) for x in k.rsplit("_", 2)[1:]): int(v) for k, v in last.items()}
    return out


def rules(data: dict, seeds: list[int], ctl: dict) -> dict[str, list]:
    """{rule: [seconds per seed]} with each seed's cells and mix; the oracle chosen on the other seeds."""
    out: dict = defaultdict(list)
    for s in seeds:
        cs = cells([c for c in data["calls"] if c["seed"] == s])
        other = cells([c for c in data["calls"] if c["seed"] != s]) if len(seeds) > 1 else cs
        tokens = mix(cs)
        bs = buckets(max(tokens))
        for k in KS:
            out[f"k={k}"].append(price(cs, tokens, lambda b, k=k: k, bs))
        out[f"schedule {SCHEDULE}"].append(price(cs, tokens, schedule_rule, bs))
        out["oracle per bucket (chosen on the other seeds)"].append(
            price(cs, tokens, lookup_rule(best_per_bucket(other, mix(other), bs), bs), bs)
        )
        out["oracle per bucket, chosen on these steps (optimistic)"].append(
            price(cs, tokens, lookup_rule(best_per_bucket(cs, tokens, bs), bs), bs)
        )
        for name, lookup in ctl.items():
            out[f"controller's last choice, {name}"].append(price(cs, tokens, lookup_rule(lookup, list(lookup)), bs))
    return out


def report(data: dict, ctl: dict) -> str:
    seeds = sorted({c["seed"] for c in data["calls"]})
    cs = cells(data["calls"])
    tokens = mix(cs)
    bs = buckets(max(tokens))
    best = best_per_bucket(cs, tokens, bs)
    t_sched = {r: price(cs, {b: n for b, n in tokens.items() if r[0] <= b <= r[1]}, schedule_rule, bs) for r in bs}
    head = ["running requests", "tokens", "time under the schedule"] + [f"k={k} ms/token" for k in KS]
    head += ["best k", "schedule's k"] + [f"controller, {n}" for n in ctl]
    rows = []
    for r in bs:
        part = [b for b in tokens if r[0] <= b <= r[1]]
        row = [f"{r[0]}-{r[1]}", sum(tokens[b] for b in part), f"{t_sched[r] / sum(t_sched.values()):.0%}"]
        for k in KS:
            t = sum(cs.get((b, k), [0, 0])[0] for b in part)
            n = sum(cs.get((b, k), [0, 0])[1] for b in part)
            row.append(f"{t / n * 1e3:.2f}" if n else "-")
        ks = sorted({schedule_rule(b) for b in part})
        row += [best[r], "/".join(map(str, ks))] + [lookup_rule(lk, list(lk))(r[0]) for lk in ctl.values()]
        rows.append(row)
    per = rules(data, seeds, ctl)
    sched = f"schedule {SCHEDULE}"
    base = per["k=0"]
    out = [table(head, rows), ""]
    head2 = ["rule", "priced s, all seeds", "speed-up vs k=0", "per seed", "vs the schedule", "per seed"]
    rows2 = []
    for name, t in per.items():
        vs0 = [b / x for b, x in zip(base, t)]
        vss = [a / x for a, x in zip(per[sched], t)]
        rows2.append([name, f"{sum(t):.2f}", f"{sum(base) / sum(t):.3f}x", ", ".join(f"{v:.3f}" for v in vs0)])
        rows2[-1] += [f"**{sum(per[sched]) / sum(t):.3f}x**", ", ".join(f"{v:.3f}" for v in vss)]
    out.append(table(head2, rows2))
    wall = {k: sum(c["wall_s"] for c in data["calls"] if c["k"] == k) for k in KS}
    out.append(
        "\nMeasured wall time of the calls, per fixed k, against k=0 (the same prompts; each k samples its own "
        "rollouts): " + ", ".join(f"k={k} {wall[0] / wall[k]:.3f}x" for k in KS)
    )
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (x 8 samples), as the wide ring ran")
    ap.add_argument("--controller-runs", help="glob of GRPO runs' metrics.jsonl: price their last k per bucket")
    ap.add_argument("--report", help="a k_profile.json to print the tables of (no engine)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/k_profile.json"))
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
    else:
        cores, load = cores_and_load()
        log(f"cores {cores}, load average at start {load:.2f}")
        data = replay(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data))
        log(f"records: {args.out}")
    print(report(data, controller_lookups(args.controller_runs)))


if __name__ == "__main__":
    main()
