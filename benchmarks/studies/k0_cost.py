"""What speculation costs where it drafts nothing: k=0 through vLLM's schedule against the k=0 fast path.

Four engines on the toy pair, alive side by side, and their calls interleaved
(engine order rotating each round), so that a load change hits every engine
alike: no speculation; draft_model with vLLM's schedule ``[[1,1,3],[2,1024,0]]``
(k=0 whenever 2 or more requests run), run by vLLM as is; the same schedule
through rl_specdec's run-time k (``speculation_control.mode=fixed``, so k=0
steps take the fast path); and draft_model k=3. Each call is a batch of task
prompts at temperature 1 with ``ignore_eos`` off. It prints the median time
per call, its ratio to no speculation, and the median of the per-round paired
ratios::

    python -m benchmarks.studies.k0_cost --batch 128 --rounds 9 --seeds 0,1

``--like-default`` builds the engines from configs/grpo_spec.yaml through ``load_config``, as the default
run does (precision auto, so bfloat16 on a CPU with native bf16; compiled; prefix caching), and makes the
default run's generate calls (its task's 64 problems each repeated 8 times, 40 tokens, temperature 1, the
step's seeds). Its engines: no speculation; k=0 everywhere through the fast path (mode fixed, then
``set_speculation(0)``); the fast path with ``[[1,1,3],[2,1024,0]]``; and the earlier default (vLLM's k=3). It also
prints where each call's time goes (median ms per call: driver, actor, vLLM's ``LLM.generate``, the
engine steps and their parts; benchmarks/studies/engine_parts.py)::

    python -m benchmarks.studies.k0_cost --like-default --rounds 7 --seeds 0,1

``--engines`` picks the --like-default engines by name (";"-separated), among them a second engine without
speculation (the spread between two processes that run the same code) and the controller::

    python -m benchmarks.studies.k0_cost --like-default --rounds 7 --seeds 0,1 --engines \
        "no speculation;no speculation, a second engine;k=0 everywhere, fast path;the controller (adaptive, k <= 4)"

``--refit`` refits every engine's target before each of its calls (the policy's own weights, streamed in
buckets as a GRPO step streams them; untimed), so the calls follow a refit as the GRPO run's do. ``--set`` applies
a config override to every engine, e.g. the KV cache's budget::

    python -m benchmarks.studies.k0_cost --like-default --refit --rounds 4 --seeds 0,1 \
        --set policy.generation.vllm_kwargs.kv_cache_memory_bytes=268435456 \
        --engines "no speculation;no speculation, a second engine;fast path, k=3 at 1 request"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.rollout.rollout import cores_and_load, log, task_prompts
from benchmarks.step_records import importable
from benchmarks.studies import engine_parts

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "grpo_spec.yaml"
SPEC = "policy.generation.vllm_kwargs.speculative_config"
CONTROL = "policy.generation.speculation_control"
# --like-default: name -> (overrides of configs/grpo_spec.yaml, loaded as a run loads it; k set after start).
# A schedule of k=0 alone is refused at load, so "k=0 everywhere" is mode fixed with set_speculation(0).
LIKE_DEFAULT = {
    "no speculation": ([f"{SPEC}=null", f"{CONTROL}.mode=off"], None),
    "k=0 everywhere, fast path": ([f"{CONTROL}.mode=fixed"], 0),
    "fast path, k=3 at 1 request": (
        [f"{CONTROL}.mode=fixed", f"{CONTROL}.draft_below=2"],
        None,
    ),
    "the earlier default (k=3)": ([f"{CONTROL}.mode=off"], None),
    # the control: a second engine without speculation, so the spread between two processes running the
    # same code shows beside the floor (--engines)
    "no speculation, a second engine": ([f"{SPEC}=null", f"{CONTROL}.mode=off"], None),
    "the controller (adaptive, k <= 4)": (
        [f"{CONTROL}.mode=adaptive", f"{CONTROL}.k_max=4", f"{CONTROL}.draft_below=null"],
        None,
    ),
}
LIKE_DEFAULT_SHOWN = list(LIKE_DEFAULT)[:4]  # the default --engines
SCHEDULE = [[1, 1, 3], [2, 1024, 0]]
ENGINES = {  # name -> (speculative_config or None, speculation_control mode)
    "no speculation": (None, "off"),
    "k=0 by vLLM's schedule": ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": SCHEDULE}, "off"),
    "k=0, fast path": ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": SCHEDULE}, "fixed"),
    "k=3": ({"num_speculative_tokens": 3}, "off"),
}


def start(models, spec: dict | None, mode: str):
    from rl_specdec.config import generation_config
    from rl_specdec.config.generation import SpeculationControlConfig
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.toy.presets import toy_engine_kwargs

    if spec is not None:
        spec = {"method": "draft_model", "model": str(models.drafter), **spec}
    cfg = generation_config(
        str(models.policy),
        {**toy_engine_kwargs(), "speculative_config": spec},
        num_engines=1,
        cpus_per_engine=2,
        self_check=False,
        speculation_control=SpeculationControlConfig(mode=mode),
    )
    return VllmGeneration(str(models.policy), cfg)


def start_like_default(overrides: list[str], k: int | None):
    """An engine group built from configs/grpo_spec.yaml as a run builds it (precision auto, compiled,
    prefix caching), whose actors time the parts of each call (engine_parts)."""
    from rl_specdec.config import load_config
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(DEFAULT_CONFIG, overrides))
    group = engine_parts.engine_group()(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)
    if k is not None:
        group.set_speculation(k)
    return group


def default_calls(seed: int):
    """Round r's call as the default run's step r+2 makes it (rl_specdec.grpo.step.rollout_request): the
    task's P problems each repeated G times, the step's seeds, the generation settings, no top-k log-probs."""
    from transformers import AutoTokenizer

    from rl_specdec.config import load_config
    from rl_specdec.grpo.step import prompt_seed, sampling_seed
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.tasks import encode_prompts, make_task
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(DEFAULT_CONFIG))
    task, tok = make_task(cfg.task.name, **cfg.task.kwargs), AutoTokenizer.from_pretrained(cfg.policy.model_name)
    P, G = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt

    def call(r: int):
        step = r + 2
        samples = task.make_batch(seed=prompt_seed(seed, step), n=P)
        prompts = [ids for ids in encode_prompts(task, tok, samples) for _ in range(G)]  # [P*G], prompt-major
        gen = cfg.policy.generation
        return prompts, SamplingSettings.from_config(gen, seed=sampling_seed(seed, step), logprobs=0)

    return call


def toy_calls(tok, batch: int, seed: int, max_tokens: int):
    """Round r's call: ``batch`` sorting prompts of 4 to 24 digits, temperature 1."""
    from rl_specdec.rollout import SamplingSettings

    def call(r: int):
        prompts = task_prompts(tok, batch, seed=1000 * seed + r + 2)
        return prompts, SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + r)

    return call


def policy_buckets(model_name: str, max_bytes: int):
    """A function that returns the policy's weights as a GRPO refit streams them: ObjectRefs of dicts of at
    most ``max_bytes`` (rl_specdec.policy.state.bucketed), fp32, HF names."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.policy import state

    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    pieces = [ray.put(b) for b in state.bucketed(state.full_state_items(model, torch.float32), max_bytes)]
    return lambda: iter(pieces)


def measure(engines: dict, call, rounds: int, parts: dict | None = None, refit=None) -> dict[str, list[float]]:
    """{engine: [seconds per call]}, one call per engine per round, engines in rotating order; with ``parts``,
    each timed call's part times (engine_parts) are appended to ``parts[engine]``. With ``refit`` (a function
    returning weight buckets), every engine's target is refitted before each of its calls, untimed, as a GRPO
    step does before its generation."""
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(-2, rounds):  # two warm-up rounds
        prompts, sampling = call(r)
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            if refit is not None:
                engines[n].update_weights_buckets(refit())
            t0 = time.perf_counter()
            engines[n].generate(prompts, sampling)
            dt = time.perf_counter() - t0
            got = engine_parts.parts(engines[n]) if parts is not None else {}
            if r >= 0:
                times[n].append(dt)
                if parts is not None:
                    parts.setdefault(n, []).append({**got, "driver call": dt})
    return times


def table(per_seed: dict[int, dict[str, list[float]]]) -> str:
    names = list(next(iter(per_seed.values())))
    ref = "no speculation"
    lines = [
        "| engine | time per call (s, median) | per seed | speed-up vs no speculation | "
        "paired speed-up (median of rounds) |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        med = {sd: statistics.median(t[n]) for sd, t in per_seed.items()}
        pooled = statistics.median([x for t in per_seed.values() for x in t[n]])
        ref_pooled = statistics.median([x for t in per_seed.values() for x in t[ref]])
        paired = statistics.median([b / a for t in per_seed.values() for a, b in zip(t[n], t[ref])])
        seeds = ", ".join(f"{v:.3f}" for v in med.values())
        lines.append(f"| {n} | {pooled:.3f} | {seeds} | {ref_pooled / pooled:.3f}x | {paired:.3f}x |")
    return "\n".join(lines)


def _get(p: dict, key: str) -> float:
    return p.get(key, 0.0)


# parts table rows: label -> seconds (or a count) of one call, from its engine_parts dict
PART_ROWS = {
    "driver: the generate call": lambda p: _get(p, "driver call"),
    "driver outside the actor (Ray, gather)": lambda p: _get(p, "driver call") - _get(p, "actor generate"),
    "actor: generate": lambda p: _get(p, "actor generate"),
    "actor after LLM.generate (results, counters, RPCs)": lambda p: _get(p, "actor generate") - _get(p, "LLM.generate"),
    "of which run-time k's report RPC": lambda p: _get(p, "rpc rl_specdec_spec_report"),
    "LLM.generate": lambda p: _get(p, "LLM.generate"),
    "outside engine steps (add requests, outputs)": lambda p: (
        _get(p, "LLM.generate") - _get(p, "step_fn") - _get(p, "post_step")
    ),
    "engine steps (EngineCore.step)": lambda p: _get(p, "step_fn"),
    "schedule": lambda p: _get(p, "schedule"),
    "execute_model": lambda p: _get(p, "execute_model"),
    "sample_tokens": lambda p: _get(p, "sample_tokens"),
    "update_from_output": lambda p: _get(p, "update_from_output"),
    "post_step (draft hand-off)": lambda p: _get(p, "post_step"),
}


def parts_table(parts: dict[str, list[dict]]) -> str:
    """Median over timed calls (both seeds) of each part, ms per call; then steps per call and ms per step."""
    names = list(parts)
    lines = ["| ms per call (median) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, fn in PART_ROWS.items():
        vals = [statistics.median(fn(p) for p in parts[n]) * 1e3 for n in names]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    steps = [statistics.median(_get(p, "steps") for p in parts[n]) for n in names]
    per_step = [statistics.median(_get(p, "step_fn") / max(_get(p, "steps"), 1) for p in parts[n]) for n in names]
    lines.append("| engine steps per call | " + " | ".join(f"{v:.0f}" for v in steps) + " |")
    lines.append("| ms per engine step | " + " | ".join(f"{v * 1e3:.2f}" for v in per_step) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9, help="timed calls per engine and seed (after 2 warm-up rounds)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument(
        "--like-default",
        action="store_true",
        help="engines and calls as configs/grpo_spec.yaml's run makes them (ignores --batch and --max-tokens)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --like-default: a config override for every engine (repeatable), "
        "e.g. policy.generation.vllm_kwargs.enforce_eager=true",
    )
    p.add_argument(
        "--engines",
        default=";".join(LIKE_DEFAULT_SHOWN),
        help=f"with --like-default: the engines, ';'-separated, from: {'; '.join(LIKE_DEFAULT)}",
    )
    p.add_argument(
        "--refit",
        action="store_true",
        help="with --like-default: refit every engine's target (the same weights, streamed as a GRPO step "
        "streams them) before each of its calls, untimed",
    )
    p.add_argument("--out", default="results/k0_cost")
    args = p.parse_args(argv)
    chosen = [n.strip() for n in args.engines.split(";") if n.strip()]
    for n in chosen:
        if n not in LIKE_DEFAULT:
            p.error(f"--engines: unknown engine {n!r}; choose from {'; '.join(LIKE_DEFAULT)}")
    if "no speculation" not in chosen:
        p.error("--engines: include 'no speculation', the reference of every ratio")
    args.chosen = chosen
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = args.chosen
    import ray

    from rl_specdec.toy.build import build_tokenizer, build_toy_models

    cores, load = cores_and_load()
    what = "the default run's calls" if args.like_default else f"batch {args.batch}, {args.max_tokens} tokens"
    log(f"k=0 cost: {what} at temperature 1, {args.rounds} rounds per seed; {cores} cores, load average {load:.2f}")
    models, tok = build_toy_models(log=log), build_tokenizer()
    specs = {n: LIKE_DEFAULT[n] for n in chosen} if args.like_default else ENGINES
    importable()  # benchmarks.studies.engine_parts, for the actors
    # engines side by side, one runs at a time
    ray.init(num_cpus=2 * len(specs), include_dashboard=False, log_to_driver=False)
    engines, parts = {}, ({} if args.like_default else None)
    try:
        for n, spec in specs.items():
            if args.like_default:
                engines[n] = start_like_default([*args.set, *spec[0]], spec[1])
            else:
                engines[n] = start(models, *spec)
            log(f"  started {n}")
        refit = None
        if args.refit and args.like_default:
            from rl_specdec.config import load_config
            from rl_specdec.toy.resolve import prepare_models

            cfg = prepare_models(load_config(DEFAULT_CONFIG, args.set))
            refit = policy_buckets(cfg.policy.model_name, cfg.policy.refit_bucket_bytes)
        per_seed = {}
        for sd in map(int, args.seeds.split(",")):
            call = default_calls(sd) if args.like_default else toy_calls(tok, args.batch, sd, args.max_tokens)
            per_seed[sd] = measure(engines, call, args.rounds, parts, refit)
    finally:
        for g in engines.values():
            g.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = {
        "load": load,
        "like_default": args.like_default,
        "refit": args.refit,
        "batch": args.batch,
        "times": per_seed,
        "parts": parts,
    }
    (out / "k0_cost.json").write_text(json.dumps(raw, indent=1))
    print(table(per_seed))
    if parts:
        print()
        print(parts_table(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
