"""Greedy held-out accuracy of a config's policy before any training: the step-0 number, without a trainer.

    python examples/heldout_accuracy.py --config configs/smollm2_base.yaml \
        --task-kwargs '{min_steps: 1, max_steps: 1, max_start: 20}' --task-kwargs '{min_steps: 2, max_steps: 2}'

One engine of the config's generation settings; for each task setting (merged over ``task.kwargs``) the
``grpo.val_num_prompts`` problems of the validation split that GRPO's own validation uses, scored as it
scores them (rl_specdec/grpo/step.py ``evaluate``). Also prints the share of responses cut at
``max_new_tokens`` and their mean length, to size ``max_new_tokens``.

``--samples G`` samples G answers to each problem at the config's temperature instead, as GRPO's rollouts are
drawn: the share right, the problems with both a right and a wrong answer (the groups a first step learns
from), and the response lengths (median, p90, max), to see whether a task is long-tailed and learnable::

    python examples/heldout_accuracy.py --config configs/smollm2_reasoning_base.yaml --samples 8 \
        grpo.val_num_prompts=16
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from omegaconf import OmegaConf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--task-kwargs", action="append", help="a YAML map merged over task.kwargs; repeat it to compare settings"
    )
    parser.add_argument("--samples", type=int, default=0, help="answers sampled per problem (0: one greedy answer)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    if args.samples < 0:
        parser.error(f"--samples {args.samples}: give a number of answers per problem >= 1, or 0 for one greedy answer")

    from transformers import AutoTokenizer

    from rl_specdec.config import load_config
    from rl_specdec.grpo.sources import VAL_SEED, score
    from rl_specdec.rollout import SamplingSettings
    from rl_specdec.rollout.group import VllmGeneration
    from rl_specdec.rollout.placement import stop_ray
    from rl_specdec.tasks import encode_prompts, make_task
    from rl_specdec.toy.resolve import prepare_models

    cfg = prepare_models(load_config(args.config, args.overrides))
    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    generation = VllmGeneration(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=cfg.seed)
    if args.samples > 0:
        sampling, repeat = SamplingSettings.from_config(cfg.policy.generation, seed=cfg.seed), args.samples
    else:
        sampling, repeat = SamplingSettings.from_config(cfg.policy.generation, temperature=0.0), 1
    try:
        for extra in args.task_kwargs or ["{}"]:
            kwargs = {**cfg.task.kwargs, **OmegaConf.to_container(OmegaConf.create(extra))}
            run = SimpleNamespace(cfg=cfg, tokenizer=tokenizer, task=make_task(cfg.task.name, **kwargs))
            samples = run.task.validation_batch(seed=VAL_SEED, n=cfg.grpo.val_num_prompts)  # as evaluate() does
            samples = [s for s in samples for _ in range(repeat)]  # each problem's answers side by side
            t0 = time.time()
            out = generation.generate(encode_prompts(run.task, tokenizer, samples), sampling)
            _, correct = score(run, samples, out)
            cut = sum(r == "length" for r in out.finish_reasons) / len(out)
            mean_len = sum(map(len, out.token_ids)) / len(out)
            if repeat == 1:
                what = f"val/accuracy={correct.mean().item():.3f} on {len(out)} problems"
            else:
                what = _sampled(correct.view(-1, repeat), [len(t) for t in out.token_ids])
            print(
                f"task.kwargs={kwargs}: {what}, cut at max_new_tokens {cut:.2f}, mean length {mean_len:.0f} tokens "
                f"({time.time() - t0:.0f}s)",
                flush=True,
            )
            for s, ids, why in list(zip(samples, out.token_ids, out.finish_reasons))[:3]:
                print(f"  answer {s.answer}, {why}: {tokenizer.decode(ids)!r}", flush=True)
    finally:
        generation.shutdown()
        stop_ray()


def _sampled(correct, lengths: list[int]) -> str:
    """``correct`` [P, G] of G sampled answers to each of P problems; ``lengths`` their response lengths."""
    import torch

    right = correct.sum(1)  # [P]
    mixed = int(((right > 0) & (right < correct.shape[1])).sum())
    q = torch.tensor(lengths, dtype=torch.float).quantile(torch.tensor([0.5, 0.9, 1.0])).tolist()
    return (
        f"sampled accuracy {correct.mean().item():.3f} ({correct.shape[1]} answers to each of {correct.shape[0]} "
        f"problems), {mixed}/{correct.shape[0]} problems with a right and a wrong answer, response length median "
        f"{q[0]:.0f}, p90 {q[1]:.0f}, max {q[2]:.0f}"
    )


if __name__ == "__main__":
    main()
