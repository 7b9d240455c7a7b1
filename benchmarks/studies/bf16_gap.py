"""Where the real model's bf16 log-prob gap comes from: two bf16 computations of the same tokens against fp32.

Under ``policy.precision: bf16-mixed`` the trainer runs autocast over fp32 weights (matmuls in bf16; the residual
stream, the norms and the log-softmax in fp32), while the engines hold bf16 weights and compute everything in bf16.
This scores the same sequences three ways with transformers, on the CPU:

* ``fp32``: the model in float32 (what both sides compute under ``fp32``);
* ``autocast``: float32 weights under ``torch.autocast(cpu, bfloat16)`` (the trainer's bf16-mixed arithmetic);
* ``bf16``: the model cast to bfloat16, log-softmax in float32 (an engine's arithmetic, with transformers' kernels
  instead of vLLM's);

and prints the mean and the largest absolute difference of the response tokens' log-probs between each pair. The
sequences are the task's chat prompts with the model's own temperature-1 answers (``--prompts`` x ``--samples``)::

    python -m benchmarks.studies.bf16_gap --prompts 8 --samples 4
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os

import torch


def sequences(model, tokenizer, n_prompts: int, samples: int, seed: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of each prompt's sampled answers."""
    from rl_specdec.tasks import encode_prompts, make_task

    task = make_task("chat_arithmetic", min_steps=1, max_steps=1, max_start=10, operations=["lose"], max_operand=10)
    torch.manual_seed(seed)
    out = []
    for prompt in encode_prompts(task, tokenizer, task.validation_batch(seed=seed, n=n_prompts)):
        ids = torch.tensor([prompt] * samples)
        with torch.no_grad():
            sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=48)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), **sampling)
        pad = tokenizer.pad_token_id
        for row in gen.tolist():
            answer = list(itertools.takewhile(lambda t: t != pad, row[len(prompt) :]))
            out.append((prompt + answer, len(prompt)))
    return out


def token_logprobs(model, ids: list[int], start: int, mode: str) -> torch.Tensor:
    """The log-probs of tokens ``start..`` of ``ids`` under ``model`` in ``mode``, float32, [T - start]."""
    x = torch.tensor([ids])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        logits = model(x).logits[0, start - 1 : -1].float()  # [T - start, V]
    return torch.log_softmax(logits, -1).gather(-1, x[0, start:, None])[:, 0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_specdec.sysinfo import machine_label
    from rl_specdec.toy.packaged import packaged_model_path

    print(f"{machine_label()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    path = packaged_model_path("pkg:smollm2-135m-instruct", "policy.model_name")
    tokenizer = AutoTokenizer.from_pretrained(path)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    seqs = sequences(fp32, tokenizer, args.prompts, args.samples, args.seed)
    lp = {m: [] for m in ("fp32", "autocast", "bf16")}
    for ids, start in seqs:
        for mode, model in (("fp32", fp32), ("autocast", fp32), ("bf16", bf16)):
            lp[mode].append(token_logprobs(model, ids, start, mode))
    cat = {m: torch.cat(v) for m, v in lp.items()}
    print(f"{len(seqs)} sequences, {cat['fp32'].numel()} response tokens")
    print("| pair | mean abs difference (nats) | largest |")
    print("|---|---|---|")
    for a, b in (("autocast", "fp32"), ("bf16", "fp32"), ("autocast", "bf16")):
        d = (cat[a] - cat[b]).abs()
        print(f"| {a} against {b} | {d.mean():.2e} | {d.max():.2e} |")


if __name__ == "__main__":
    main()
