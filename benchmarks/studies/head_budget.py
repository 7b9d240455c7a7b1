"""How far does the real model's EAGLE-3 head's acceptance length go with its build's budget (answers x steps)?

    python -m benchmarks.studies.head_budget       # 512 answers; 192 x 400 and 512 x 1000 steps (~40 min, 2 cores)

The shipped head (``rl_specdec.toy.heads.CHAT_HEAD``) trains 200 steps on 192 of SmolLM2-135M-Instruct's own
temperature-1 answers to the chat task, against the model's whole next-token distribution pooled in bf16 (98 KB a
position, 1.9 GB for the 192). Here the pool keeps the top ``--topk`` log-probs a position instead (64: 0.5 KB), so
the number of answers is set by the time it takes to sample and score them, not by memory. Everything else is the
build's: the head's shape, its 4,096-token draft vocabulary, AdamW with a one-cycle schedule at 3e-3, the
3-step training-time test, batches of 8 answers.

Acceptance length is measured offline, on held-out answers (other prompts, the same sampling): at every response
position, what a k=3 chain drafted probabilistically (as the configs draft) is expected to keep,
``1 + a0 + a0*a1 + a0*a1*a2``, where ``a_j = sum_x min(p(x), q(x))`` is the rejection sampler's acceptance of chain
step j (q: the head's draft distribution, p: the model's), teacher-forced on the sampled answer. The shipped head is
measured the same way, as the anchor for the engine's figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from benchmarks.bench_common import add_out, cores_and_load, log, markdown_report

POLICY = "pkg:smollm2-135m-instruct"
CHECKPOINTS = (100, 200, 400, 700, 1000, 1500, 2000)


def sample_answers(target, policy: str, n: int, seed: int) -> tuple[list, float]:
    """At least ``n`` of the model's temperature-1 answers, as batches of 8 (ids [8, T], mask [8, T]: 1 on the
    answer), and the seconds it took (transformers' generate, 64 prompts at a time)."""
    import torch

    from rl_specdec.toy.heads import chat_batches

    sample, rng, out, t0 = chat_batches(policy, target, batch=64), random.Random(seed), [], time.time()
    while 8 * len(out) < n:
        ids, mask = sample(rng)
        for i in range(0, ids.shape[0], 8):
            b, m = ids[i : i + 8], mask[i : i + 8]
            width = int(torch.nonzero(m.sum(0)).max()) + 1  # drop the columns past the longest answer
            out.append((b[:, :width], m[:, :width]))
        log(f"  sampled {8 * len(out)}/{n} answers ({time.time() - t0:.0f}s)")
    return out, time.time() - t0


def score(target, shape, batches, topk: int) -> tuple[list, float]:
    """Each batch's (ids, learn, aux, p) with p the model's next-token distribution at the learned rows: its top
    ``topk`` log-probs and their ids ([M, K] each), or the whole distribution ([M, V] probabilities) at 0."""
    import torch.nn.functional as F

    from rl_specdec.toy.heads import target_features

    out, t0 = [], time.time()
    for ids, mask in batches:
        learn = F.pad(mask[:, 1:], (0, 1))  # [B, T]: row t predicts an answer token t+1
        aux, logp = target_features(target, ids, shape.aux_layer_ids)
        rows = logp[learn > 0]  # [M, V]
        out.append((ids, learn, aux, rows.topk(topk, -1) if topk else rows.exp()))
    return out, time.time() - t0


def topk_head_loss(head, aux, input_ids, topk, mask, embed, steps: int):
    """``rl_specdec.heads.eagle3.head_loss`` for a head with a draft vocabulary, against the target's top-k log-probs
    (values, ids [M, K], the rows of ``mask`` in row-major order) instead of its whole distribution: the target's
    mass on the draft vocabulary's tokens among its top k, renormalised. Equal to ``head_loss`` at K = V."""
    import torch
    import torch.nn.functional as F

    values, index = topk
    keep = head.draft_ids()  # [n]
    to_draft = torch.full((head.shape.vocab_size,), -1, dtype=torch.long)
    to_draft[keep] = torch.arange(len(keep))
    position = mask.nonzero(as_tuple=True)[1]  # [M]: each target row's t
    total = 0.0
    for j, out in enumerate(head(aux, input_ids, embed, steps)):
        shift = j + 1
        rows = mask[:, shift:] > 0  # [B, T-j-1]
        logp = F.log_softmax(out[:, :-shift][rows] @ head.lm_head.weight.T, -1)  # [R, n]
        later = position >= shift
        draft = to_draft[index[later]]  # [R, K]: -1 off the draft vocabulary
        p = values[later].float().exp() * (draft >= 0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)  # [R, K]
        dense = torch.zeros_like(logp).scatter_add_(1, draft.clamp(min=0), p)  # [R, n]
        total = total + (-(dense * logp).sum(-1)).mean()
    return total / steps


def acceptance(head, held_out, embed, steps: int = 3) -> tuple[float, list[float]]:
    """Expected acceptance length of a ``steps``-token chain over held-out answer positions, and each chain step's
    mean acceptance (see the module's docstring)."""
    import torch
    import torch.nn.functional as F

    lengths, per_step = [], [[] for _ in range(steps)]
    with torch.no_grad():
        for ids, learn, aux, p in held_out:
            (b, t), v = ids.shape, p.shape[-1]
            target = torch.zeros(b, t, v)
            target[learn > 0] = p  # [B, T, V]: the model's distribution of token t+1, at the answer rows
            chain, length = torch.ones(b, t - 1), torch.ones(b, t - 1)
            for j, out in enumerate(head(aux, ids, embed, steps)):
                shift = j + 1
                q = torch.zeros(b, t - shift, v)
                q[..., head.draft_ids()] = F.softmax(out[:, :-shift] @ head.lm_head.weight.T, -1)  # [B, T-j-1, V]
                a = torch.minimum(q, target[:, shift:]).sum(-1) * (learn[:, shift:] > 0)  # [B, T-j-1]
                a = F.pad(a, (0, j))[:, : t - 1]  # [B, T-1]: row t's step j; past the answer nothing is kept
                per_step[j].append(a[learn[:, 1:] > 0])
                chain = chain * a
                length = length + chain
            lengths.append(length[learn[:, 1:] > 0])  # rows whose first draft is an answer token
    return float(torch.cat(lengths).mean()), [float(torch.cat(a).mean()) for a in per_step]


def train_curve(target, shape, pool, counts, held_out, answers: int, steps: int, seed: int) -> list[dict]:
    """The build's recipe on the first ``answers`` of the pool for ``steps`` steps, measured at each checkpoint."""
    import torch

    from rl_specdec.heads.eagle3 import Eagle3Head
    from rl_specdec.toy.heads import CHAT_HEAD, with_draft_vocabulary

    embed, lm_head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    torch.manual_seed(seed)
    head = with_draft_vocabulary(Eagle3Head(shape), counts, CHAT_HEAD.draft_vocab, lm_head)
    opt = torch.optim.AdamW(head.parameters(), lr=CHAT_HEAD.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=CHAT_HEAD.lr, total_steps=steps, pct_start=0.1)
    batches, rows, t0, train_s = pool[: answers // 8], [], time.time(), 0.0
    for step in range(steps):
        ids, learn, aux, topk = batches[step % len(batches)]
        loss = topk_head_loss(head, aux, ids, topk, learn, embed, CHAT_HEAD.chain_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step + 1 in CHECKPOINTS or step + 1 == steps:
            train_s += time.time() - t0
            length, alphas = acceptance(head.eval(), held_out, embed)
            head.train()
            rows.append({"answers": answers, "steps": step + 1, "train_s": train_s, "L": length, "a": alphas})
            log(f"  {answers} answers, step {step + 1}/{steps}: L {length:.3f}, a {[round(a, 3) for a in alphas]}")
            t0 = time.time()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", type=int, default=512, help="answers sampled for training (the largest run's)")
    p.add_argument("--held-out", type=int, default=128, help="held-out answers the acceptance is measured on")
    p.add_argument("--topk", type=int, default=64, help="log-probs kept a position in the pool")
    p.add_argument("--runs", default="192x400,512x1000", help="answers x steps, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    add_out(p, "head_budget")
    args = p.parse_args(argv)
    try:
        runs = [(int(a), int(s)) for a, s in (r.split("x") for r in args.runs.split(","))]
    except ValueError:
        p.error(f"--runs {args.runs!r}: give answers x steps, comma-separated, e.g. --runs 192x400,512x1000")
    if max(a for a, _ in runs) > args.answers:
        p.error(f"--runs {args.runs} asks for more answers than --answers {args.answers}: raise --answers")
    with markdown_report(args.out, "head_budget.md", "The real model's EAGLE-3 head: acceptance against budget") as f:
        cores, load = cores_and_load()
        print(f"{POLICY}, {cores} cores, load average {load:.2f} at the start\n")
        rows = measure(args, runs)
        (f / "head_budget.json").write_text(json.dumps(rows, indent=1))
        print_table(rows)
    return 0


def measure(args, runs) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.config.models import HEAD_SUFFIX
    from rl_specdec.heads.eagle3 import HeadShape, load_head
    from rl_specdec.toy.heads import CHAT_HEAD
    from rl_specdec.toy.packaged import packaged_model_path

    policy = packaged_model_path(POLICY, "policy.model_name")
    shipped = packaged_model_path(POLICY + HEAD_SUFFIX, "speculative_config.model")  # built the first time
    torch.set_num_threads(cores_and_load()[0])
    target = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    shape = HeadShape.for_target(target.config, CHAT_HEAD.intermediate_size)
    log("sampling held-out answers")
    held_out, _ = score(target, shape, sample_answers(target, policy, args.held_out, args.seed + 1)[0], 0)
    log("sampling training answers")
    answers, sample_s = sample_answers(target, policy, args.answers, args.seed)
    pool, score_s = score(target, shape, answers, args.topk)
    counts = torch.zeros(shape.vocab_size, dtype=torch.long)
    for ids, learn, _, _ in pool:  # the draft vocabulary: the most frequent answer tokens, as the build picks it
        counts += torch.bincount(ids[:, 1:][learn[:, :-1] > 0], minlength=shape.vocab_size)
    embed = target.get_input_embeddings().weight.detach()
    length, alphas = acceptance(load_head(shipped).eval(), held_out, embed)
    rows = [{"answers": CHAT_HEAD.pool * 8, "steps": CHAT_HEAD.steps, "shipped": True, "L": length, "a": alphas}]
    per_answer = (sample_s + score_s) / (8 * len(pool))
    for n, steps in runs:
        for row in train_curve(target, shape, pool, counts, held_out, n, steps, args.seed):
            rows.append({**row, "build_s": n * per_answer + row["train_s"]})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| head | answers | steps | build time (sample + score + train) | acceptance length, k=3 | a0, a1, a2 |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        name = "shipped (whole distribution)" if r.get("shipped") else "top-k targets"
        build = f"{r['build_s'] / 60:.1f} min" if "build_s" in r else "(cached)"
        alphas = ", ".join(f"{a:.3f}" for a in r["a"])
        print(f"| {name} | {r['answers']} | {r['steps']} | {build} | {r['L']:.3f} | {alphas} |")


if __name__ == "__main__":
    sys.exit(main())
