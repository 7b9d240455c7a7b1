"""What the real model's EAGLE-3 head costs against one of its steps, and what it buys in generation.

The model is SmolLM2-135M-Instruct (configs/smollm2_base.yaml). Two heads, each
one decoder layer built as ``pkg:smollm2-135m-instruct-eagle3`` is (the same
answers, steps and seed; configs/smollm2_eagle3.yaml): one drafts through the
model's own 49,152-token LM head, the other through its own LM head over the
4,096 tokens the model answered with most often (EAGLE-3's draft vocabulary).

First, in torch at batch 1 after a prompt of ``--context`` tokens: one decode
step of the model (transformers, its KV cache) against one drafting step of the
head (its layer over the same cached keys, its norm and its LM head), the
median of ``--reps`` each. This is the weight the head adds per drafted token.

Then what they buy in generation: engines side by side (none, ngram k=3, each
head at k=3), each call a batch of b task prompts sampled as a GRPO step
samples them (temperature 1, up to ``max_new_tokens``, the round's seed), the
engines' order alternating by round. Sampled lengths differ between the
engines, so the speed-up is pooled: generated tokens over seconds, summed over
rounds; the acceptance length is pooled over the same calls::

    python -m benchmarks.studies.head_cost --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from benchmarks.bench_common import header
from benchmarks.studies.ngram_cost import generation_table

REPO = Path(__file__).resolve().parents[2]
HEAD = "policy.generation.vllm_kwargs.speculative_config.model"
DRAFT_VOCABULARIES = {"whole vocabulary": 0, "4,096-token draft vocabulary": 4096}


def median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pass_costs(policy: str, head_folder: str, context: int, reps: int) -> tuple[float, float]:
    """(the model's decode step, the head's drafting step) in seconds at batch 1, torch, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.heads.eagle3 import load_head, rms_norm, rotate

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    head = load_head(head_folder).eval()
    s = head.shape
    lm_head = head.lm_head.weight if s.draft_vocab_size else model.get_output_embeddings().weight
    ids = torch.randint(0, s.vocab_size, (1, context))  # [1, T]
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values

        def target_step():
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the token just decoded: the next rep decodes the same position

        heads = (1, s.num_attention_heads, context, s.head_dim)
        # [1, heads, T, D]: the head's cached keys and values over the context
        keys = [rotate(torch.randn(heads), torch.arange(context), s.rope_theta)]
        values = [torch.randn(heads)]
        emb, g = torch.randn(1, 1, s.hidden_size), torch.randn(1, 1, s.hidden_size)
        pos = torch.tensor([context])

        def head_step():
            out, _, _ = head._layer(emb, g, keys, values, pos, None)
            torch.argmax(rms_norm(out, head.norm, s.rms_norm_eps)[:, -1] @ lm_head.T, -1)

        return median_s(target_step, reps), median_s(head_step, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="sampled calls per batch size and engine")
    p.add_argument("--context", type=int, default=100, help="tokens before the timed pass (a prompt's ~74, +)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    import torch
    from transformers import AutoTokenizer

    from rl_specdec.config import load_config
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.placement import stop_ray
    from rl_specdec.tasks import encode_prompts, make_task
    from rl_specdec.toy.heads import CHAT_HEAD, build_chat_head
    from rl_specdec.toy.resolve import prepare_models

    print(header())
    base = prepare_models(load_config(REPO / "configs/smollm2_base.yaml"))
    settings = {"none": base, "ngram k=3": prepare_models(load_config(REPO / "configs/smollm2_spec.yaml"))}
    print("| head | model decode step (ms) | head drafting step (ms) | head / step |\n|---|---|---|---|")
    for name, n in DRAFT_VOCABULARIES.items():
        folder = build_chat_head(Path(base.policy.model_name), dataclasses.replace(CHAT_HEAD, draft_vocab=n))
        settings[f"eagle3 k=3, {name}"] = prepare_models(
            load_config(REPO / "configs/smollm2_eagle3.yaml", [f"{HEAD}={folder}"])
        )
        torch.set_num_threads(2)
        step_s, head_s = pass_costs(base.policy.model_name, str(folder), args.context, args.reps)
        print(f"| {name} | {step_s * 1e3:.2f} | {head_s * 1e3:.2f} | {head_s / step_s:.3f} (1/{step_s / head_s:.1f}) |")

    run_batch = base.grpo.num_prompts_per_step * base.grpo.num_generations_per_prompt
    tokenizer = AutoTokenizer.from_pretrained(base.policy.model_name)
    task = make_task(base.task.name, **base.task.kwargs)
    prompts = encode_prompts(task, tokenizer, task.make_batch(seed=0, n=run_batch))
    import ray

    ray.init(num_cpus=2 * len(settings), include_dashboard=False, log_to_driver=False)  # engines share 2 cores
    engines, drafts, batches = {}, {}, (1, 8, run_batch)
    try:
        for name, cfg in settings.items():  # built inside the try: one that fails to start stops the others
            engines[name] = VllmGeneration(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)
        sampling = SamplingSettings.from_config(base.policy.generation)
        table = generation_table(engines, prompts, sampling, batches, args.rounds, drafts)
    finally:
        for e in engines.values():
            e.shutdown()
        stop_ray()
    print(f"\nGeneration, {args.rounds} rounds of sampled calls, engines side by side:\n\n{table}\n")
    print("| batch | " + " | ".join(f"{n}: acceptance length" for n in list(settings)[1:]) + " |")
    print("|---" * len(settings) + "|")
    for b in batches:
        cells = [f"{1 + d[1] / d[0]:.2f}" if (d := drafts.get((n, b))) and d[0] else "–" for n in list(settings)[1:]]
        print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
