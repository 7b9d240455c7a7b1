"""Where in a default-task call speculation pays: kept tokens per second per batch-size bucket, per engine.

Engines built from configs/grpo_spec.yaml as a run builds them (``load_config``), alive side by side, make
the default run's generate calls (benchmarks/studies/k0_cost.py's ``default_calls``), calls interleaved with the
engine order rotating each round. Every engine step is recorded (benchmarks/step_records.py). Engines:

* ``k=0 everywhere``: run-time k with k=0 everywhere (the fast path; the reference);
* ``threshold 32 (the default)``: k=3 below 32 running requests, the fast path above (``draft_below: 32``);
* ``the controller``: ``draft_below: null`` (k per batch-size bucket, measured while the engine runs).

It prints the calls' speed-ups over ``k=0 everywhere`` (the median of the rounds', and that of the
sums per seed), the time spent in steps below 32 running requests, and per bucket the kept tokens per
second over the steps that continue a call (a call's first step admits every prompt), with the step
count, and the k each engine drafted there. The records go to ``--out``::

    python -m benchmarks.studies.tail_rates --rounds 8 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from benchmarks.rollout.rollout import cores_and_load, log
from benchmarks.step_records import engine_group, importable

ROOT = Path(__file__).resolve().parents[2]
CONTROL = "policy.generation.speculation_control"
ENGINES = {  # name -> (overrides of configs/grpo_spec.yaml, k set after start or None)
    "k=0 everywhere": ([f"{CONTROL}.mode=fixed"], 0),
    "threshold 32 (the default)": ([], None),
    "the controller": ([f"{CONTROL}.draft_below=null"], None),
}
BUCKETS = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 256)]
TAIL = 32  # below this many running requests: the tail


def start(name: str):
    from rl_specdec.config import load_config
    from rl_specdec.toy.resolve import prepare_models

    overrides, k = ENGINES[name]
    cfg = prepare_models(load_config(str(ROOT / "configs/grpo_spec.yaml"), overrides))
    g = engine_group(True)(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)
    if k is not None:
        g.set_speculation(k)
    g.engine_rpc("rl_specdec_step_records")  # start recording
    return g


def run(engines: dict, seeds: list[int], rounds: int) -> list[dict]:
    """One row per call: engine, seed, round, wall seconds and the call's step records (round -1: warm-up)."""
    from benchmarks.studies.k0_cost import default_calls

    names, rows = list(engines), []
    for sd in seeds:
        call = default_calls(sd)
        for r in range(-1, rounds):
            prompts, sampling = call(r)
            for n in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                engines[n].generate(prompts, sampling)
                wall = time.perf_counter() - t0
                recs = engines[n].engine_rpc("rl_specdec_step_records")[0]
                rows.append({"engine": n, "seed": sd, "round": r, "wall": wall, "records": recs})
            log(f"  seed {sd} round {r}: " + ", ".join(f"{x['engine']} {x['wall']:.2f} s" for x in rows[-len(names) :]))
    return rows


def report(rows: list[dict]) -> str:
    timed = [x for x in rows if x["round"] >= 0]
    names = list(dict.fromkeys(x["engine"] for x in timed))
    ref = names[0]
    walls = {(x["engine"], x["seed"], x["round"]): x["wall"] for x in timed}
    keys = sorted({(x["seed"], x["round"]) for x in timed})
    seeds = sorted({s for s, _ in keys})
    lines = ["| engine | paired speed-up (median of rounds) | per seed (of sums) | seconds in steps below 32 |"]
    lines.append("|---|---|---|---|")
    for n in names:
        paired = statistics.median(walls[(ref, *k)] / walls[(n, *k)] for k in keys)
        per = [
            sum(walls[(ref, s, r)] for s2, r in keys if s2 == s) / sum(walls[(n, s, r)] for s2, r in keys if s2 == s)
            for s in seeds
        ]
        tail = sum(r["period_s"] or 0.0 for x in timed if x["engine"] == n for r in x["records"] if 0 < r["b"] < TAIL)
        lines.append(f"| {n} | {paired:.3f}x | {', '.join(f'{v:.3f}x' for v in per)} | {tail:.2f} |")
    lines += ["", "| running requests | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for lo, hi in BUCKETS:
        cells = []
        for n in names:
            recs = [r for x in timed if x["engine"] == n for r in x["records"] if lo <= r["b"] <= hi]
            steady = [r for r in recs if r["continuing"] and r["period_s"]]
            secs = sum(r["period_s"] for r in steady)
            ks = Counter(r["k_next"] for r in recs)
            k_text = "/".join(f"k={k}:{c}" for k, c in sorted(ks.items()))
            rate = sum(r["emitted"] for r in steady) / secs if secs else 0.0
            cells.append(f"{rate:,.0f} tok/s ({len(steady)} steps; {k_text})")
        lines.append(f"| {lo}–{hi} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="timed calls per engine and seed (after one warm-up round)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--out", default="results/tail_rates")
    args = p.parse_args(argv)
    import ray

    cores, load = cores_and_load()
    log(f"tail rates: the default run's calls, {args.rounds} rounds per seed; {cores} cores, load average {load:.2f}")
    importable()  # step_records, for the engines
    # the engines side by side, one runs at a time
    ray.init(num_cpus=2 * len(ENGINES), include_dashboard=False, log_to_driver=False)
    engines = {}
    try:
        for n in ENGINES:
            engines[n] = start(n)
            log(f"  started {n}")
        rows = run(engines, [int(s) for s in args.seeds.split(",")], args.rounds)
    finally:
        for g in engines.values():
            g.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tail_rates.json").write_text(json.dumps({"load": load, "rows": rows}))
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
