"""Throughput and latency of the OpenAI-compatible server under concurrent clients.

One async engine with its HTTP server is started on the toy policy for each
speculation setting (none and draft_model k=3 by default), all at once. For
each concurrency level C, C closed-loop clients send chat requests back to
back (each waits for its answer before sending the next) until
``C * --rounds`` requests (at least ``--min-requests``) have been answered.
Requests are sorting-task prompts at temperature 1 with at most
``--max-tokens`` new tokens; every request is seeded.

Only one engine works at a time, and the engines take turns cell by cell (in
alternating order), so a load that drifts during the run hits both settings.
Repetition 0 is untimed: vLLM's CPU backend pays a one-off cost for every new
batch shape, which would otherwise land on whichever cell runs first. Each
cell is then timed ``--repeats`` times.

Reported per cell: requests/s (median over repeats), latency p50 and max
(seconds, client side, HTTP included, pooled over repeats), generated
tokens/s (median), the spec-decode acceptance length, and each repeat's
requests/s (to show the spread). Nothing else should run on the machine
meanwhile; the JSON lines printed during the run include the load average.

    python benchmarks/server_concurrency.py
    python benchmarks/server_concurrency.py --methods none draft_model ngram --concurrency 1 8 32 --out results/server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path


def spec_for(method: str, drafter: str):
    if method == "none":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    raise ValueError(method)


async def run_level(url: str, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int, seed: int, timeout: float):
    import httpx

    latencies: list[float] = []
    tokens = 0
    next_i = 0

    async def client_loop(client, cid: int):
        nonlocal next_i, tokens
        while next_i < n_requests:
            i = next_i
            next_i += 1
            body = {
                "model": "toy",
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": seed + i,
            }
            t = time.perf_counter()
            r = await client.post(url + "/chat/completions", json=body)
            latencies.append(time.perf_counter() - t)
            r.raise_for_status()
            tokens += len(r.json()["choices"][0]["message"]["generation_token_ids"])

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client_loop(client, c) for c in range(concurrency))), timeout=10 * timeout)
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "wall_s": wall,
        "requests_per_s": len(latencies) / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "latencies": latencies,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["none", "draft_model"], choices=["none", "draft_model", "ngram"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions of every cell (after one untimed)")
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request client timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for results.json and table.md")
    args = ap.parse_args(argv)

    import ray

    from rl_specdec.environments.sorting import SortingTask
    from rl_specdec.generation import GenerationConfig, validate_vllm_kwargs
    from rl_specdec.generation.group import AsyncVllmGeneration
    from rl_specdec.spec_decode import aggregate_spec_decode_counters, compute_spec_decode_metrics
    from rl_specdec.toy.build import build_toy_models
    from rl_specdec.toy.presets import TOY_CHAT_TEMPLATE, toy_engine_kwargs, usable_cores

    toy = build_toy_models()
    prompts = [s.prompt[:-1] for s in SortingTask().make_batch(seed=args.seed + 17, n=64)]  # the template adds "="
    cores = usable_cores()
    load0 = os.getloadavg()
    # every engine gets all cores; only one engine works at a time
    ray.init(address="local", num_cpus=cores * len(args.methods), include_dashboard=False, log_to_driver=False)
    engines, cells = {}, {}
    try:
        for method in args.methods:
            kw = validate_vllm_kwargs(toy_engine_kwargs(speculative_config=spec_for(method, str(toy.drafter))), str(toy.policy))
            engines[method] = AsyncVllmGeneration(
                str(toy.policy),
                GenerationConfig(num_engines=1, cpus_per_engine=cores, vllm_kwargs=kw),
                seed=args.seed,
                server={"chat_template": TOY_CHAT_TEMPLATE, "served_model_name": "toy"},
            )
        urls = {m: g.base_urls()[0] for m, g in engines.items()}
        for rep in range(args.repeats + 1):  # repetition 0 warms up every (engine, level): the CPU backend
            for c in args.concurrency:  # pays a one-off cost for each new batch shape
                n = max(args.min_requests, c * args.rounds)
                order = args.methods if rep % 2 == 0 else args.methods[::-1]  # alternate, so drifting load hits both
                for method in order:
                    g = engines[method]
                    before = aggregate_spec_decode_counters(g.engine_counters())  # only this level's traffic
                    row = asyncio.run(run_level(urls[method], prompts, c, n, args.max_tokens, args.seed + 1000 * c + rep, args.timeout))
                    sm = compute_spec_decode_metrics(before, aggregate_spec_decode_counters(g.engine_counters()))
                    row.update(method=method, rep=rep, load1=os.getloadavg()[0], acceptance_length=sm.get("spec_decode/acceptance_length"))
                    print(json.dumps({k: v for k, v in row.items() if k != "latencies"}), flush=True)
                    if rep > 0:
                        cells.setdefault((method, c), []).append(row)
    finally:
        for g in engines.values():
            g.shutdown()
        ray.shutdown()
    load1 = os.getloadavg()

    rows = []
    for (method, c), reps in sorted(cells.items(), key=lambda kv: (args.methods.index(kv[0][0]), kv[0][1])):
        lat = [x for r in reps for x in r["latencies"]]
        acc = [r["acceptance_length"] for r in reps if r["acceptance_length"]]
        rows.append(
            {
                "method": method,
                "concurrency": c,
                "requests": sum(r["requests"] for r in reps),
                "requests_per_s": statistics.median(r["requests_per_s"] for r in reps),
                "latency_p50_s": statistics.median(lat),
                "latency_max_s": max(lat),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps),
                "acceptance_length": statistics.mean(acc) if acc else None,
                "repeats": [round(r["requests_per_s"], 2) for r in reps],
            }
        )
    base = {r["concurrency"]: r["requests_per_s"] for r in rows if r["method"] == "none"}
    lines = [
        "| speculation | concurrent requests | requests | requests/s (median) | latency p50 (s) | latency max (s) | tokens/s | acceptance length | req/s vs none | req/s per repeat |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        sp = f"{r['requests_per_s'] / base[r['concurrency']]:.2f}x" if r["concurrency"] in base else "-"
        lines.append(
            f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.2f} | {r['latency_p50_s']:.2f} | "
            f"{r['latency_max_s']:.2f} | {r['tokens_per_s']:.0f} | {al} | {sp} | {', '.join(map(str, r['repeats']))} |"
        )
    table = "\n".join(lines)
    note = (
        f"max_tokens={args.max_tokens}, temperature 1, {cores} cores, {args.repeats} timed repeats per cell "
        f"(engines alternate); load average before {load0[0]:.1f}, after {load1[0]:.1f}"
    )
    print(table)
    print(note)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args), "load_before": load0, "load_after": load1}, indent=2))
        (out / "table.md").write_text(table + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
