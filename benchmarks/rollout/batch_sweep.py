"""Where does a config's speculation pay? Its generation speed-up over no speculation at each batch size, on
its own model, task and sampling settings: the measurement behind a batch-size schedule for k.

Every variant is a run config (a file and overrides); the first is the baseline. Their engines are alive side by
side and take turns (the order rotating by seed), so every variant generates from the same weights (the config's
model, as GRPO's step 0 does) and the same prompts:

* for each batch size b in ``--batches``: ``max(1, --requests // b)`` calls of b task prompts each, sampled with
  the config's rollout settings (temperature, stop tokens, ``max_new_tokens``), request i with seed + i;
* the rollout row: one call of GRPO's step-0 shape, ``grpo.num_prompts_per_step`` prompts with
  ``grpo.num_generations_per_prompt`` samples each.

Sampled lengths differ by chance between variants (speculation is lossless in distribution, not sample by
sample), so a cell's speed-up is the pooled ratio: generated tokens over seconds, summed over its calls and seeds,
against the baseline's. The range gives each seed's own ratio. The table also gives the acceptance length of each
speculative variant, the best k among the fixed-k variants (named ``<drafter> k=N``) per batch size, and the
schedule that follows (``num_speculative_tokens_per_batch_size``: that k where it measured at least
``--min-gain`` faster pooled and no slower on any seed, 0 elsewhere)::

    python -m benchmarks batch-sweep --seeds 0,1     # the real model: none against ngram k=1..3, and the schedule
    python -m benchmarks batch-sweep --seeds 0,1 --variants "none: configs/smollm2_base.yaml; \\
        vLLM k=0 path: configs/smollm2_spec.yaml policy.generation.speculation_control.mode=off; \\
        shipped: configs/smollm2_spec.yaml"           # the shipped schedule, with and without the fast path

Writes ``batch_sweep.json`` and ``.md`` to ``--out`` (results/batch-sweep).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from benchmarks import bench_common
from benchmarks.bench_common import log

BASE = "configs/smollm2_base.yaml"
NGRAM_K = (
    "policy.generation.vllm_kwargs.speculative_config="
    "{{method: ngram, num_speculative_tokens: {k}, prompt_lookup_max: 4, prompt_lookup_min: 2}}"
)
DEFAULT_VARIANTS = ";".join([f"none: {BASE}"] + [f"ngram k={k}: {BASE} {NGRAM_K.format(k=k)}" for k in (1, 2, 3)])
# 1 GiB of KV a variant holds 64 requests at max_model_len with room (five engines side by side in 24 GiB)
KV = "policy.generation.vllm_kwargs.kv_cache_memory_bytes=1073741824"
ROLLOUT = "rollout"
FIXED_K = re.compile(r"\bk=(\d+)$")  # a fixed-k variant's name: "ngram k=2", "head k=3"


def parse_variants(text: str) -> list[tuple[str, str, list[str]]]:
    """``name: config [key=value ...];...`` -> [(name, config, overrides)]; ValueError naming a malformed entry."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, sep, rest = entry.partition(":")
        if not sep or not name.strip() or not rest.strip():
            raise ValueError(f"--variants entry {entry!r}: write name: config [key=value ...]")
        config, *overrides = _split_overrides(rest.strip())
        out.append((name.strip(), config, overrides))
    if len(out) < 2:
        raise ValueError("--variants needs a baseline and at least one more variant, separated by ';'")
    return out


def variants_or_exit(parser, text: str) -> list[tuple[str, str, list[str]]]:
    """:func:`parse_variants`, or the parser's usage error naming the malformed entry."""
    try:
        return parse_variants(text)
    except ValueError as e:
        parser.error(str(e))


def _split_overrides(rest: str) -> list[str]:
    """The config path, then overrides split on spaces outside braces (a dict value keeps its spaces)."""
    parts, depth, cur = [], 0, ""
    for ch in rest:
        depth += (ch == "{") - (ch == "}")
        if ch == " " and depth == 0:
            parts, cur = parts + [cur] if cur else parts, ""
        else:
            cur += ch
    return parts + [cur] if cur else parts


def start_variant(config: str, overrides: list[str]):
    from rl_specdec.config import load_config
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(config, overrides + [KV]))
    return cfg, VllmGeneration(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)


def calls_for(b, prompts: list[list[int]], requests: int, cfg) -> list[list[list[int]]]:
    """The prompt lists of one cell: disjoint slices of b prompts, or GRPO's step-0 rollout."""
    if b == ROLLOUT:
        n, g = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
        return [[p for p in prompts[:n] for _ in range(g)]]
    return [prompts[i * b : (i + 1) * b] for i in range(max(1, requests // b))]


def timed(engine, calls, sampling) -> dict:
    """Seconds, generated tokens and summed spec-decode counters over the calls of one cell."""
    out = {"s": 0.0, "tokens": 0, "counters": {}}
    for prompts in calls:
        t0 = time.perf_counter()
        res = engine.generate(prompts, sampling)
        out["s"] += time.perf_counter() - t0
        out["tokens"] += sum(len(ids) for ids in res.token_ids)
        for key, v in res.spec_counters.items():
            out["counters"][key] = add_counter(out["counters"].get(key), v)
    return out


def add_counter(a, b):
    """Two values of one spec-decode counter summed (a list per position, or a number; a None: the other)."""
    if a is None:
        return b
    return [x + y for x, y in zip(a, b)] if isinstance(b, list) else a + b


def measure(engines: dict, cfg, prompts_by_seed: dict, batches: list, requests: int) -> dict:
    """{(variant, b, seed): cell}, variants in rotating order per seed and batch size."""
    from rl_specdec.rollout import SamplingSettings

    names, cells = list(engines), {}
    for r, (seed, prompts) in enumerate(prompts_by_seed.items()):
        sampling = SamplingSettings.from_config(cfg.policy.generation, seed=seed)
        for j, b in enumerate(batches):
            shift = (r + j) % len(names)
            for name in names[shift:] + names[:shift]:
                cells[name, b, seed] = timed(engines[name], calls_for(b, prompts, requests, cfg), sampling)
            base = cells[names[0], b, seed]
            log(
                f"  seed {seed} b={b}: {names[0]} {base['tokens'] / base['s']:.0f} tok/s; "
                + ", ".join(f"{n} {_ratio(cells, n, names[0], b, [seed]):.2f}x" for n in names[1:])
            )
    return cells


def _ratio(cells: dict, name: str, base: str, b, seeds) -> float:
    """Pooled tokens/s of ``name`` over the baseline's, at batch size b over ``seeds``."""
    tok = sum(cells[name, b, s]["tokens"] for s in seeds) / sum(cells[name, b, s]["s"] for s in seeds)
    ref = sum(cells[base, b, s]["tokens"] for s in seeds) / sum(cells[base, b, s]["s"] for s in seeds)
    return tok / ref


def _acceptance(cells: dict, name: str, b, seeds) -> float | None:
    from rl_specdec.metrics import compute_spec_decode_metrics

    total: dict = {}
    for s in seeds:
        for key, v in cells[name, b, s]["counters"].items():
            total[key] = add_counter(total.get(key), v)
    if not total:
        return None
    return compute_spec_decode_metrics(None, total).get("spec_decode/acceptance_length")


def best_k(cells: dict, names: list[str], b, seeds, min_gain: float) -> int:
    """The k of the fastest fixed-k variant (named ``<drafter> k=K``: one drafter per sweep) at b among those that
    beat the baseline by ``min_gain`` pooled and were not slower on any seed; 0 if none did."""
    fixed = {}
    for n in names:
        if named := FIXED_K.search(n):
            pooled, worst = _ratio(cells, n, names[0], b, seeds), min(_ratio(cells, n, names[0], b, [s]) for s in seeds)
            if pooled >= 1 + min_gain and worst >= 1:
                fixed[int(named.group(1))] = pooled
    return max(fixed, key=fixed.get) if fixed else 0


def schedule(ks: dict[int, int], max_b: int = 1024) -> list[list[int]]:
    """vLLM's ranges from k per measured batch size: each measured b's k holds up to the next measured b."""
    bs = sorted(ks)
    out: list[list[int]] = []
    for i, b in enumerate(bs):
        lo, hi = (1 if i == 0 else b), (bs[i + 1] - 1 if i + 1 < len(bs) else max_b)
        if out and out[-1][2] == ks[b]:
            out[-1][1] = hi
        else:
            out.append([lo, hi, ks[b]])
    return out


def table(cells: dict, names: list[str], batches: list, seeds: list[int], min_gain: float) -> tuple[str, list]:
    """Markdown: per batch size the baseline's tokens/s, each variant's pooled speed-up (per-seed range) and
    acceptance length, and the best fixed k; and the schedule that follows."""
    head = f"| b | {names[0]} (tok/s) | " + " | ".join(f"{n}" for n in names[1:]) + " | best k |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    ks, fixed = {}, any(FIXED_K.search(n) for n in names)
    for b in batches:
        tok = sum(cells[names[0], b, s]["tokens"] for s in seeds) / sum(cells[names[0], b, s]["s"] for s in seeds)
        row = [str(b), f"{tok:.0f}"]
        for n in names[1:]:
            per = [_ratio(cells, n, names[0], b, [s]) for s in seeds]
            acc = _acceptance(cells, n, b, seeds)
            row.append(
                f"{_ratio(cells, n, names[0], b, seeds):.2f}x ({min(per):.2f}-{max(per):.2f})"
                + (f", L {acc:.2f}" if acc else "")
            )
        k = best_k(cells, names, b, seeds, min_gain)
        if b != ROLLOUT and fixed:
            ks[b] = k
        row.append(str(k) if fixed else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines), schedule(ks) if ks else []


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="name: config [key=value ...]; ... (the first is the baseline)"
    )
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--requests", type=int, default=16, help="requests a cell generates at least (small b: more calls)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--min-gain", type=float, default=0.02, help="how much faster a k>0 must be to enter the schedule")
    bench_common.add_out(p, "batch-sweep", "batch_sweep.json and .md")
    args = p.parse_args(argv)
    run(args, variants_or_exit(p, args.variants))


def run(args, variants) -> None:
    import ray

    from rl_specdec.grpo.run import prepare_task
    from rl_specdec.tasks import encode_prompts

    head = bench_common.header()
    print(f"# batch sweep: {head}", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    batches = [int(b) for b in args.batches.split(",")] + [ROLLOUT]
    # every engine reserves its config's CPU bundle; they take turns, so the bundles may oversubscribe the cores
    ray.init(num_cpus=4 * len(variants) + 2, include_dashboard=False, log_to_driver=False)
    engines, cfg = {}, None
    try:
        for name, config, overrides in variants:
            log(f"starting {name}: {config} {' '.join(overrides)}")
            c, engines[name] = start_variant(config, overrides)
            cfg = cfg or c
        tokenizer, task = prepare_task(cfg)
        n = max(args.requests, max(batches[:-1]), cfg.grpo.num_prompts_per_step)
        prompts = {s: encode_prompts(task, tokenizer, task.make_batch(seed=1000 + s, n=n)) for s in seeds}
        for e in engines.values():  # warm-up: one call at the largest batch and one at 1
            timed(e, [prompts[seeds[0]][: max(batches[:-1])], prompts[seeds[0]][:1]], _sampling(cfg, 99))
        cells = measure(engines, cfg, prompts, batches, args.requests)
    finally:
        for e in engines.values():
            e.shutdown()
    report(args, variants, cells, batches, seeds, head)


def _sampling(cfg, seed: int):
    from rl_specdec.rollout import SamplingSettings

    return SamplingSettings.from_config(cfg.policy.generation, seed=seed)


def report(args, variants, cells, batches, seeds, head) -> None:
    names = [v[0] for v in variants]
    md, sched = table(cells, names, batches, seeds, args.min_gain)
    out = Path(args.out) / "batch_sweep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": head,
        "command": "python -m benchmarks batch-sweep " + " ".join(sys.argv[1:]),
        "variants": [{"name": n, "config": c, "overrides": o} for n, c, o in variants],
        "cells": [{"variant": n, "b": b, "seed": s, **v} for (n, b, s), v in cells.items()],
        "schedule": sched,
    }
    out.write_text(json.dumps(result, indent=1))
    with bench_common.markdown_report(args.out, "batch_sweep.md", "Batch sweep", head):
        print(f"speed-up: pooled generated tokens/s over {names[0]}'s (per-seed range), L: acceptance length")
        print(md)
        if sched:
            print(f"\nschedule (k where it measured >= {1 + args.min_gain:.2f}x pooled, >= 1 on every seed): {sched}")
    print(f"written to {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
