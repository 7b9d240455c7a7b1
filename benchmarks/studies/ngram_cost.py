"""What one ngram drafter pass costs against one target step, on the real model (configs/smollm2_base.yaml).

The target step: one engine without speculation, built from the config as a run builds it, decoding a batch
of b task prompts (``benchmarks/rollout/cost_table.py``'s ``timed_call``: an ignore_eos call of ``--tokens`` tokens a
request, less one of 4 tokens, over its steps). The drafter pass: vLLM's own ``NgramProposer.batch_propose``
(the numba n-gram match the engine runs on the CPU each step) on the same b requests' token ids, prompt plus
``--tokens`` generated tokens, with the speculative settings of configs/smollm2_spec.yaml. Both at batch 1
and at the run's batch (prompts per step x samples).

Then what ngram buys in generation per batch size: the two configs' engines alive side by side, each call a
batch of b task prompts sampled as a GRPO step samples them (temperature 1, up to ``max_new_tokens``, the
round's seed), the engines' order alternating by round; the third engine runs vLLM's own schedule, k=3 while
at most 16 requests run and none above. Sampled lengths differ between the engines, so the
speed-up is pooled: generated tokens over seconds, summed over rounds::

    python -m benchmarks.studies.ngram_cost --seeds 0,1 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.bench_common import header
from benchmarks.rollout.cost_table import timed_call

REPO = Path(__file__).resolve().parents[2]
# vLLM's own schedule: k=3 while at most 16 requests run, none above (where a step is compute-bound)
TAIL_ONLY = (
    "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens_per_batch_size=[[1,16,3],[17,1024,0]]"
)
REPS = 200  # proposer calls per cell: each is tens of microseconds


def proposer(spec: dict, max_model_len: int, max_num_seqs: int):
    """vLLM's ngram proposer with the config's settings (it reads only these fields)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    keys = ("prompt_lookup_min", "prompt_lookup_max", "num_speculative_tokens")
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(**{k: spec[k] for k in keys}),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return NgramProposer(cfg)


def propose_s(ngram, sequences: list[list[int]], max_model_len: int) -> float:
    """Median seconds of one ``batch_propose`` over ``sequences`` (prompt and generated ids)."""
    b = len(sequences)
    ids = np.zeros((b, max_model_len), dtype=np.int32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        ngram.batch_propose(b, list(range(b)), lengths, ids, ngram.k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def generation_table(engines: dict, prompts, sampling, batches, rounds: int, drafts: dict | None = None) -> str:
    """Pooled tokens/s of each engine per batch size, and each one's speed-up over the first (none).
    ``drafts``, when given, gathers each (engine, batch)'s [drafts, accepted tokens] from the calls' counters."""
    from rl_specdec.metrics import compute_spec_decode_metrics

    done = {(name, b): [0, 0.0] for name in engines for b in batches}
    for r in range(rounds):
        for b in batches:
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                out = engines[name].generate(prompts[:b], replace(sampling, seed=1000 * r))
                done[name, b][1] += time.perf_counter() - t0
                done[name, b][0] += sum(map(len, out.token_ids))
                m = compute_spec_decode_metrics(None, out.spec_counters)
                if drafts is not None and m:
                    tally = drafts.setdefault((name, b), [0.0, 0.0])
                    tally[0] += m.get("spec_decode/num_drafts", 0.0)
                    tally[1] += m.get("spec_decode/num_accepted_tokens", 0.0)
    names = list(engines)
    lines = [
        "| batch | "
        + " | ".join(f"{n} (tokens/s)" for n in names)
        + " | "
        + " | ".join(f"{n}: speed-up (pooled)" for n in names[1:])
        + " |",
        "|---" * (2 * len(names)) + "|",
    ]
    for b in batches:
        rate = {n: done[n, b][0] / done[n, b][1] for n in names}
        cells = [f"{rate[n]:.1f}" for n in names] + [f"{rate[n] / rate[names[0]]:.2f}x" for n in names[1:]]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--tokens", type=int, default=24, help="generated tokens a request (the run's mean: ~20-30)")
    p.add_argument("--rounds", type=int, default=3, help="sampled calls per batch size and engine")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from rl_specdec.config import load_config
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.placement import stop_ray
    from rl_specdec.tasks import encode_prompts, make_task
    from rl_specdec.toy.resolve import prepare_models

    print(header())
    base, spec = (prepare_models(load_config(REPO / f"configs/smollm2_{n}.yaml")) for n in ("base", "spec"))
    gen, ngram_spec = base.policy.generation, spec.policy.generation.speculation.to_vllm()
    run_batch = base.grpo.num_prompts_per_step * base.grpo.num_generations_per_prompt
    tokenizer = AutoTokenizer.from_pretrained(base.policy.model_name)
    task = make_task(base.task.name, **base.task.kwargs)
    prompts = encode_prompts(task, tokenizer, task.make_batch(seed=0, n=run_batch))
    max_len = gen.vllm_kwargs["max_model_len"]
    ngram = proposer(ngram_spec, max_len, run_batch)
    import ray

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)  # three engines on the same 2 cores
    tail = prepare_models(load_config(REPO / "configs/smollm2_spec.yaml", [TAIL_ONLY])).policy.generation
    settings = {
        "none": (base, gen),
        "ngram k=3": (spec, spec.policy.generation),
        "ngram k=3 at <= 16 requests": (spec, tail),
    }
    engines, rows = {}, []
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        for name, (cfg, g) in settings.items():  # built inside the try: one that fails to start stops the others
            engines[name] = VllmGeneration(cfg.policy.model_name, g, cfg.cluster, seed=cfg.seed)
        engine = engines["none"]
        timed_call(engine, None, None, prompts[:1], 4, 0)  # warm-up
        for b in (1, run_batch):
            steps = [dt / n for dt, n in (timed_call(engine, None, None, prompts[:b], args.tokens, s) for s in seeds)]
            out = engine.generate(prompts[:b], SamplingSettings(max_tokens=args.tokens, seed=seeds[0], ignore_eos=True))
            pass_s = propose_s(ngram, [p + ids for p, ids in zip(prompts[:b], out.token_ids)], max_len)
            rows.append((b, statistics.median(steps), pass_s))
        sampling = SamplingSettings.from_config(gen)
        table = generation_table(engines, prompts, sampling, (1, 8, run_batch), args.rounds)
    finally:
        for e in engines.values():
            e.shutdown()
        stop_ray()
    print("| batch | target step (ms) | ngram drafter pass (ms) | pass / step |\n|---|---|---|---|")
    for b, step_s, pass_s in rows:
        print(f"| {b} | {step_s * 1e3:.1f} | {pass_s * 1e3:.3f} | {pass_s / step_s:.4f} |")
    print(f"\nGeneration, {args.rounds} rounds of sampled calls, engines side by side:\n\n{table}")


if __name__ == "__main__":
    main()
