"""Rollout throughput with and without speculative decoding (toy policy/drafter, vLLM).

Prints markdown tables and writes them (plus the raw numbers as JSON) under
``--out``:

1. per method (none; draft_model, ngram and, when ``arctic-inference`` is
   installed, suffix, each at k in ``--ks``; draft_model with the batch-size
   schedule ``SCHEDULE``), batch size (1, 8, 64, 256) and temperature (0, 1):
   time per ``generate`` call, generated tokens/s, acceptance rate and length,
   and the speed-up in tokens/s over no speculation measured in the same run;
2. with ``--engines``: one engine on all cores vs one engine per core
   (data parallel) on a batch of 128 prompts.

Prompts are sorting-task prompts (``SortingTask(max_len=24).make_batch``: 4 to 24 digits) in the toy
tokenizer; responses stop at EOS or ``--max-tokens``. Each engine gets one
warm-up call before it is timed; each cell is the median of ``--repeats``
calls, each on a different batch of prompts (the same batches for every
method). Nothing else should run on the machine meanwhile: on a 2-core
machine a concurrent job changes every number (the script prints the load average).

    python -m benchmarks rollout                 # full grid (~15 min on 2 cores)
    python -m benchmarks rollout --quick         # k=3, batch sizes 8 and 64, T=1, 1 repeat
    python -m benchmarks rollout --engines       # and 1 engine on all cores against one per core
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import bench_common
from benchmarks.bench_common import cores_and_load, log  # noqa: F401  (the studies take both from here)
from benchmarks.rollout.rollout_report import (
    METHODS,
    engines_table,
    engines_verdict,
    fmt,
    method_table,
    plot_methods,
    speedup_table,
)

# vLLM's dynamic speculation (num_speculative_tokens_per_batch_size): inclusive
# running-batch-size ranges -> k. Speculate deeper when few sequences are left
# (the tail), shallower when the batch is full. k is capped by num_speculative_tokens.
SCHEDULE = [[1, 16, 5], [17, 64, 3], [65, 1024, 2]]


def has_suffix() -> bool:
    """suffix needs the arctic-inference package (docs/performance.md, "How the figures are taken", says how to
    build it on CPU)."""
    from vllm.utils.import_utils import has_arctic_inference

    return has_arctic_inference()


def spec_for(method: str, drafter: str, k: int, schedule=None):
    """The speculative_config of one benchmark row (None: no speculation)."""
    if method == "none":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": drafter, "num_speculative_tokens": k}
    if method == "draft_model_schedule":
        sched = schedule or SCHEDULE
        return {
            "method": "draft_model",
            "model": drafter,
            "num_speculative_tokens": max(e[2] for e in sched),
            "num_speculative_tokens_per_batch_size": [list(e) for e in sched],
        }
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise ValueError(method)


def variants(methods: list[str], ks: list[int]) -> list[tuple[str, int | None]]:
    """(method, k) rows: none and the schedule once, every other method at each k."""
    out = []
    for m in methods:
        if m in ("none", "draft_model_schedule"):
            out.append((m, None))
        else:
            out += [(m, k) for k in ks]
    return out


def task_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from rl_specdec.tasks.sorting import SortingTask

    return [tokenizer.encode(s.prompt) for s in SortingTask(max_len=24).make_batch(seed=seed, n=n)]


def start(
    models,
    method: str,
    args,
    num_engines: int,
    cpus_per_engine: int,
    k: int | None = None,
    env_vars: dict | None = None,
):
    from rl_specdec.config import generation_config
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.toy.presets import toy_engine_kwargs

    kw = toy_engine_kwargs(dtype=args.dtype, enforce_eager=bool(args.eager))
    k = args.k if k is None else k
    cfg = generation_config(
        str(models.policy),
        {**kw, "speculative_config": spec_for(method, str(models.drafter), k, args.schedule)},
        num_engines=num_engines,
        cpus_per_engine=cpus_per_engine,
        self_check=False,
        env_vars=dict(env_vars or {}),
    )
    t0 = time.time()
    g = VllmGeneration(str(models.policy), cfg)
    log(f"  started {method} k={k} ({num_engines} x {cpus_per_engine} cores) in {time.time() - t0:.0f}s")
    return g


def timed_calls(g, batches: list[list[list[int]]], sampling) -> dict:
    """Median time per call, tokens per call and spec metrics over one call per batch.

    Repeats use different prompt batches (the same ones for every method), so a
    batch of 1 is not one lucky or unlucky prompt.
    """
    from rl_specdec.metrics import aggregate_spec_decode_counters, compute_spec_decode_metrics

    times, tokens, counters = [], [], []
    for r, prompts in enumerate(batches):
        s = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + 1000 * r)
        t0 = time.perf_counter()
        out = g.generate(prompts, s)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(t) for t in out.token_ids))
        counters.append(out.spec_counters)
    m = compute_spec_decode_metrics(None, aggregate_spec_decode_counters(counters))
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
    from rl_specdec.rollout import SamplingSettings

    t0 = time.perf_counter()
    g.generate(prompts, SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=0))
    return time.perf_counter() - t0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    try:
        finish_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="k=3 only, batch sizes 8 and 64, temperature 1, 1 repeat, eager engines"
    )
    bench_common.add_out(p, "rollout", "rollout.md, rollout.json and the plots")
    p.add_argument(
        "--engines", action="store_true", help="also compare 1 engine x all cores with 1 engine per core (batch 128)"
    )
    p.add_argument("--engines-only", action="store_true", help="only the engine comparison")
    p.add_argument(
        "--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} (default: all that run here)"
    )
    p.add_argument("--ks", default=None, help="comma-separated num_speculative_tokens (default 1,2,3,5; --quick 3)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,64,256; --quick 8,64)")
    p.add_argument("--temperatures", default=None, help="comma-separated (default 0,1; --quick 1)")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 3; --quick 1)")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens for the engine comparison")
    p.add_argument("--engines-batch", type=int, default=128)
    p.add_argument("--engines-methods", default="none,draft_model", help="methods for the engine comparison")
    p.add_argument(
        "--eager",
        action="store_true",
        default=None,
        help="enforce_eager (skip torch.compile: faster start, slower decode; default with --quick)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help=f"batch-size schedule of draft_model_schedule as JSON (default {json.dumps(SCHEDULE)})",
    )
    p.add_argument(
        "--dtype", default="float32", help="vLLM dtype (the toy checkpoint is float32; vLLM-CPU's auto picks bfloat16)"
    )


def finish_args(args: argparse.Namespace) -> None:
    """Fill the --quick / full defaults and check the method names."""
    q = args.quick
    args.batch_sizes = [int(x) for x in (args.batch_sizes or ("8,64" if q else "1,8,64,256")).split(",")]
    args.temperatures = [float(x) for x in (args.temperatures or ("1" if q else "0,1")).split(",")]
    args.ks = [int(x) for x in (args.ks or ("3" if q else "1,2,3,5")).split(",")]
    args.repeats = args.repeats or (1 if q else 3)
    args.schedule = json.loads(args.schedule) if args.schedule else SCHEDULE
    args.eager = q if args.eager is None else args.eager
    default = [m for m in METHODS if m != "suffix" or has_suffix()]
    if q:
        default = [m for m in default if m != "draft_model_schedule"]
    args.methods = [m for m in (args.methods.split(",") if args.methods else default) if m]
    args.engines_methods = [m for m in args.engines_methods.split(",") if m]
    for m in args.methods + args.engines_methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if "suffix" in args.methods and not has_suffix():
        raise ValueError("method suffix needs the arctic-inference package: bash scripts/install_arctic_inference.sh")


def machine_header(args) -> tuple[str, int]:
    cores, _ = cores_and_load()
    header = (
        f"rollout benchmark: toy policy/drafter, {bench_common.header()}; dtype {args.dtype}, "
        f"{'eager' if args.eager else 'torch.compile'}, max_tokens {args.max_tokens}, "
        f"{args.repeats} timed call(s) per cell after 1 warm-up call per engine"
    )
    return header, cores


def run_methods(args, models, tok, cores: int) -> list[dict]:
    """One engine (all cores) per (method, k); every batch size and temperature on it."""
    from rl_specdec.rollout import SamplingSettings

    rows: list[dict] = []
    prompts = {b: [task_prompts(tok, b, seed=100 * b + r) for r in range(args.repeats)] for b in args.batch_sizes}
    todo = variants(args.methods, args.ks)
    for n, (method, k) in enumerate(todo, 1):
        log(f"[{n}/{len(todo)}] {method} k={k}")
        g = start(models, method, args, 1, cores, k=k)
        try:
            w = warm_up(g, task_prompts(tok, max(args.batch_sizes), seed=1), args.max_tokens)
            log(f"  warm-up {w:.2f}s")
            for temp in args.temperatures:
                for b in args.batch_sizes:
                    s = SamplingSettings(max_tokens=args.max_tokens, temperature=temp, seed=0 if temp > 0 else None)
                    r = timed_calls(g, prompts[b], s)
                    r.update(method=method, k=k, temperature=temp, batch=b)
                    rows.append(r)
                    log(
                        f"  T={temp:g} batch={b}: {r['time_s']:.3f}s/call {r['tok_per_s']:.0f} tok/s "
                        f"acc_len={fmt(r['acceptance_length'], '{:.2f}')}"
                    )
        finally:
            g.shutdown()
    return rows


def run_engines(args, models, tok, cores: int) -> list[dict]:
    from rl_specdec.rollout import SamplingSettings

    rows: list[dict] = []
    batches = [task_prompts(tok, args.engines_batch, seed=7 + r) for r in range(args.repeats)]
    prompts = batches[0]
    layouts = [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]
    for method in args.engines_methods:
        for n, c in layouts:
            g = start(models, method, args, n, c)
            try:
                warm_up(g, prompts, args.max_tokens)
                for temp in args.temperatures:
                    s = SamplingSettings(max_tokens=args.max_tokens, temperature=temp, seed=0 if temp > 0 else None)
                    r = timed_calls(g, batches, s)
                    out = g.generate(prompts, s)  # per-engine busy time of one more call: the load balance
                    r.update(
                        method=method,
                        temperature=temp,
                        engines=n,
                        cores=c,
                        batch=len(prompts),
                        per_engine_time_s=out.per_engine_time_s,
                    )
                    rows.append(r)
                    log(f"  {method} {n}x{c} T={temp:g}: {r['time_s']:.3f}s/call {r['tok_per_s']:.0f} tok/s")
            finally:
                g.shutdown()
    return rows


def run(args, print_tables: bool = True) -> dict:
    """Both parts as configured; writes rollout.md, rollout.json and rollout.png under args.out."""
    import ray

    from rl_specdec.toy.build import build_tokenizer, build_toy_models

    header, cores = machine_header(args)
    log(header)
    models = build_toy_models(log=log)
    tok = build_tokenizer()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"header": header, "quick": bool(args.quick), "methods": [], "engines": []}
    md = [f"_{header}_", ""]
    if not has_suffix():
        md += [
            "_suffix: skipped, the arctic-inference package is not installed (bash "
            "scripts/install_arctic_inference.sh)_",
            "",
        ]
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        if not args.engines_only:
            results["methods"] = run_methods(args, models, tok, cores)
            glance, table = speedup_table(results["methods"]), method_table(results["methods"])
            if print_tables:
                print("\n### Rollout speed-up over no speculation, one engine on all cores\n")
                print(glance)
                print("\n### Rollout throughput, one engine on all cores\n")
                print(table, flush=True)
            md += [
                "### Rollout speed-up over no speculation, one engine on all cores",
                "",
                glance,
                "",
                "![rollout throughput](rollout.png)",
                "",
            ]
            md += ["### Rollout throughput, one engine on all cores", "", table, ""]
            plot_methods(results["methods"], out_dir / "rollout.png")
        if args.engines or args.engines_only:
            results["engines"] = run_engines(args, models, tok, cores)
            table = engines_table(results["engines"]) + "\n\n" + engines_verdict(results["engines"])
            title = (
                f"### Data parallel on {cores} cores: 1 engine x {cores} cores vs {cores} engines x 1 core, "
                f"batch {args.engines_batch}"
            )
            print(f"\n{title}\n")
            print(table, flush=True)
            md += [title, "", table, ""]
    finally:
        ray.shutdown()
    (out_dir / "rollout.md").write_text("\n".join(md) + "\n")
    (out_dir / "rollout.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {out_dir / 'rollout.md'}, rollout.json and rollout.png")
    return results


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
