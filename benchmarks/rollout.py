"""Rollout throughput with and without speculative decoding (toy policy/drafter, vLLM).

Prints markdown tables and writes them (plus the raw numbers as JSON) under
``--out``:

1. per method (none, draft_model k=3, ngram k=3), batch size (1, 8, 64) and
   temperature (0, 1): time per ``generate`` call, generated tokens/s,
   acceptance rate and length, and the speed-up in tokens/s over no
   speculation measured in the same run;
2. with ``--engines``: one engine on all cores vs one engine per core
   (data parallel) on a batch of 128 prompts.

Prompts are sorting-task prompts (``SortingTask().make_batch``) in the toy
tokenizer; responses stop at EOS or ``--max-tokens``. Each engine gets one
warm-up call before it is timed; each cell is the median of ``--repeats``
calls, each on a different batch of prompts (the same batches for every
method). Nothing else should run on the machine meanwhile: on a 2-core
machine a concurrent job changes every number, and an engine whose OpenMP
threads span both cores suffers most (the script prints the load average).

    python benchmarks/rollout.py                 # full table (~10 min on 2 cores)
    python benchmarks/rollout.py --quick         # 1 repeat, batch sizes 1 and 8, T=1 only
    python benchmarks/rollout.py --engines --out results/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

METHODS = ("none", "draft_model", "ngram")


def spec_for(method: str, drafter: str, k: int):
    if method == "none":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": drafter, "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    raise ValueError(method)


def task_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from rl_specdec.environments.sorting import SortingTask

    return [tokenizer.encode(s.prompt) for s in SortingTask().make_batch(seed=seed, n=n)]


def start(models, method: str, args, num_engines: int, cpus_per_engine: int):
    from rl_specdec.generation import GenerationConfig, validate_vllm_kwargs
    from rl_specdec.generation.vllm_generation import VllmGeneration

    kw = {"kv_cache_memory_bytes": 2**28, "max_model_len": 128, "dtype": args.dtype}
    if args.eager:
        kw["enforce_eager"] = True
    kw = validate_vllm_kwargs({**kw, "speculative_config": spec_for(method, str(models.drafter), args.k)}, str(models.policy))
    cfg = GenerationConfig(num_engines=num_engines, cpus_per_engine=cpus_per_engine, vllm_kwargs=kw, self_check=False)
    t0 = time.time()
    g = VllmGeneration(str(models.policy), cfg)
    log(f"  started {method} ({num_engines} x {cpus_per_engine} cores) in {time.time() - t0:.0f}s")
    return g


def timed_calls(g, batches: list[list[list[int]]], sampling) -> dict:
    """Median time per call, tokens per call and spec metrics over one call per batch.

    Repeats use different prompt batches (the same ones for every method), so a
    batch of 1 is not one lucky or unlucky prompt.
    """
    from rl_specdec.spec_decode import compute_spec_decode_metrics, read_spec_counters

    before = read_spec_counters(g)
    times, tokens = [], []
    for r, prompts in enumerate(batches):
        s = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + 1000 * r)
        t0 = time.perf_counter()
        out = g.generate(prompts, s)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(t) for t in out.token_ids))
    m = compute_spec_decode_metrics(before, read_spec_counters(g))
    t = statistics.median(times)
    return {
        "time_s": t,
        "times_s": times,
        "tokens": statistics.median(tokens),
        "tok_per_s": sum(tokens) / sum(times),
        "acceptance_rate": m.get("spec_decode/acceptance_rate"),
        "acceptance_length": m.get("spec_decode/acceptance_length"),
    }


def warm_up(g, prompts, max_tokens):
    from rl_specdec.generation import SamplingSettings

    t0 = time.perf_counter()
    g.generate(prompts, SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=0))
    return time.perf_counter() - t0


def fmt(x, spec="{:.3f}"):
    return "-" if x is None else spec.format(x)


def method_table(rows: list[dict]) -> str:
    base = {(r["temperature"], r["batch"]): r["tok_per_s"] for r in rows if r["method"] == "none"}
    lines = [
        "| method | T | batch | time/call (s) | tokens/call | tokens/s | acceptance rate | acceptance length | speed-up vs none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["temperature"], r["batch"], METHODS.index(r["method"]))):
        b = base.get((r["temperature"], r["batch"]))
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['batch']} | {r['time_s']:.3f} | {r['tokens']:.0f} | {r['tok_per_s']:.0f} | "
            f"{fmt(r['acceptance_rate'], '{:.2f}')} | {fmt(r['acceptance_length'], '{:.2f}')} | "
            f"{fmt(r['tok_per_s'] / b if b else None, '{:.2f}x')} |"
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
            f"| {r['method']} | {r['temperature']:g} | {r['engines']} x {r['cores']} | {r['batch']} | {r['time_s']:.3f} | "
            f"{r['tok_per_s']:.0f} | {', '.join(f'{t:.2f}' for t in r['per_engine_time_s'])} | {fmt(r['tok_per_s'] / b if b else None, '{:.2f}x')} |"
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
            f"- {r['method']}, T={r['temperature']:g}: {r['engines']} engines x {r['cores']} core = {r['tok_per_s']:.0f} tok/s, "
            f"1 engine x {b['cores']} cores = {b['tok_per_s']:.0f} tok/s: {ratio:.2f}x ({verdict})"
        )
    return "\n".join(out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repeat, batch sizes 1 and 8, temperature 1 only")
    p.add_argument("--out", default="results/bench", help="folder for rollout.md and rollout.json")
    p.add_argument("--engines", action="store_true", help="also compare 1 engine x all cores with 1 engine per core (batch 128)")
    p.add_argument("--engines-only", action="store_true", help="only the engine comparison")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of none,draft_model,ngram")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,64; --quick 1,8)")
    p.add_argument("--temperatures", default=None, help="comma-separated (default 0,1; --quick 1)")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 3; --quick 1)")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--engines-batch", type=int, default=128)
    p.add_argument("--engines-methods", default="none,draft_model", help="methods for the engine comparison")
    p.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile: faster start, slower decode)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (the toy checkpoint is float32; vLLM-CPU's auto picks bfloat16)")
    args = p.parse_args(argv)

    batch_sizes = [int(x) for x in (args.batch_sizes or ("1,8" if args.quick else "1,8,64")).split(",")]
    temps = [float(x) for x in (args.temperatures or ("1" if args.quick else "0,1")).split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods + args.engines_methods.split(","):
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {METHODS}")

    import ray
    import vllm

    from rl_specdec.generation import SamplingSettings
    from rl_specdec.toy.build import build_tokenizer, build_toy_models

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (
        f"rollout benchmark: toy policy/drafter, vLLM {vllm.__version__}, {platform.machine()} {cores} cores, "
        f"dtype {args.dtype}, {'eager' if args.eager else 'torch.compile'}, max_tokens {args.max_tokens}, "
        f"k={args.k}, {repeats} timed call(s) per cell after 1 warm-up call per engine, "
        f"load average at start {load:.2f}"
    )
    log(header)
    if load > 0.5 * cores:
        log(f"WARNING: load average {load:.2f} on {cores} cores: another job is running, numbers will be noisy")

    models = build_toy_models(log=log)
    tok = build_tokenizer()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"header": header, "methods": [], "engines": []}
    md = [f"_{header}_", ""]

    try:
        if not args.engines_only:
            prompts = {b: [task_prompts(tok, b, seed=100 * b + r) for r in range(repeats)] for b in batch_sizes}
            for method in methods:
                g = start(models, method, args, 1, cores)
                try:
                    w = warm_up(g, task_prompts(tok, max(batch_sizes), seed=1), args.max_tokens)
                    log(f"  warm-up {w:.2f}s")
                    for temp in temps:
                        for b in batch_sizes:
                            s = SamplingSettings(max_tokens=args.max_tokens, temperature=temp, seed=0 if temp > 0 else None)
                            r = timed_calls(g, prompts[b], s)
                            r.update(method=method, temperature=temp, batch=b)
                            results["methods"].append(r)
                            log(f"  {method} T={temp:g} batch={b}: {r['time_s']:.3f}s/call {r['tok_per_s']:.0f} tok/s acc_len={fmt(r['acceptance_length'], '{:.2f}')}")
                finally:
                    g.shutdown()
            table = method_table(results["methods"])
            print("\n### Rollout throughput, one engine on all cores\n")
            print(table)
            md += ["### Rollout throughput, one engine on all cores", "", table, ""]

        if args.engines or args.engines_only:
            batches = [task_prompts(tok, args.engines_batch, seed=7 + r) for r in range(repeats)]
            prompts = batches[0]
            layouts = [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]
            for method in args.engines_methods.split(","):
                for n, c in layouts:
                    g = start(models, method, args, n, c)
                    try:
                        warm_up(g, prompts, args.max_tokens)
                        for temp in temps:
                            s = SamplingSettings(max_tokens=args.max_tokens, temperature=temp, seed=0 if temp > 0 else None)
                            r = timed_calls(g, batches, s)
                            # per-engine busy time of one more call, to show the load balance
                            out = g.generate(prompts, s)
                            per_engine = out.per_engine_time_s
                            r.update(method=method, temperature=temp, engines=n, cores=c, batch=len(prompts), per_engine_time_s=per_engine)
                            results["engines"].append(r)
                            log(f"  {method} {n}x{c} T={temp:g}: {r['time_s']:.3f}s/call {r['tok_per_s']:.0f} tok/s")
                    finally:
                        g.shutdown()
            table = engines_table(results["engines"]) + "\n\n" + engines_verdict(results["engines"])
            print(f"\n### Data parallel on {cores} cores: 1 engine x {cores} cores vs {cores} engines x 1 core, batch {args.engines_batch}\n")
            print(table)
            md += [f"### Data parallel on {cores} cores, batch {args.engines_batch}", "", table, ""]
    finally:
        ray.shutdown()

    (out_dir / "rollout.md").write_text("\n".join(md) + "\n")
    (out_dir / "rollout.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {out_dir / 'rollout.md'} and {out_dir / 'rollout.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
