"""The cost table of a toy pair: t(b, k), the engine step's time at batch b with k drafted tokens, and E[L(k)].

Two engines on the pair, alive side by side: no speculation, and draft_model
with ``num_speculative_tokens: 5`` whose k is set at run time
(``speculation_control.mode=fixed``; k=0 takes the fast path). For each round
(one seed), each batch size and each k (engine order rotating), one call of
``--tokens`` tokens per request with ``ignore_eos``.

* Without speculation every request gains one token a step, so the batch stays
  b for the whole call: the step time is the call's time over its engine steps,
  less those of a call of 4 tokens (so the prefill and a call's fixed cost drop
  out).
* With k drafts, requests gain 1 to k+1 tokens a step and reach ``max_tokens``
  at different steps, so a call ends in a tail of smaller batches; its time over
  its steps would price t(b, k) at a smaller b, 15-30% low from b=8 up. The step
  time is instead the mean time of the call's steps that verified k drafts for
  all b requests, from the fast path's own record of each step (its start to the
  next one's, as ``benchmarks/step_records.py`` returns them).

The
acceptance length E[L(k)] is measured apart, on task prompts that stop
naturally (temperature 1), because tokens past EOS are not the task's.

The speed-up that k buys at batch b is E[L(k)] · t(b, none) / t(b, k): the
table prints it for every cell and the best k per batch. Torch.compile is on,
as in the GRPO configs. Writes ``cost_table_<pair>.json`` and ``.md`` to ``--out`` (results/cost-table)::

    python -m benchmarks cost-table --pair wide --seeds 0,1
    python -m benchmarks cost-table --pair toy --seeds 0,1
    python -m benchmarks cost-table --pair wide --seeds 0,1 --drafter eagle3   # cost_table_wide_eagle3.*

With ``--drafter eagle3`` the speculative engine drafts with the pair's EAGLE-3 head; its k=0 steps are plain
steps too (the head is caught up from the hidden states they keep before it next drafts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import bench_common
from benchmarks.bench_common import cores_and_load, log
from benchmarks.step_records import engine_group, importable

K_MAX = 5
PAIRS = {  # pair -> (max_model_len, KV bytes per engine, acceptance max_tokens)
    "toy": (128, 2**28, 40),
    "wide": (512, 2**29, 448),
}


def pair_models(pair: str):
    if pair == "toy":
        from rl_specdec.toy.build import build_toy_models

        return build_toy_models()
    from rl_specdec.toy.wide import build_wide_models

    return build_wide_models()


def pair_prompts(pair: str, tokenizer, n: int, seed: int) -> list[list[int]]:
    if pair == "toy":
        from rl_specdec.tasks.sorting import SortingTask

        task = SortingTask(max_len=24)
    else:
        from rl_specdec.tasks.longtail import LongTailSortTask

        task = LongTailSortTask(4, 8)
    return [tokenizer.encode(s.prompt) for s in task.make_batch(seed=seed, n=n)]


def drafter_spec(models, drafter: str) -> dict:
    """The speculative engine's config: the pair's draft model, or an EAGLE-3 head built for its target."""
    if drafter == "eagle3":
        from rl_specdec.heads.build import build_head

        model = str(build_head(models))
    else:
        model = str(models.drafter)
    return {"method": drafter, "model": model, "num_speculative_tokens": K_MAX, "draft_sample_method": "probabilistic"}


def start(models, pair: str, speculate: bool, model=None, drafter: str = "draft_model"):
    from rl_specdec.config import generation_config
    from rl_specdec.config.generation import SpeculationControlConfig

    max_len, kv, _ = PAIRS[pair]
    spec = drafter_spec(models, drafter) if speculate else None
    kw = {"max_model_len": max_len, "kv_cache_memory_bytes": kv, "dtype": "float32", "speculative_config": spec}
    kw["enable_prefix_caching"] = False  # the short and the long call prefill alike
    cfg = generation_config(
        str(model or models.policy),
        kw,
        num_engines=1,
        cpus_per_engine=2,
        self_check=False,
        speculation_control=SpeculationControlConfig(mode="fixed" if speculate else "off"),
    )
    return engine_group(speculate)(str(model or models.policy), cfg)


SHORT = 4  # tokens of the short call whose time and steps are subtracted (the prefill, the call's own overhead)


def timed_call(plain, draft, k: int | None, prompts, tokens: int, seed: int) -> tuple[float, int]:
    """(seconds, engine steps) of the decode steps at batch b of one ignore_eos call of ``tokens`` tokens per
    request. k=None is the engine without speculation: a call of SHORT tokens is timed as well and subtracted,
    which removes the prefill step and the fixed cost of a call. With the speculative engine: the steps its
    fast path recorded that verified k drafts (k=0: plain steps) for all b requests, and their time."""
    from rl_specdec.rollout import SamplingSettings

    if k is None:
        dts = []
        for n in (SHORT, SHORT + tokens):
            sampling = SamplingSettings(max_tokens=n, temperature=1.0, seed=seed, ignore_eos=True)
            t0 = time.perf_counter()
            plain.generate(prompts, sampling)
            dts.append(time.perf_counter() - t0)
        return dts[1] - dts[0], tokens
    draft.set_speculation(k)
    draft.engine_rpc("rl_specdec_step_records")
    draft.generate(prompts, SamplingSettings(max_tokens=SHORT + tokens, temperature=1.0, seed=seed, ignore_eos=True))
    b = len(prompts)
    full = [r["period_s"] for r in draft.engine_rpc("rl_specdec_step_records")[0] if _full_step(r, b, k)]
    if not full:
        raise RuntimeError(f"no engine step at b={b} with k={k} was recorded; raise --tokens")
    return sum(full), len(full)


def _full_step(r: dict, b: int, k: int) -> bool:
    """A decode step of all b requests with k drafts each, whose time is known (k=0: a plain step with a
    draft model, vLLM's own k=0 step, which runs the head's first pass, with an EAGLE-3 head)."""
    return bool(r["period_s"]) and r["b"] == b and r["tokens"] == b * (k + 1) and r["k_verify"] == k


def acceptance(draft, prompts, max_tokens: int, seed: int) -> dict[int, float]:
    """E[L(k)] for k = 1..K_MAX on prompts that stop naturally, at temperature 1."""
    from rl_specdec.metrics import compute_spec_decode_metrics
    from rl_specdec.rollout import SamplingSettings

    out = {}
    for k in range(1, K_MAX + 1):
        draft.set_speculation(k)
        res = draft.generate(prompts, SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=seed))
        out[k] = compute_spec_decode_metrics(None, res.spec_counters)["spec_decode/acceptance_length"]
        log(f"  E[L({k})] = {out[k]:.2f}")
    return out


def measure(plain, draft, prompts, batches, tokens: int, seeds) -> list[dict]:
    """Every (b, k) cell over ``seeds`` rounds, configurations in rotating order."""
    configs = [None] + list(range(K_MAX + 1))
    raw: dict[tuple[int, int | None], list[tuple[float, int]]] = {}
    for b in batches:  # warm-up: every batch size once through each engine (torch.compile's shapes)
        timed_call(plain, draft, None, prompts[:b], 4, 0)
        timed_call(plain, draft, K_MAX, prompts[:b], 16, 0)
    for r, seed in enumerate(seeds):
        for b in batches:
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for k in order:
                raw.setdefault((b, k), []).append(timed_call(plain, draft, k, prompts[:b], tokens, seed))
            log(f"  seed {seed} b={b}: " + " ".join(f"{_name(k)} {1e3 * _step(raw[b, k]):.1f}ms" for k in configs))
    return [
        {"b": b, "k": _name(k), "step_s": _step(v), "steps": sum(s for _, s in v), "tokens": b * tokens * len(v)}
        for (b, k), v in sorted(raw.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]))
    ]


def _name(k: int | None) -> str:
    return "none" if k is None else str(k)


def _step(calls: list[tuple[float, int]]) -> float:
    """Seconds per engine step: the median over rounds of each call's time over its (timed) steps."""
    return statistics.median(dt / steps for dt, steps in calls)


def drafter_pass(models, pair: str, prompts, tokens: int, seeds) -> float:
    """One drafter pass: the drafter's own decode step at batch 1, run as a model of its own (no speculation),
    with the target's engine settings; an upper bound on a pass inside a speculative step."""
    g = start(models, pair, False, model=models.drafter)
    try:
        timed_call(g, None, None, prompts[:1], 4, 0)  # warm-up
        return statistics.median(dt / n for dt, n in (timed_call(g, None, None, prompts[:1], tokens, s) for s in seeds))
    finally:
        g.shutdown()


def marginal_pass(cells: list[dict], from_k: int = 1) -> float:
    """What one more drafted token adds to a step at batch 1: the least-squares slope of t(1, k) over
    k = from_k..K_MAX."""
    pts = [(int(c["k"]), c["step_s"]) for c in cells if c["b"] == 1 and c["k"] not in ("none", "0")]
    pts = [(k, t) for k, t in pts if k >= from_k]
    mk, mt = statistics.fmean(k for k, _ in pts), statistics.fmean(t for _, t in pts)
    return sum((k - mk) * (t - mt) for k, t in pts) / sum((k - mk) ** 2 for k, _ in pts)


def table(cells: list[dict], accept: dict[int, float]) -> str:
    """Markdown: t(b, k) in ms, and the speed-up E[L(k)]·t(b, none)/t(b, k) of each k; the best k per batch."""
    t = {(c["b"], c["k"]): c["step_s"] for c in cells}
    batches = sorted({c["b"] for c in cells})
    ks = [str(k) for k in range(K_MAX + 1)]
    head = "| b | none (ms) | " + " | ".join(f"k={k} (ms)" for k in ks) + " | "
    head += " | ".join(f"k={k} speed-up" for k in ks[1:]) + " | best k |"
    lines = [head, "|" + "---|" * (3 + 2 * K_MAX + 1)]
    for b in batches:
        base = t[b, "none"]
        ups = {int(k): accept[int(k)] * base / t[b, k] for k in ks[1:]}
        best = max(ups, key=ups.get) if max(ups.values()) > base / t[b, "0"] else 0
        row = [str(b), f"{1e3 * base:.2f}"] + [f"{1e3 * t[b, k]:.2f}" for k in ks]
        row += [f"{'**' if int(k) == best else ''}{ups[int(k)]:.2f}x{'**' if int(k) == best else ''}" for k in ks[1:]]
        lines.append("| " + " | ".join(row + [str(best)]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=sorted(PAIRS), default="wide")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request in a timed call")
    p.add_argument("--seeds", default="0,1", help="one timed round per seed")
    p.add_argument("--accept-prompts", type=int, default=64)
    p.add_argument(
        "--drafter",
        choices=("draft_model", "eagle3"),
        default="draft_model",
        help="the pair's draft model, or an EAGLE-3 head built for its target (toy:*-eagle3)",
    )
    bench_common.add_out(p, "cost-table", "cost_table_<pair>.json and .md")
    args = p.parse_args(argv)
    if "1" not in args.batches.split(","):
        p.error(f"--batches {args.batches}: include 1 (the cost ratio and the drafter's marginal pass are at b=1)")
    run(args)


def run(args) -> None:
    import ray
    import vllm
    from transformers import AutoTokenizer

    cores, load = cores_and_load()
    head = bench_common.header()
    print(f"# cost table, pair {args.pair}, drafter {args.drafter}: {head}", flush=True)
    batches, seeds = [int(x) for x in args.batches.split(",")], [int(x) for x in args.seeds.split(",")]
    models = pair_models(args.pair)
    tok = AutoTokenizer.from_pretrained(models.policy)
    prompts = pair_prompts(args.pair, tok, max(batches), seed=1000)
    importable()
    ray.init(num_cpus=cores + 2, include_dashboard=False, log_to_driver=False)
    # a head cannot run as a model of its own: its pass is priced by t(1, k)'s slope and by t(1, 0) - t(1, none)
    pass_s = drafter_pass(models, args.pair, prompts, args.tokens, seeds) if args.drafter == "draft_model" else None
    plain, draft = start(models, args.pair, False), start(models, args.pair, True, drafter=args.drafter)
    try:
        log("acceptance on task prompts:")
        accept = acceptance(draft, prompts[: args.accept_prompts], PAIRS[args.pair][2], seed=seeds[0])
        log("timed cells:")
        cells = measure(plain, draft, prompts, batches, args.tokens, seeds)
    finally:
        plain.shutdown()
        draft.shutdown()
    ctx = statistics.fmean(len(q) for q in prompts) + args.tokens / 2
    for c in cells:
        c["context_mean"] = ctx
    result = {
        "pair": args.pair,
        "machine": head,
        "load_avg_start": load,
        "vllm": vllm.__version__,
        "dtype": "float32",
        "threads": cores,
        "target_params": _params(models.policy),
        "drafter": args.drafter,
        "drafter_params": _params(drafter_spec(models, args.drafter)["model"]),
        "drafter_pass_s": pass_s,
        "drafter_marginal_s": marginal_pass(cells),
        "drafter_marginal_from_k2_s": marginal_pass(cells, from_k=2),
        "target_step_b1_s": next(c["step_s"] for c in cells if c["b"] == 1 and c["k"] == "none"),
        "acceptance_length": {str(k): v for k, v in accept.items()},
        "command": "python -m benchmarks cost-table " + " ".join(sys.argv[1:]),
        "cells": cells,
    }
    out = Path(args.out) / f"cost_table_{args.pair}{'' if args.drafter == 'draft_model' else '_' + args.drafter}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    with bench_common.markdown_report(args.out, out.with_suffix(".md").name, f"Cost table, pair {args.pair}", head):
        summary(result, accept, cells, pass_s)
    print(f"written to {out} and {out.with_suffix('.md')}")


def summary(result: dict, accept: dict, cells: list[dict], pass_s: float | None) -> None:
    target, marginal = result["target_step_b1_s"], result["drafter_marginal_s"]
    if pass_s is not None:
        print(
            f"target step at b=1 {1e3 * target:.2f} ms, drafter pass (its own step at b=1) "
            f"{1e3 * pass_s:.2f} ms: ratio {target / pass_s:.1f}x; one more drafted token adds "
            f"{1e3 * marginal:.2f} ms at b=1 (slope of t(1, k))"
        )
    else:
        k0 = next(c["step_s"] for c in cells if c["b"] == 1 and c["k"] == "0") - target
        m2 = result["drafter_marginal_from_k2_s"]
        print(
            f"target step at b=1 {1e3 * target:.2f} ms; the head's pass: one more drafted token adds "
            f"{1e3 * marginal:.2f} ms at b=1 (slope of t(1, k), k=1..{K_MAX}), {1e3 * m2:.2f} ms (k=2..{K_MAX}); "
            f"k=0 (a plain step that keeps the hidden states for the head) adds {1e3 * k0:.2f} ms to the target's "
            f"step, {1e3 * target:.2f} ms"
        )
    print("E[L(k)]: " + ", ".join(f"k={k} {v:.2f}" for k, v in accept.items()))
    print(table(cells, accept))


def _params(folder) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(n).get_shape()) for n in f.keys())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
