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

    python benchmarks/k0_cost.py --batch 128 --rounds 9 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rollout import cores_and_load, log, task_prompts

SCHEDULE = [[1, 1, 3], [2, 1024, 0]]
ENGINES = {  # name -> (speculative_config or None, speculation_control mode)
    "no speculation": (None, "off"),
    "k=0 by vLLM's schedule": ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": SCHEDULE}, "off"),
    "k=0, fast path": ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": SCHEDULE}, "fixed"),
    "k=3": ({"num_speculative_tokens": 3}, "off"),
}


def start(models, spec: dict | None, mode: str):
    from rl_specdec.config import GenerationConfig, validate_vllm_kwargs
    from rl_specdec.config.generation import SpeculationControlConfig
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.toy.presets import toy_engine_kwargs

    if spec is not None:
        spec = {"method": "draft_model", "model": str(models.drafter), **spec}
    kw = validate_vllm_kwargs({**toy_engine_kwargs(), "speculative_config": spec}, str(models.policy))
    cfg = GenerationConfig(
        num_engines=1,
        cpus_per_engine=2,
        vllm_kwargs=kw,
        self_check=False,
        speculation_control=SpeculationControlConfig(mode=mode),
    )
    return VllmGeneration(str(models.policy), cfg)


def measure(engines: dict, tok, batch: int, rounds: int, seed: int, max_tokens: int) -> dict[str, list[float]]:
    """{engine: [seconds per call]}, one call per engine per round, engines in rotating order."""
    from rl_specdec.rollout import SamplingSettings

    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(-2, rounds):  # two warm-up rounds
        prompts = task_prompts(tok, batch, seed=1000 * seed + r + 2)
        sampling = SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + r)
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            engines[n].generate(prompts, sampling)
            if r >= 0:
                times[n].append(time.perf_counter() - t0)
    return times


def table(per_seed: dict[int, dict[str, list[float]]]) -> str:
    names = list(next(iter(per_seed.values())))
    ref = "no speculation"
    lines = [
        "| engine | time per call (s, median) | per seed | vs no speculation | paired ratio (median of rounds) |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        med = {sd: statistics.median(t[n]) for sd, t in per_seed.items()}
        pooled = statistics.median([x for t in per_seed.values() for x in t[n]])
        ref_pooled = statistics.median([x for t in per_seed.values() for x in t[ref]])
        paired = statistics.median([a / b for t in per_seed.values() for a, b in zip(t[n], t[ref])])
        seeds = ", ".join(f"{v:.3f}" for v in med.values())
        lines.append(f"| {n} | {pooled:.3f} | {seeds} | {pooled / ref_pooled:.3f}x | {paired:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9, help="timed calls per engine and seed (after 2 warm-up rounds)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--out", default="results/k0_cost")
    args = p.parse_args(argv)
    import ray

    from rl_specdec.toy.build import build_tokenizer, build_toy_models

    cores, load = cores_and_load()
    log(
        f"k=0 cost: batch {args.batch}, {args.max_tokens} tokens at temperature 1, {args.rounds} rounds per seed; "
        f"{cores} cores, load average at start {load:.2f}"
    )
    models, tok = build_toy_models(log=log), build_tokenizer()
    # engines side by side, one runs at a time
    ray.init(num_cpus=2 * len(ENGINES), include_dashboard=False, log_to_driver=False)
    engines = {}
    try:
        for n, (spec, mode) in ENGINES.items():
            engines[n] = start(models, spec, mode)
            log(f"  started {n}")
        per_seed = {
            int(sd): measure(engines, tok, args.batch, args.rounds, int(sd), args.max_tokens)
            for sd in args.seeds.split(",")
        }
    finally:
        for g in engines.values():
            g.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "k0_cost.json").write_text(json.dumps({"load": load, "batch": args.batch, "times": per_seed}, indent=1))
    print(table(per_seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
