"""The train phase as the trainer's work was cut, on the toy, the wide pair and the real model.

Four workers start from the same weights and take the same batches, interleaved step by step (who goes first
alternates), after one warm-up step each:

* ``before``: the trainer as it was: the LM head and a float32 log-softmax over the whole vocabulary at every
  position (``rl_specdec.policy.scoring``'s reference path), micro-batches in even slices of the sorted rows;
* ``scored``: the LM head only at the response tokens, in chunks, and micro-batches cut where the padding is
  least (``rl_specdec.policy.worker.balanced_split``), every row whole (``policy.share_prefix=false``);
* ``shared``: as shipped, each prompt computed once for its group's rows (``rl_specdec.policy.prefix``);
* ``shared, no reference``: without the frozen reference whose forward only logs ``train/kl`` at
  ``kl_coef: 0`` (``grpo.log_kl=false``, as the real model's configs set it).

The batches have each workload's shape, with random token ids (the cost does not depend on which tokens):

* ``toy``: the default run's, 64 sorting prompts x 8 (train_step.py's batch), micro-batch 64;
* ``wide``: the wide workload's trained rollouts, 3 groups of 8, prompts of 10-20 tokens, responses long-tailed
  (median 22, mean ~40, up to 250: its GRPO logs' shape), micro-batch 8;
* ``smollm2``: the real model's, 8 chat prompts x 8 (74 +-6 prompt tokens, 10-30 response tokens), micro 8.

``--memory`` instead measures one micro-batch's forward and backward in a fresh process, ``before`` and
``scored``: the peak resident memory above what the process held before it (``VmHWM`` after resetting it, Linux only),
including ``qwen3-vocab``: a 2-layer body with Qwen3's 151,936-token vocabulary, 4 sequences of 1,100 tokens
(76 prompt, 1,024 response)::

    python -m benchmarks.studies.train_phase --workloads toy,wide,smollm2 --seeds 0,1 --steps 1
    python -m benchmarks.studies.train_phase --memory --workloads smollm2,qwen3-vocab

``--precision fp32,bf16-mixed`` instead times the shipped trainer (``shared, no reference``) in each precision,
on the same batches from the same weights::

    python -m benchmarks.studies.train_phase --workloads smollm2 --precision fp32,bf16-mixed --seeds 0,1 --steps 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

MICRO = {"toy": 64, "wide": 8, "smollm2": 8, "qwen3-vocab": 4}


def model_path(workload: str) -> str:
    from rl_specdec.toy.build import build_toy_models

    if workload == "toy":
        return str(build_toy_models().policy)
    if workload == "wide":
        from rl_specdec.toy.wide import build_wide_models

        return str(build_wide_models(log=lambda *_: None).policy)
    if workload == "smollm2":
        from rl_specdec.toy.packaged import packaged_model_path

        return packaged_model_path("pkg:smollm2-135m-instruct", "policy.model_name")
    return qwen3_vocab_model()


def qwen3_vocab_model() -> str:
    """A 2-layer Qwen3 with Qwen3's vocabulary, saved once in a temporary folder."""
    import tempfile

    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = os.path.join(tempfile.gettempdir(), "rl_specdec_qwen3_vocab")
    if not os.path.isdir(folder):
        cfg = Qwen3Config(
            vocab_size=151936,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=True,
        )
        Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_batch(workload: str, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    from rl_specdec.grpo.batch import Trajectory, build_train_batch

    if workload == "toy":
        from benchmarks.studies.train_step import default_batch

        return default_batch(seed)
    g = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int, n: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    if workload == "wide":  # 3 groups of 8 kept of 4 prompts
        prompts = [p for p in ints(10, 21, 3) for _ in range(8)]
        responses = [min(250, max(4, int(22 * float(torch.randn(1, generator=g).mul(1.1).exp())))) for _ in prompts]
    elif workload == "smollm2":  # 8 prompts x 8
        prompts = [74 + d for d in ints(-6, 7, 8) for _ in range(8)]
        responses = ints(10, 31, 64)
    else:
        prompts, responses = [76] * 4, [1024] * 4
    trajs, prompt = [], None
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if i % 8 == 0:  # a new group of 8: its own prompt
            prompt = ints(2, vocab, p)
        trajs.append(Trajectory.single_turn(prompt, ints(2, vocab, r), [-1.0] * r))
    return build_train_batch(trajs, torch.randn(len(trajs), generator=g), 0)


# name: (the trainer as it was before scoring only the response, each prompt computed once per group, the
# frozen reference kept for train/kl)
VARIANTS = {
    "before": (True, False, True),
    "scored": (False, False, True),
    "shared": (False, True, True),
    "shared, no reference": (False, True, False),
}


@contextlib.contextmanager
def variant(name: str):
    """``before``: the whole vocabulary at every position, even slices; the others: as shipped."""
    from rl_specdec.policy import scoring, worker

    if not VARIANTS[name][0]:
        yield
        return
    head, split = scoring.output_head, worker.balanced_split

    def even(lengths, parts, _budget):
        size = -(-len(lengths) // parts)
        return list(range(0, len(lengths), size)) + [len(lengths)]

    scoring.output_head, worker.balanced_split = (lambda _m: None), even
    try:
        yield
    finally:
        scoring.output_head, worker.balanced_split = head, split


def start(workload: str, precision: str = "fp32", name: str = "shared"):
    from rl_specdec.config import PolicyConfig
    from rl_specdec.policy import PolicyWorker

    _, share, reference = VARIANTS[name]
    cfg = PolicyConfig(
        model_name=model_path(workload),
        device="cpu",
        precision=precision,
        micro_batch_size=MICRO[workload],
        share_prefix=share,
    )
    w = PolicyWorker(cfg, keep_reference=reference, seed=0)
    w.start()
    return w


def time_steps(workload: str, seeds: list[int], steps: int, arms: dict[str, tuple[str, str]]) -> None:
    """One row: the median train step of each arm (label -> (precision, variant)), the first arm the baseline."""
    from rl_specdec.grpo import ClippedPGLoss

    loss_fn = ClippedPGLoss(0.2, kl_coef=0.0)
    names = list(arms)
    workers = {a: start(workload, *arms[a]) for a in names}
    vocab = workers[names[0]].model.config.vocab_size
    for a, w in workers.items():
        with variant(arms[a][1]):
            w.train_step(make_batch(workload, 10**6, vocab), loss_fn)  # warm-up
    times: dict[str, list[float]] = defaultdict(list)
    for seed in seeds:
        for i in range(steps):
            batch = make_batch(workload, seed * 1000 + i, vocab)
            for a in names if i % 2 == 0 else names[::-1]:  # who goes first alternates
                with variant(arms[a][1]):
                    times[a].append(workers[a].train_step(batch, loss_fn)["step_time_s"])
    med = {a: statistics.median(times[a]) for a in names}
    base = names[0]

    def per_seed(a: str) -> str:
        def seed_median(name: str, k: int) -> float:
            return statistics.median(times[name][k * steps : (k + 1) * steps])

        return ", ".join(f"{seed_median(base, k) / seed_median(a, k):.2f}x" for k in range(len(seeds)))

    cells = " | ".join(f"{med[a]:.2f} ({med[base] / med[a]:.2f}x)" for a in names)
    print(f"| {workload} | {cells} | {per_seed(names[-1])} |", flush=True)


def peak_of_one_pass(workload: str, name: str) -> None:
    """In this (fresh) process: one micro-batch's forward and backward (the loss's, as train_step runs it),
    after a first one so the gradients are already held; prints the peak RSS above what it held before, GiB.
    The optimizer's step is left out: its temporaries are the parameters' size, whatever the scoring."""
    from rl_specdec.grpo import ClippedPGLoss
    from rl_specdec.policy.scoring import token_logprobs_and_entropy

    w = start(workload)
    batch = make_batch(workload, 0, w.model.config.vocab_size)
    mb = next(iter(w.micro_batches(batch)))[1]
    loss_fn = ClippedPGLoss(0.2, kl_coef=0.0)

    def one_pass() -> None:
        ids, mask = mb["input_ids"], mb["attention_mask"]
        logp, _ = token_logprobs_and_entropy(w.model, ids, mask, with_entropy=True, scored=mb["loss_mask"])
        loss_fn(logp, mb, None)[0].backward()

    with variant(name):
        one_pass()
        rss0 = rss_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        one_pass()
        print(f"{(rss_kib('VmHWM') - rss0) / 2**20:.2f}")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory(workloads: list[str]) -> None:
    print("| workload | micro-batch (sequences x tokens) | before, GiB | after, GiB | lower by |")
    print("|---|---|---|---|---|")
    # every block of 128 KiB or more mapped on its own and unmapped when freed: resident memory then follows
    # what torch holds, instead of what glibc's heap kept from the pass before
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    for wl in workloads:
        peaks = {}
        for v in ("before", "scored"):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.studies.train_phase", "--one-pass", wl, v],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
                env=env,
            ).stdout
            peaks[v] = float(out.strip().splitlines()[-1])
        shape = "4 x 1,100" if wl == "qwen3-vocab" else f"{MICRO[wl]} x its longest"
        print(
            f"| {wl} | {shape} | {peaks['before']:.2f} | {peaks['scored']:.2f} | "
            f"{peaks['before'] / peaks['scored']:.1f}x |"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="toy,wide,smollm2")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument(
        "--precision",
        default="fp32",
        help="policy.precision of every variant; two or more (fp32,bf16-mixed): the shipped trainer in each",
    )
    ap.add_argument("--one-pass", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_pass:
        return peak_of_one_pass(*args.one_pass)
    from rl_specdec.sysinfo import machine_label

    print(
        f"{machine_label()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    workloads = args.workloads.split(",")
    if args.memory:
        return memory(workloads)
    seeds = [int(s) for s in args.seeds.split(",")]
    precisions = args.precision.split(",")
    if len(precisions) > 1:  # the shipped trainer in each precision
        arms = {p: (p, "shared, no reference") for p in precisions}
    else:
        arms = {v: (precisions[0], v) for v in VARIANTS}
    print(f"train_step, median over {args.steps} steps x {len(seeds)} seeds, {args.precision}")
    print("| workload | " + " | ".join(f"{a}, s (speed-up)" for a in arms) + f" | {list(arms)[-1]}, per seed |")
    print("|---" * (len(arms) + 2) + "|")
    for wl in workloads:
        time_steps(wl, seeds, args.steps, arms)


if __name__ == "__main__":
    main()
