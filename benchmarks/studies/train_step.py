"""The policy's train step on the default run's batch, per ``policy.precision``.

The batch has the default run's shape (configs/grpo_spec.yaml): 64 sorting
prompts of 4-8 digits x 8 samples = 512 sequences (6-10 prompt tokens; as
response the answer and EOS, 5-9 tokens, cut short at random in half of the
samples), every advantage non-zero (the run trains only the samples whose
group's rewards differ: this is its largest step), micro_batch_size 64, a
frozen reference as grpo.log_kl keeps. A fresh batch every step, so the
shapes vary as in a run. One worker per precision in this process, the
precisions interleaved step by step, after two warm-up steps::

    python -m benchmarks.studies.train_step                       # fp32 vs bf16-mixed, seeds 0 and 1, 6 steps each
    python -m benchmarks.studies.train_step --profile bf16-mixed  # and a profile of one step: self time by op, dtype
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import torch


def default_batch(seed: int, prompts: int = 64, group: int = 8) -> dict[str, torch.Tensor]:
    from rl_specdec.grpo.batch import Trajectory, build_train_batch
    from rl_specdec.tasks.sorting import SortingTask
    from rl_specdec.toy.build import build_tokenizer

    tok = build_tokenizer()
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for s in SortingTask(min_len=4, max_len=8).make_batch(seed=seed, n=prompts):
        prompt, answer = tok.encode(s.prompt), tok.encode(s.answer) + [tok.eos_token_id]
        for _ in range(group):
            cut = (
                int(torch.randint(2, len(answer), (1,), generator=g))
                if torch.rand(1, generator=g) < 0.5
                else len(answer)
            )
            response = answer[:cut]
            trajectories.append(
                Trajectory.single_turn(prompt, response, (-0.1 - torch.rand(len(response), generator=g)).tolist())
            )
    return build_train_batch(trajectories, torch.randn(len(trajectories), generator=g), tok.pad_token_id)


def worker(precision: str, micro_batch_size: int):
    from rl_specdec.config import PolicyConfig
    from rl_specdec.policy import PolicyWorker
    from rl_specdec.toy.build import build_toy_models

    w = PolicyWorker(
        PolicyConfig(
            model_name=str(build_toy_models().policy),
            device="cpu",
            precision=precision,
            micro_batch_size=micro_batch_size,
        ),
        keep_reference=True,
    )
    w.start()
    return w


def profile_step(w, batch, loss_fn, top: int) -> None:
    """One step under torch.profiler; self time per (op, dtype of its first floating input), from the trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        w.train_step(batch, loss_fn)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    self_us: dict[tuple[str, str], float] = defaultdict(float)
    by_thread: dict = defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:  # self time: its duration less its direct children's
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["_child"] = stack[-1].get("_child", 0.0) + e["dur"]
            stack.append(e)
    for evs in by_thread.values():
        for e in evs:
            types = [t for t in e.get("args", {}).get("Input type", []) if t in ("float", "c10::BFloat16", "double")]
            self_us[(e["name"], types[0] if types else "-")] += e["dur"] - e.get("_child", 0.0)
    total = sum(self_us.values())
    print(f"\nprofile: one step, {total / 1e6:.3f} s of op self time")
    by_dtype: dict[str, float] = defaultdict(float)
    for (_, dt), us in self_us.items():
        by_dtype[dt] += us
    print(
        "  by input dtype: "
        + ", ".join(
            f"{dt} {us / 1e6:.3f} s ({us / total:.0%})" for dt, us in sorted(by_dtype.items(), key=lambda kv: -kv[1])
        )
    )
    print(f"  {'op':34s} {'input':14s} {'self s':>8s} {'share':>6s}")
    for (name, dt), us in sorted(self_us.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {name:34s} {dt:14s} {us / 1e6:8.3f} {us / total:6.1%}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--profile", default=None, help="a precision to profile one step of")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    from rl_specdec.grpo import ClippedPGLoss

    loss_fn = ClippedPGLoss(0.2, kl_coef=0.0)
    workers = {p: worker(p, args.micro_batch_size) for p in args.precisions}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for w in workers.values():
        for i in range(2):
            w.train_step(default_batch(10**6 + i), loss_fn)  # warm-up
    for seed in args.seeds:
        tokens = 0
        for i in range(args.steps):
            batch = default_batch(seed * 1000 + i)
            tokens += int(batch["attention_mask"].sum())
            order = args.precisions if i % 2 == 0 else args.precisions[::-1]  # interleaved, alternating who goes first
            for p in order:
                times[(p, seed)].append(workers[p].train_step(batch, loss_fn)["step_time_s"])
        print(
            f"seed {seed}: {args.steps} batches of 512 sequences, {tokens / args.steps:.0f} tokens each, load average "
            f"{os.getloadavg()[0]:.2f}"
        )
        for p in args.precisions:
            t = times[(p, seed)]
            print(f"  {p:10s} median {statistics.median(t):.3f} s  min {min(t):.3f} s  ({len(t)} steps)")
        base = statistics.median(times[(args.precisions[0], seed)])
        for p in args.precisions[1:]:
            print(f"  {args.precisions[0]} / {p}: {base / statistics.median(times[(p, seed)]):.2f}x")
    if args.profile:
        profile_step(workers[args.profile], default_batch(args.seeds[0]), loss_fn, args.top)


if __name__ == "__main__":
    main()
