"""bench.py's GRPO variants: each a config and its overrides, the groups they fall in, what each is compared with."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.grpo import drafter_life, overlap_runs, precision_runs, real_model_runs

REPO = Path(__file__).resolve().parents[2]

SPEC = "policy.generation.vllm_kwargs.speculative_config"
CONTROL = "policy.generation.speculation_control"
DRAFTER = "policy.generation.drafter_training"


WIDE_HEAD = [f"{SPEC}.method=eagle3", f"{SPEC}.model=toy:wide-eagle3", f"{SPEC}.num_speculative_tokens=5"]

# name -> (config, overrides). Every variant of the default run differs from
# grpo_spec.yaml / grpo_base.yaml only in these keys.
GRPO_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "grpo_base": ("configs/grpo_base.yaml", []),
    # as shipped: a concurrency threshold (as FastGRPO's), k=3 below 32 running requests, the fast path above
    "grpo_spec": ("configs/grpo_spec.yaml", []),
    # vLLM's own k (speculation_control off): the earlier default (k=3), other k, schedules
    "draft k=3": ("configs/grpo_spec.yaml", [f"{CONTROL}.mode=off"]),
    "draft k=1": ("configs/grpo_spec.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=1"]),
    "draft k=2": ("configs/grpo_spec.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=2"]),
    "draft k=5": ("configs/grpo_spec.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=5"]),
    "draft schedule": (
        "configs/grpo_spec.yaml",
        [
            f"{CONTROL}.mode=off",
            f"{SPEC}.num_speculative_tokens=5",
            f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,5],[17,64,3],[65,1024,2]]",
        ],
    ),
    "draft tail-only": (
        "configs/grpo_spec.yaml",
        [
            f"{CONTROL}.mode=off",
            f"{SPEC}.num_speculative_tokens=3",
            f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,3],[17,1024,0]]",
        ],
    ),
    # run-time k: k=0 through the fast path, and the adaptive controller (k in 0..4 per batch-size bucket)
    "draft k=0 fast path": (
        "configs/grpo_spec.yaml",
        [f"{CONTROL}.mode=fixed", f"{CONTROL}.draft_below=2"],
    ),
    "draft adaptive": (
        "configs/grpo_spec.yaml",
        [f"{CONTROL}.mode=adaptive", f"{CONTROL}.k_max=4", f"{CONTROL}.draft_below=null"],
    ),
    # the default before the threshold: the controller, k in 0..3 per batch-size bucket
    "grpo_spec controller": ("configs/grpo_spec.yaml", [f"{CONTROL}.draft_below=null"]),
    # an A/A control: a second process of the baseline, the same seeds and rollouts (what two processes differ by)
    "grpo_base again": ("configs/grpo_base.yaml", []),
    # the long-tail workload: its own baseline, a fixed k, vLLM's static schedule, the controller
    "longtail base": ("configs/grpo_base_longtail.yaml", []),
    "longtail k=4": (
        "configs/grpo_spec_longtail.yaml",
        [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens_per_batch_size=null"],
    ),
    "longtail schedule": (
        "configs/grpo_spec_longtail.yaml",
        [
            f"{CONTROL}.mode=off",
            f"{SPEC}.num_speculative_tokens=6",
            f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,6],[17,64,3],[65,1024,2]]",
        ],
    ),
    "longtail tail-only fast path": (  # what grpo_spec_longtail.yaml ships, pinned here
        "configs/grpo_spec_longtail.yaml",
        [f"{CONTROL}.mode=fixed", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,4],[17,1024,0]]"],
    ),
    "longtail adaptive": (
        "configs/grpo_spec_longtail.yaml",
        [f"{CONTROL}.mode=adaptive", f"{SPEC}.num_speculative_tokens_per_batch_size=null"],
    ),
    # the wide workload: a target ~19x a drafter pass; no speculation, the best fixed k by the cost
    # table, vLLM's static schedule, a concurrency threshold (FastGRPO's rule) and the controller
    "wide base": ("configs/grpo_base_wide.yaml", []),
    "wide k=4": ("configs/grpo_spec_wide.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=4"]),
    # the best fixed k on the Intel Xeon by the k_profile study (k=3, 4 within 4%; docs/lab/wide_pair.md,
    # "Where the time goes, and the ceiling against the schedule")
    "wide k=5": ("configs/grpo_spec_wide.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=5"]),
    "wide schedule": (
        "configs/grpo_spec_wide.yaml",
        [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,4,5],[5,32,3],[33,1024,2]]"],
    ),
    "wide threshold": (
        "configs/grpo_spec_wide.yaml",
        [f"{CONTROL}.mode=fixed", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,5],[17,1024,0]]"],
    ),
    # the best k of the corrected cost table per batch size (docs/performance.md, "Where it pays: the wide pair")
    "wide schedule corrected": (
        "configs/grpo_spec_wide.yaml",
        [
            f"{CONTROL}.mode=off",
            f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,2,5],[3,4,4],[5,16,2],[17,1024,0]]",
        ],
    ),
    "wide adaptive": ("configs/grpo_spec_wide.yaml", []),
    "wide adaptive from schedule": (  # the controller, starting from the corrected schedule (start: schedule)
        "configs/grpo_spec_wide.yaml",
        [f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,2,5],[3,4,4],[5,16,2],[17,1024,0]]"],
    ),
    # an EAGLE-3 head for the wide target (toy:wide-eagle3, trained at build), the controller choosing k in 0..5
    # (k=0 steps plain); frozen, and trained online from the policy's update
    "wide eagle3 frozen": ("configs/grpo_spec_wide.yaml", WIDE_HEAD),
    # at the head's default learning rate (1e-4), and at 1e-3, under which its acceptance fell step by step
    "wide eagle3 online": ("configs/grpo_spec_wide.yaml", [*WIDE_HEAD, f"{DRAFTER}.enabled=true"]),
    "wide eagle3 online 1e-3": (
        "configs/grpo_spec_wide.yaml",
        [*WIDE_HEAD, f"{DRAFTER}.enabled=true", f"{DRAFTER}.learning_rate=1e-3"],
    ),
    "ngram k=3": (
        "configs/grpo_spec.yaml",
        [
            f"{SPEC}.method=ngram",  # a method switch starts from ngram's defaults: nothing of draft_model's
            f"{SPEC}.num_speculative_tokens=3",
            f"{SPEC}.prompt_lookup_max=3",
            f"{SPEC}.prompt_lookup_min=1",
        ],
    ),
    "suffix k=3": (
        "configs/grpo_spec.yaml",
        [f"{SPEC}.method=suffix", f"{SPEC}.num_speculative_tokens=3"],
    ),
    "schedule 2x1": (  # vLLM's own schedule (as "draft schedule") on two engines of one core each
        "configs/grpo_spec.yaml",
        [
            f"{CONTROL}.mode=off",
            f"{SPEC}.num_speculative_tokens=5",
            f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,5],[17,64,3],[65,1024,2]]",
            "policy.generation.num_engines=2",
            "policy.generation.cpus_per_engine=1",
        ],
    ),
    "grpo_base 2x1": (
        "configs/grpo_base.yaml",
        ["policy.generation.num_engines=2", "policy.generation.cpus_per_engine=1"],
    ),
    "grpo_spec 2x1": (
        "configs/grpo_spec.yaml",
        ["policy.generation.num_engines=2", "policy.generation.cpus_per_engine=1"],
    ),
    # the trainer as 2 data-parallel workers (DDP over gloo), same update as one: compare with grpo_spec
    "grpo_spec policy 2x": ("configs/grpo_spec.yaml", ["policy.num_workers=2"]),
    # the drafter distilled towards the policy after every step and refit: what training it beside the policy costs
    "grpo_spec drafter online": ("configs/grpo_spec.yaml", [drafter_life.ONLINE]),
    "grpo_spec drafter light": ("configs/grpo_spec.yaml", drafter_life.LIGHT),
    # fp32 against bf16-mixed (bf16 compute over fp32 master weights, bf16 engines): benchmarks/grpo/precision_runs.py
    **precision_runs.VARIANTS,
    # grpo.max_staleness 0 against 1 (rollouts overlapping training), both tasks: benchmarks/grpo/overlap_runs.py
    **overlap_runs.VARIANTS,
    # the real model, SmolLM2-135M-Instruct, without speculation and with ngram: benchmarks/grpo/real_model_runs.py
    **real_model_runs.VARIANTS,
}
QUICK_VARIANTS = ["grpo_base", "grpo_spec"]  # --quick: the shipped default against its baseline
TRAINER_VARIANTS = {"grpo_spec policy 2x"}  # change the trainer, not the rollouts: kept out of the speculation verdicts
# the drafter trains beside the policy on the same cores: their train phase differs by design, not by chance
DRAFTER_VARIANTS = {
    "grpo_spec drafter online",
    "grpo_spec drafter light",
    "wide eagle3 online",
    "wide eagle3 online 1e-3",
    "smollm2 eagle3 online",
}
# another precision changes the train phase and the rollouts: compared with their own baseline, kept out of the verdicts
PRECISION_VARIANTS = set(precision_runs.VARIANTS)
# overlap changes when each phase runs: compared within its pair, kept out of the pooling and the verdicts
OVERLAP_VARIANTS = set(overlap_runs.VARIANTS)
# what every benchmark run changes: its own log folder, no wandb, no checkpoints, no bar
COMMON = ["logger.wandb.enabled=false", "checkpoint.enabled=false", "logger.progress_bar=false"]
# --quick: skip what only costs start-up time (the sampling self-check, validation, torch.compile)
QUICK = ["policy.generation.self_check=false", "grpo.val_every=0", "policy.generation.vllm_kwargs.enforce_eager=true"]
PHASES = ("generation", "train", "refit", "validation", "reward", "prompts")


def family(name: str) -> str:
    """The workload a variant runs: "" (the default task), "longtail", "wide" or "smollm2" (the real model)."""
    return next((f for f in ("longtail", "wide", "smollm2") if name.startswith(f + " ")), "")


# A run's processes in a lockstep ring, per workload (GiB, measured, fp32): (alive while the others take their
# turns, more in its own train step). Wide pair: its engine 2.4-2.6 GB, its policy worker 2.4-2.6 GB idle and
# 4.2-4.5 GB training, its driver and checksummer 0.5 GB each, and its own Ray instance's processes; rings of 3
# and of 4 were killed on a 24 GiB machine. The real model: its engine 4.9-6.0 GB (a 2.5 GiB KV cache), its
# policy worker 4-5.5 GB, its checksummer 1.4 GB, its driver 0.9 GB; a ring of 2 was killed on 24 GiB.
RING_GIB = {"wide": (7.0, 2.0), "smollm2": (12.0, 1.5)}
RAY_KILL_FRACTION = 0.95  # Ray's memory monitor kills workers above this share of the machine's memory
FAMILY_WORDS = {"wide": "the wide pair", "smollm2": "the real model"}


def lockstep_memory_problem(names: list[str], total_gib: float | None = None) -> str | None:
    """Why a lockstep ring of ``names`` would not fit ``total_gib`` of memory (default: this machine's; every run
    stays alive while the others take their turns), with the fix; None where it fits. The toy's runs are small
    and not counted."""
    if total_gib is None:
        total_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    big = [family(n) for n in names if family(n) in RING_GIB]
    need = sum(RING_GIB[f][0] for f in big) + max((RING_GIB[f][1] for f in big), default=0.0)
    if need <= RAY_KILL_FRACTION * total_gib:
        return None
    f = max(set(big), key=big.count)
    idle, train = RING_GIB[f]
    fits = int((RAY_KILL_FRACTION * total_gib - train) // idle)
    fix = f"Give at most {fits} {f} variants per invocation, or run" if fits >= 2 else "Run them"
    return (
        f"--lockstep keeps every variant's runs alive at once: {big.count(f)} runs of {FAMILY_WORDS[f]} need about "
        f"{need:.0f} GiB, and Ray kills workers above {RAY_KILL_FRACTION:.0%} of this machine's {total_gib:.0f} GiB. "
        f"{fix} without --lockstep."
    )


def baseline_of(name: str) -> str:
    """The variant a variant is compared with: same task, same engine layout, no speculation."""
    if name in OVERLAP_VARIANTS:
        return overlap_runs.baseline(name)
    if name in PRECISION_VARIANTS:  # the same precision without speculation
        return precision_runs.BASELINE.get(name, name)
    if family(name):
        return f"{family(name)} base"
    return "grpo_base 2x1" if "2x1" in name else "grpo_base"


def spec_label(config: str, overrides: list[str]) -> str:
    """What a variant speculates with, read from its effective config: "none",
    "draft_model k=3", "draft_model k by batch 1-16:5 17-64:3 65-1024:2", "draft_model, the controller (k in 0..3)"."""
    from rl_specdec.config import load_config

    cfg = load_config(REPO / config, overrides)
    sc = cfg.policy.generation.speculation
    if sc is None:
        return "none"
    control = cfg.policy.generation.speculation_control
    if control.mode == "adaptive":  # the controller: k per batch-size bucket, measured
        return f"{sc.method}, the controller (k in 0..{control.k_max or sc.k})"
    if sc.schedule:
        return f"{sc.method} k by batch " + " ".join(f"{lo}-{hi}:{kk}" for lo, hi, kk in sc.schedule)
    return f"{sc.method} k={sc.k}"
