"""What speculation buys in RL, measured side by side in one run.

    python benchmarks/bench.py --quick            # under 5 min on 2 cores: rollout and GRPO tables, small
    python benchmarks/bench.py --seeds 0,1        # every section and variant (hours on 2 cores)
    python benchmarks/bench.py --sections grpo    # one part; see --help

Sections (each prints markdown tables; all write ``<out>/report.md``, JSON and PNGs):

rollout
    Rollout throughput of one vLLM engine: no speculation, draft_model, ngram and
    (with ``arctic-inference``) suffix at k in {1, 2, 3, 5}, draft_model with a
    batch-size schedule, batch sizes {1, 8, 64, 256}, temperatures 0 and 1;
    tokens/s, acceptance, speed-up over no speculation in the same run
    (``benchmarks/rollout.py``).
grpo
    The default GRPO run (``examples/run_grpo.py``) under each variant: grpo_base
    (no speculation), grpo_spec (its speculative_config) and the variants in
    ``GRPO_VARIANTS`` (other k, the batch-size schedule, ngram, suffix, two
    engines, two policy workers). Same prompts and step count; every variant runs once per seed in
    ``--seeds`` and the tables give the mean and each seed (step time on 2 CPU
    cores swings ~10% between seeds). Step time, its per-phase split, and the
    ratio to grpo_base. From the same runs: the long tail (per step, the
    time until 50/90/100% of rollouts were done).
staleness
    Long grpo_spec runs on the first seed: the drafter frozen against trained
    online (acceptance length per 20-step bucket while the policy drifts), and
    online training from an untrained drafter (``benchmarks/drafter_life.py``).
peer
    TRL's GRPOTrainer on the same task, model, batch and step count
    (``benchmarks/peer_trl.py``), against rl_specdec's step time and rollout tokens/s.

Every GRPO figure comes from a fresh subprocess per run, with wandb and
checkpoints off (identical for every variant) and its metrics read back from
``metrics.jsonl``. Step time is the median over the steps after the first (the
first pays for compilation and cache warm-up). Nothing else should run on the
machine meanwhile; the report prints the load average. With ``--lockstep`` a
seed's variants run together and take turns step by step
(``benchmarks/lockstep.py``), so a machine that slows down over minutes slows
every variant alike.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import drafter_life  # siblings: the script's folder is on sys.path when it runs as benchmarks/bench.py
import length_pool
import lockstep
import overlap_runs
import peer_trl  # siblings: the script's folder is on sys.path when it runs as benchmarks/bench.py
import precision_runs
import rollout
from rollout import fmt, log

REPO = Path(__file__).resolve().parent.parent

SPEC = "policy.generation.vllm_kwargs.speculative_config"
CONTROL = "policy.generation.speculation_control"
SECTIONS = ("rollout", "grpo", "staleness", "peer")

# name -> (config, overrides). Every variant of the default run differs from
# grpo_spec.yaml / grpo_base.yaml only in these keys.
GRPO_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "grpo_base": ("configs/grpo_base.yaml", []),
    "grpo_spec": ("configs/grpo_spec.yaml", []),  # as shipped: the controller (speculation_control.mode=auto)
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
    # run-time k (issue 14): k=0 through the fast path, and the adaptive controller (k in 0..4 per batch-size bucket)
    "draft k=0 fast path": (
        "configs/grpo_spec.yaml",
        [f"{CONTROL}.mode=fixed", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,1,3],[2,1024,0]]"],
    ),
    "draft adaptive": ("configs/grpo_spec.yaml", [f"{CONTROL}.mode=adaptive", f"{CONTROL}.k_max=4"]),
    # an A/A control: a second process of the baseline, the same seeds and rollouts (what two processes differ by)
    "grpo_base again": ("configs/grpo_base.yaml", []),
    # the long-tail workload (issue 14): its own baseline, a fixed k, vLLM's static schedule, the controller
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
    "longtail tail-only fast path": (
        "configs/grpo_spec_longtail.yaml",
        [f"{CONTROL}.mode=fixed", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,4],[17,1024,0]]"],
    ),
    "longtail adaptive": (
        "configs/grpo_spec_longtail.yaml",
        [f"{CONTROL}.mode=adaptive", f"{SPEC}.num_speculative_tokens_per_batch_size=null"],
    ),
    # the wide workload (issue 24): a target ~19x a drafter pass; no speculation, the best fixed k by the cost
    # table, vLLM's static schedule, a concurrency threshold (FastGRPO's rule) and the controller
    "wide base": ("configs/grpo_base_wide.yaml", []),
    "wide k=4": ("configs/grpo_spec_wide.yaml", [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens=4"]),
    "wide schedule": (
        "configs/grpo_spec_wide.yaml",
        [f"{CONTROL}.mode=off", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,4,5],[5,32,3],[33,1024,2]]"],
    ),
    "wide threshold": (
        "configs/grpo_spec_wide.yaml",
        [f"{CONTROL}.mode=fixed", f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,16,5],[17,1024,0]]"],
    ),
    "wide schedule corrected": (  # the best k of the corrected cost table per batch size (docs/performance.md 11)
        "configs/grpo_spec_wide.yaml",
        [
            f"{CONTROL}.mode=off",
            f"{SPEC}.num_speculative_tokens_per_batch_size=[[1,2,5],[3,4,4],[5,16,2],[17,1024,0]]",
        ],
    ),
    "wide adaptive": ("configs/grpo_spec_wide.yaml", []),
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
    "schedule 2x1": (
        "configs/grpo_spec.yaml",
        [
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
    # the drafter distilled towards the policy after every step and refit (issue 13): its cost
    "grpo_spec drafter online": ("configs/grpo_spec.yaml", [drafter_life.ONLINE]),
    "grpo_spec drafter light": ("configs/grpo_spec.yaml", drafter_life.LIGHT),
    # fp32 against bf16-mixed (bf16 compute over fp32 master weights, bf16 engines): benchmarks/precision_runs.py
    **precision_runs.VARIANTS,
    # grpo.max_staleness 0 against 1 (rollouts overlapping training), both tasks: benchmarks/overlap_runs.py
    **overlap_runs.VARIANTS,
}
QUICK_VARIANTS = ["grpo_base", "draft adaptive", "longtail base", "longtail adaptive"]
QUICK_SECTIONS = ("rollout", "grpo")  # --quick: staleness and peer only when asked for (--sections)
TRAINER_VARIANTS = {"grpo_spec policy 2x"}  # change the trainer, not the rollouts: kept out of the speculation verdicts
# the drafter trains beside the policy on the same cores: their train phase differs by design, not by chance
DRAFTER_VARIANTS = {"grpo_spec drafter online", "grpo_spec drafter light"}
# another precision changes the train phase and the rollouts: compared with their own baseline, kept out of the verdicts
PRECISION_VARIANTS = set(precision_runs.VARIANTS)
# overlap changes when each phase runs: compared within its pair, kept out of the pooling and the verdicts
OVERLAP_VARIANTS = set(overlap_runs.VARIANTS)
# what every benchmark run changes: its own log folder, no wandb, no checkpoints, no bar
COMMON = ["logger.wandb.enabled=false", "checkpoint.enabled=false", "logger.progress_bar=false"]
# --quick: skip what only costs start-up time (the sampling self-check, validation, torch.compile)
QUICK = ["policy.generation.self_check=false", "grpo.val_every=0", "policy.generation.vllm_kwargs.enforce_eager=true"]
PHASES = ("generation", "train", "refit", "validation", "reward", "prompts")


# ---- running ------------------------------------------------------------------------
def run_dir(out: Path, name: str, seed: int) -> Path:
    return out / "runs" / f"seed{seed}" / name.replace(" ", "_").replace("=", "")


def load_rows(log_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows after the step-0 baseline."""
    rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    return [r for r in rows if r["step"] >= 1]


def spec_label(config: str, overrides: list[str]) -> str:
    """What a variant speculates with, read from its effective config: "none",
    "draft_model k=3", "draft_model k by batch 1-16:5 17-64:3 65-1024:2", "draft_model, the controller (k in 0..3)"."""
    from rl_specdec.config import load_config

    cfg = load_config(REPO / config, overrides, resolve_models=False)
    sc = cfg.policy.generation.vllm_kwargs.get("speculative_config")
    if not sc:
        return "none"
    sched = sc.get("num_speculative_tokens_per_batch_size")
    k = sc.get("num_speculative_tokens", sc.get("prompt_lookup_max"))
    control = cfg.policy.generation.speculation_control
    if control.mode == "adaptive":  # the controller: k per batch-size bucket, measured
        return f"{sc['method']}, the controller (k in 0..{control.k_max or k})"
    if sched:
        return f"{sc['method']} k by batch " + " ".join(f"{lo}-{hi}:{kk}" for lo, hi, kk in sched)
    return f"{sc['method']} k={k}"


def grpo_command(
    name: str, config: str, overrides: list[str], steps: int, out: Path, quick: bool, seed: int
) -> tuple[list[str], Path, dict]:
    """A run's command line, its log folder and its key (its arguments and the config file's sha256)."""
    log_dir = run_dir(out, name, seed)
    args = [config, f"grpo.max_steps={steps}", f"seed={seed}", *COMMON, *(QUICK if quick else []), *overrides]
    # the config's content is part of the key: editing the YAML must not reuse old runs
    key = {"args": args, "config_sha256": hashlib.sha256((REPO / config).read_bytes()).hexdigest()}
    script = str(REPO / "examples/run_grpo.py")
    cmd = [sys.executable, script, "--config", str(REPO / config), f"logger.log_dir={log_dir}", *args[1:]]
    return cmd, log_dir, key


def reusable(log_dir: Path, key: dict) -> bool:
    done = log_dir / "done.json"
    return done.exists() and {k: json.loads(done.read_text()).get(k) for k in key} == key


def finished_run(name: str, log_dir: Path, key: dict, rc: int, t0: float) -> list[dict]:
    """A run's rows once its process ended with ``rc``; records ``done.json``, or raises with its log's tail."""
    if rc != 0:
        tail = (log_dir / "run.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"GRPO run {name!r} failed (rc={rc}); last lines of {log_dir}/run.log:\n" + "\n".join(tail))
    rows = load_rows(log_dir)
    (log_dir / "done.json").write_text(json.dumps({**key, "seconds": round(time.time() - t0, 1)}))
    log(f"  {name}: done in {time.time() - t0:.0f}s, median step {step_stats(rows)['step_s']:.2f}s")
    return rows


def run_grpo(
    name: str, config: str, overrides: list[str], steps: int, out: Path, quick: bool, seed: int, resume: bool = False
) -> list[dict]:
    """One GRPO run in a fresh process; returns its metrics.jsonl rows (step >= 1).

    A finished run leaves ``done.json`` (its arguments and the config file's sha256); with
    ``resume`` a run whose ``done.json`` matches both is read back instead of run again.
    """
    cmd, log_dir, key = grpo_command(name, config, overrides, steps, out, quick, seed)
    if resume and reusable(log_dir, key):
        log(f"  {name}: reusing the finished run in {log_dir} (--resume)")
        return load_rows(log_dir)
    (log_dir / "done.json").unlink(missing_ok=True)
    log(f"  {name}, seed {seed}: {steps} steps (log: {log_dir}/run.log)")
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_dir / "run.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    return finished_run(name, log_dir, key, rc, t0)


def run_grpo_lockstep(
    names: list[str], steps: int, out: Path, quick: bool, seed: int, resume: bool = False
) -> dict[str, list[dict] | str]:
    """A seed's variants as one ring (``benchmarks/lockstep.py``): they take turns step by step. Returns each
    variant's rows, or the error of one that failed. With ``resume`` a seed whose runs all finished with the
    same settings is read back (one missing run reruns the whole ring: its turns are what is measured)."""
    jobs = {n: grpo_command(n, *GRPO_VARIANTS[n], steps, out, quick, seed) for n in names}
    if resume and all(reusable(d, key) for _, d, key in jobs.values()):
        log(f"  seed {seed}: reusing the finished runs in {out}/runs/seed{seed} (--resume)")
        return {n: load_rows(d) for n, (_, d, _) in jobs.items()}
    for _, log_dir, _ in jobs.values():
        (log_dir / "done.json").unlink(missing_ok=True)
    log(f"  seed {seed}: {', '.join(names)} in lockstep, {steps} steps (logs: {out}/runs/seed{seed}/*/run.log)")
    t0 = time.time()
    rcs = lockstep.run_together(
        [c for c, _, _ in jobs.values()],
        [d / "run.log" for _, d, _ in jobs.values()],
        out / "baton" / str(seed),
        log,
        cwd=REPO,
    )
    result: dict[str, list[dict] | str] = {}
    for (n, (_, log_dir, key)), rc in zip(jobs.items(), rcs):
        try:
            result[n] = finished_run(n, log_dir, key, rc, t0)
        except (RuntimeError, FileNotFoundError) as e:
            result[n] = str(e)
    return result


def step_stats(rows: list[dict]) -> dict:
    """Median step time and mean phase times over the steps after the first."""
    rs = rows[1:] if len(rows) > 1 else rows
    mean = lambda k: statistics.fmean(r.get(k, 0.0) or 0.0 for r in rs)  # noqa: E731
    out = {
        "steps": len(rs),
        "step_s": statistics.median(r["timing/step"] for r in rs),
        "step_mean_s": mean("timing/step"),
        "tokens_per_step": mean("generation/num_tokens"),
        "train_samples": mean("train/num_samples"),
        "gen_tokens_per_s": sum(r["generation/num_tokens"] for r in rs)
        / max(sum(r["timing/generation"] for r in rs), 1e-9),
        "reward_first": statistics.fmean(r["train/reward_mean"] for r in rows[: max(1, len(rows) // 10)]),
        "reward_last": statistics.fmean(r["train/reward_mean"] for r in rows[-max(1, len(rows) // 10) :]),
        "acceptance_length": _mean_or_none(rs, "spec_decode/acceptance_length"),
        "acceptance_rate": _mean_or_none(rs, "spec_decode/acceptance_rate"),
        **length_pool.per_run(rs),
    }
    for p in PHASES:
        out[f"{p}_s"] = mean(f"timing/{p}")
    out["drafter_train_s"] = _mean_or_none(rs, "timing/drafter_train")
    for pct in (50, 90, 100):
        out[f"done{pct}_s"] = _mean_or_none(rs, f"generation/time_to_{pct}pct_done")
    out["len_max_over_median"] = _mean_or_none(
        [
            {"x": r["generation/response_length_max"] / r["generation/response_length_median"]}
            for r in rs
            if r.get("generation/response_length_median")
        ],
        "x",
    )
    out["last10_share"] = _mean_or_none(
        [
            {"x": 1 - r["generation/time_to_90pct_done"] / r["generation/time_to_100pct_done"]}
            for r in rs
            if r.get("generation/time_to_100pct_done")
        ],
        "x",
    )
    return out


def combine_seeds(per_seed: dict[int, dict]) -> dict:
    """The mean of each figure over seeds; ``step_s_per_seed`` keeps the spread visible."""
    seeds = sorted(per_seed)
    out = {}
    for k in per_seed[seeds[0]]:
        vals = [per_seed[sd][k] for sd in seeds if per_seed[sd].get(k) is not None]
        out[k] = statistics.fmean(vals) if vals else None
    out["seeds"] = seeds
    out["step_s_per_seed"] = [per_seed[sd]["step_s"] for sd in seeds]
    out["generation_s_per_seed"] = [per_seed[sd]["generation_s"] for sd in seeds]
    out["train_s_per_seed"] = [per_seed[sd]["train_s"] for sd in seeds]
    return out


def pool_train_time(stats: dict[str, dict]) -> None:
    """Adds ``step_pooled_s``: the mean step time with the train phase replaced by the
    mean train phase of every variant with the same engine layout.

    Lossless speculation samples from the same distribution, so the train phase
    (how many samples have a nonzero advantage, how long they are) costs the same
    in expectation with or without it; what one run trains still differs from the
    next by chance, and on this CPU that chance moves step time by ~10%. Pooling
    keeps the cost speculation can change (generation) and averages out the one it
    cannot (a control variate).
    """
    for two, fam in ((False, ""), (True, ""), (False, "longtail"), (False, "wide")):
        group = [
            n
            for n in stats
            if ("2x1" in n) == two
            and family(n) == fam
            and n not in TRAINER_VARIANTS | DRAFTER_VARIANTS | PRECISION_VARIANTS | OVERLAP_VARIANTS
        ]
        if group:
            pooled = statistics.fmean(stats[n]["train_s"] for n in group)
            for n in group:
                stats[n]["step_pooled_s"] = stats[n]["step_mean_s"] - stats[n]["train_s"] + pooled
    # their train phase is what they change: pooled only with itself
    for n in (TRAINER_VARIANTS | DRAFTER_VARIANTS | PRECISION_VARIANTS | OVERLAP_VARIANTS) & set(stats):
        stats[n]["step_pooled_s"] = stats[n]["step_mean_s"]


def _mean_or_none(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


# ---- tables -----------------------------------------------------------------------
def family(name: str) -> str:
    """The workload a variant runs: "" (the default task), "longtail" or "wide"."""
    return next((f for f in ("longtail", "wide") if name.startswith(f + " ")), "")


def baseline_of(name: str) -> str:
    """The variant a variant is compared with: same task, same engine layout, no speculation."""
    if name in OVERLAP_VARIANTS:
        return overlap_runs.baseline(name)
    if family(name):
        return f"{family(name)} base"
    if name in PRECISION_VARIANTS:  # the same precision without speculation
        return "grpo_base " + name.split(" ", 1)[1]
    return "grpo_base 2x1" if "2x1" in name else "grpo_base"


def grpo_table(stats: dict[str, dict]) -> str:
    def ratio(s, k):
        base = stats.get(baseline_of(s["name"]), stats.get("grpo_base", {}))
        return fmt(s[k] / base[k] if base.get(k) else None, "{:.2f}x")

    lines = [
        "| variant | speculation | step (s, median) | per seed | vs base | step, train pooled (s) | vs base | "
        "generation (s) | per seed | generation vs base | train (s) | per seed | train vs base (not speculation's: "
        "the machine's drift and the sampled work) | samples trained | refit (s) | validation (s) | gen tokens/s | "
        "acceptance length | reward first→last 10% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seeds = lambda s, k: ", ".join(f"{x:.2f}" for x in s.get(f"{k}_per_seed", [s[k]]))  # noqa: E731
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s.get('speculation', '')} | {s['step_s']:.2f} | {seeds(s, 'step_s')} | {ratio(s, 'step_s')} "
            f"| {fmt(s.get('step_pooled_s'), '{:.2f}')} | {ratio(s, 'step_pooled_s')} | {s['generation_s']:.2f} | "
            f"{seeds(s, 'generation_s')} | {ratio(s, 'generation_s')} | "
            f"{s['train_s']:.2f} | {seeds(s, 'train_s')} | {ratio(s, 'train_s')} | {s.get('train_samples', 0):.0f} | "
            f"{s['refit_s']:.2f} | {s['validation_s']:.2f} | "
            f"{s['gen_tokens_per_s']:.0f} | "
            f"{fmt(s['acceptance_length'], '{:.2f}')} | {s['reward_first']:.2f}→{s['reward_last']:.2f} |"
        )
    return "\n".join(lines)


def phase_table(stats: dict[str, dict]) -> str:
    lines = ["| variant | " + " | ".join(PHASES) + " | other |", "|---|" + "---|" * (len(PHASES) + 1)]
    for name, s in stats.items():
        tot = s["step_mean_s"]
        shares = [s[f"{p}_s"] / tot for p in PHASES]
        lines.append(f"| {name} | " + " | ".join(f"{x:.0%}" for x in shares) + f" | {max(1 - sum(shares), 0):.0%} |")
    return "\n".join(lines)


def tail_table(stats: dict[str, dict]) -> str:
    lines = [
        "| variant | 50% done (s) | 90% done (s) | 100% done (s) | 100% / 50% | last 10% of rollouts: share of the "
        "phase | longest / median length | generation phase (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        d50, d90, d100 = s["done50_s"], s["done90_s"], s["done100_s"]
        lines.append(
            f"| {name} | {fmt(d50, '{:.2f}')} | {fmt(d90, '{:.2f}')} | {fmt(d100, '{:.2f}')} | "
            f"{fmt(d100 / d50 if d50 and d100 else None, '{:.1f}x')} | "
            f"{fmt(s.get('last10_share'), '{:.0%}')} | {fmt(s.get('len_max_over_median'), '{:.1f}x')} | "
            f"{s['generation_s']:.2f} |"
        )
    return "\n".join(lines)


def staleness_table(rows: list[dict], buckets: int = 10) -> str:
    lines = [
        "| steps | acceptance rate | acceptance rate, position 1 | acceptance length | KL to start | train reward |",
        "|---|---|---|---|---|---|",
    ]
    n = len(rows)
    size = max(1, n // buckets)
    for i in range(0, n, size):
        b = rows[i : i + size]
        lines.append(
            f"| {b[0]['step']}–{b[-1]['step']} | {fmt(_mean_or_none(b, 'spec_decode/acceptance_rate'), '{:.3f}')} | "
            f"{fmt(_mean_or_none(b, 'spec_decode/acceptance_rate_pos_1'), '{:.3f}')} | "
            f"{fmt(_mean_or_none(b, 'spec_decode/acceptance_length'), '{:.3f}')} | "
            f"{fmt(_mean_or_none(b, 'train/kl'), '{:.4f}')} | "
            f"{fmt(_mean_or_none(b, 'train/reward_mean'), '{:.2f}')} |"
        )
    return "\n".join(lines)


def peer_table(trl: dict, stats: dict[str, dict]) -> str:
    lines = [
        "| trainer | generation | step (s, median) | rollout (s, mean) | rollout tokens/s | steps measured |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("grpo_base", "grpo_spec"):
        if name in stats:
            s = stats[name]
            lines.append(
                f"| rl_specdec {name} | vLLM engine (Ray "
                f"actor){' + ' + s['speculation'] if s.get('speculation', 'none') != 'none' else ''} | "
                f"{s['step_s']:.2f} | {s['generation_s']:.2f} | {s['gen_tokens_per_s']:.0f} | "
                f"{s['steps']:.0f}{' x ' + str(len(s['seeds'])) + ' seeds' if len(s.get('seeds', [])) > 1 else ''} |"
            )
    t = trl["summary"]
    lines.append(
        f"| TRL {t['trl_version']} GRPOTrainer | {t['generation']} | {t['step_s']:.2f} | {t['generate_s']:.2f} | "
        f"{t['rollout_tokens_per_s']:.0f} | {t['steps_measured']} |"
    )
    return "\n".join(lines)


def verdict_text(stats: dict[str, dict]) -> str:
    """Each variant against the grpo_base with the same engine layout; the best
    speculative variant; a batch-size schedule against the best fixed k."""

    def base_name(n: str) -> str:
        return baseline_of(n) if baseline_of(n) in stats else "grpo_base"

    def ratio(n: str, k: str = "step_s") -> str:
        return f"{stats[n][k] / stats[base_name(n)][k]:.2f}x {base_name(n)}"

    spec = {
        n: s
        for n, s in stats.items()
        if s.get("speculation", "none") != "none" and n not in TRAINER_VARIANTS | PRECISION_VARIANTS | OVERLAP_VARIANTS
    }
    out = []
    groups = (
        ("one engine", {n: s for n, s in spec.items() if "2x1" not in n and not family(n)}),
        ("two engines", {n: s for n, s in spec.items() if "2x1" in n}),
        ("long-tail task", {n: s for n, s in spec.items() if family(n) == "longtail"}),
        ("wide pair", {n: s for n, s in spec.items() if family(n) == "wide"}),
    )
    for label, group in groups:
        if group:
            best = min(group, key=lambda n: group[n]["step_s"])
            out.append(
                f"Fastest speculative variant, {label}: **{best}** ({group[best]['speculation']}), "
                f"{group[best]['step_s']:.2f} s/step = "
                f"{ratio(best)}; train pooled {group[best]['step_pooled_s']:.2f} s = {ratio(best, 'step_pooled_s')}; "
                f"generation phase {group[best]['generation_s']:.2f} s = {ratio(best, 'generation_s')}."
            )
    one = {
        n: s
        for n, s in spec.items()
        if "2x1" not in n and not n.startswith("longtail") and s["speculation"].startswith("draft_model")
    }
    sched = {n: s for n, s in one.items() if "k by batch" in s["speculation"]}
    fixed = {n: s for n, s in one.items() if "k by batch" not in s["speculation"]}
    if sched and fixed:
        bf = min(fixed, key=lambda n: fixed[n]["step_s"])
        bs = min(sched, key=lambda n: sched[n]["step_s"])
        won = [sched[bs][k] < fixed[bf][k] for k in ("step_s", "step_pooled_s")]
        out.append(
            f"Batch-size schedule ({bs}) vs the best fixed k ({bf}): {sched[bs]['step_s']:.2f} vs "
            f"{fixed[bf]['step_s']:.2f} s/step, "
            f"train pooled {sched[bs]['step_pooled_s']:.2f} vs {fixed[bf]['step_pooled_s']:.2f} s, "
            f"generation {sched[bs]['generation_s']:.2f} vs {fixed[bf]['generation_s']:.2f} s "
            f"({'the schedule wins' if all(won) else 'fixed k wins' if not any(won) else 'no clear winner'})."
        )
    return " ".join(out)


def policy_workers_text(stats: dict[str, dict]) -> str:
    two, one = stats["grpo_spec policy 2x"], stats["grpo_spec"]
    return (
        f"Two policy workers (DDP over gloo, the same update as one) against one, grpo_spec: {two['step_s']:.2f} vs "
        f"{one['step_s']:.2f} s/step, "
        f"train phase {two['train_s']:.2f} vs {one['train_s']:.2f} s, refit {two['refit_s']:.2f} vs "
        f"{one['refit_s']:.2f} s."
    )


# ---- plots --------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grpo(runs: dict[str, list[dict]], stats: dict[str, dict], path: Path) -> None:
    """Left: median step and mean generation time per variant. Right: the mean per-phase split."""
    plt = _plt()
    names = list(stats)
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(names) + 2.2), sharey=True)
    y = list(range(len(names)))
    axes[0].barh([i - 0.2 for i in y], [stats[n]["step_s"] for n in names], height=0.4, label="step (median)")
    axes[0].barh(
        [i + 0.2 for i in y], [stats[n]["generation_s"] for n in names], height=0.4, label="generation phase (mean)"
    )
    if "grpo_base" in stats:
        axes[0].axvline(stats["grpo_base"]["step_s"], color="grey", ls="--", lw=1)
        axes[0].axvline(stats["grpo_base"]["generation_s"], color="grey", ls=":", lw=1)
    axes[0].set(
        yticks=y, yticklabels=names, xlabel="seconds", title="GRPO step and generation time (dashed: grpo_base)"
    )
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7, loc="lower right")
    left = [0.0] * len(names)
    for p in PHASES:
        vals = [stats[n][f"{p}_s"] for n in names]
        axes[1].barh(y, vals, left=left, label=p)
        left = [a + v for a, v in zip(left, vals)]
    axes[1].set(xlabel="mean seconds per step", title="per-phase split")
    axes[1].legend(fontsize=7, loc="lower right")
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tail(runs: dict[str, list[dict]], stats: dict[str, dict], path: Path) -> None:
    """Left: mean time until 50/90/100% of a step's rollouts were done.

    Right: the 100% time per step of one seed (10-step mean).
    """
    plt = _plt()
    names = [
        n
        for n in runs
        if runs[n] and runs[n][0].get("generation/time_to_100pct_done") is not None and stats[n].get("done100_s")
    ]
    if not names:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.3 * len(names) + 2.6))
    y = list(range(len(names)))
    for off, pct in ((-0.27, 50), (0.0, 90), (0.27, 100)):
        axes[0].barh([i + off for i in y], [stats[n][f"done{pct}_s"] for n in names], height=0.27, label=f"{pct}% done")
    axes[0].set(
        yticks=y,
        yticklabels=names,
        xlabel="seconds into the generation step (mean over steps after the first)",
        title="when the rollouts finished",
    )
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7, loc="lower right")
    for n in names:
        rows = runs[n]
        axes[1].plot(
            [r["step"] for r in rows],
            _rolling([r["generation/time_to_100pct_done"] for r in rows], 10),
            label=n,
            lw=2 if n in ("grpo_base", "grpo_spec") else 1,
        )
    axes[1].set(
        xlabel="step",
        ylabel="seconds until 100% done (10-step mean)",
        title=f"the last rollout of each step (seed {stats[names[0]]['seeds'][0]})",
    )
    axes[1].legend(fontsize=6, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(rows: list[dict], path: Path) -> None:
    plt = _plt()
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    acc = [r.get("spec_decode/acceptance_rate") for r in rows]
    length = [r.get("spec_decode/acceptance_length") for r in rows]
    axes[0].plot(steps, acc, ".", ms=3, alpha=0.5, label="per step")
    axes[0].plot(steps, _rolling(acc, 10), "-", label="10-step mean")
    axes[0].plot(
        steps,
        _rolling([r.get("spec_decode/acceptance_rate_pos_1") for r in rows], 10),
        "-",
        label="position 1 (10-step mean)",
    )
    axes[0].set(xlabel="step", ylabel="acceptance rate", title="frozen drafter vs drifting policy")
    ax2 = axes[0].twinx()
    ax2.plot(steps, _rolling(length, 10), "r-", lw=0.8)
    ax2.set_ylabel("acceptance length (10-step mean)", color="r")
    axes[0].legend(fontsize=7)
    kl = [r.get("train/kl") for r in rows]
    # the k3 KL estimate on sampled tokens is heavy-tailed: a rolling median, and the
    # axis cut at the 98th percentile (the few steps above it are noted in the legend)
    shown = sorted(x for x in kl if x is not None)
    top = shown[int(0.98 * (len(shown) - 1))] * 1.3 if shown else None
    above = sum(1 for x in shown if top is not None and x > top)
    axes[1].plot(steps, kl, ".", ms=3, alpha=0.5, label="per step" + (f" ({above} above the axis)" if above else ""))
    axes[1].plot(steps, _rolling(kl, 10, statistics.median), "-", label="10-step median")
    if top:
        axes[1].set_ylim(0, top)
    axes[1].legend(fontsize=7)
    axes[1].set(xlabel="step", ylabel="KL(policy || start)", title="policy drift")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rolling(xs: list, w: int, stat=statistics.fmean) -> list:
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - w + 1) : i + 1] if x is not None]
        out.append(stat(win) if win else None)
    return out


# ---- the command -------------------------------------------------------------------
def header() -> str:
    import torch
    import vllm

    cores, load = rollout.cores_and_load()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = f"vLLM {vllm.__version__}, torch {torch.__version__}"
    return f"{cpu}, {cores} cores, {mem:.0f} GiB; {versions}; load average at start {load:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small: the rollout and GRPO sections (both tasks, no speculation and the controller), 4 steps; "
        "under 5 minutes on 2 cores with the toy models built",
    )
    p.add_argument("--out", default="results/bench", help="results folder (report.md, *.json, *.png)")
    p.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all; --quick: {','.join(QUICK_SECTIONS)})",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"GRPO variants (default: all; --quick: {'; '.join(QUICK_VARIANTS)}); from: {'; '.join(GRPO_VARIANTS)}",
    )
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per variant (default: 60; --quick 4)")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the tables and plots from the runs already in --out (runs nothing)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs in --out that finished with the same settings "
        "(an interrupted benchmark picks up where it stopped)",
    )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="run a seed's GRPO variants together, taking turns step by step, so that the machine's drift "
        "falls on each alike (benchmarks/lockstep.py; not for max_staleness=1 variants)",
    )
    p.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds; every GRPO variant runs once per seed and the tables give the mean and each seed "
        "(full results: 0,1)",
    )
    p.add_argument(
        "--staleness-steps",
        type=int,
        default=200,
        help="length of the frozen and online drafter runs (--quick: --steps)",
    )
    p.add_argument("--cold-steps", type=int, default=50, help="length of the cold-start drafter run (--quick: --steps)")
    p.add_argument("--peer-steps", type=int, default=None, help="TRL steps (default: --steps; --quick 4)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every GRPO run, before each variant's own (repeatable), e.g. policy.precision=fp32",
    )
    rollout_parser = argparse.ArgumentParser(add_help=False)
    rollout.add_args(rollout_parser)
    args = p.parse_args(argv)
    COMMON.extend(args.set)
    sections = [s for s in (args.sections or ",".join(QUICK_SECTIONS if args.quick else SECTIONS)).split(",") if s]
    for s in sections:
        if s not in SECTIONS:
            p.error(f"--sections: unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    names = args.variants.split(";") if args.variants else (QUICK_VARIANTS if args.quick else list(GRPO_VARIANTS))
    names = [n.strip() for n in names if n.strip()]
    if not args.variants and not args.quick and not rollout.has_suffix():
        names.remove("suffix k=3")
    for n in names:
        if n not in GRPO_VARIANTS:
            p.error(f"--variants: unknown variant {n!r}; choose from {'; '.join(GRPO_VARIANTS)}")
    if args.lockstep and (bad := OVERLAP_VARIANTS & set(names)):
        p.error(f"--lockstep: {', '.join(sorted(bad))} generate beside training, outside the baton; run without it")
    if ("peer" in sections or "staleness" in sections) and "grpo" not in sections:
        # the rows peer and cost compare against
        names = [
            n for n in names if n in ("grpo_base", "grpo_spec", "grpo_spec drafter online", "grpo_spec drafter light")
        ]
        sections = ["grpo", *sections]
    steps = args.steps or (4 if args.quick else 60)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers, e.g. --seeds 0,1")
    if not seeds:
        p.error("--seeds: give at least one seed, e.g. --seeds 0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    head = header()
    log(f"benchmark: {head}")
    from rl_specdec.toy.build import build_toy_models

    build_toy_models(log=log)  # once, before anything is timed
    if "grpo" in sections and any(GRPO_VARIANTS[n][0].endswith(("_longtail.yaml", "_wide.yaml")) for n in names):
        from rl_specdec.toy.longtail import build_longtail_models
        from rl_specdec.toy.wide import build_wide_models

        build_longtail_models(log=log)
        build_wide_models(log=log)
    report = [f"# rl_specdec benchmark{' (--quick)' if args.quick else ''}", "", f"_{head}_", ""]
    results: dict = {"header": head, "quick": args.quick}

    def emit(title: str, body: str, image: str | None = None) -> None:
        print(f"\n### {title}\n\n{body}", flush=True)
        report.extend([f"## {title}", "", body, ""] + ([f"![{title}]({image})", ""] if image else []))

    if "rollout" in sections:
        log("[rollout] one engine per (method, k)")
        ra = rollout_parser.parse_args(["--out", str(out)] + (["--quick"] if args.quick else []))
        rollout.finish_args(ra)
        saved = out / "rollout.json"
        reuse = args.resume and saved.exists() and json.loads(saved.read_text()).get("quick", False) == args.quick
        if args.report_only or reuse:
            res = json.loads(saved.read_text())
            log(f"  reusing {saved}" if reuse else f"  reading {saved}")
            rollout.plot_methods(res["methods"], out / "rollout.png")
        else:
            res = rollout.run(ra, print_tables=False)
        results["rollout"] = res
        if not rollout.has_suffix():
            log("  suffix skipped: arctic-inference is not installed (bash scripts/install_arctic_inference.sh)")
            report += [
                "_suffix skipped: arctic-inference is not installed (bash scripts/install_arctic_inference.sh)._",
                "",
            ]
        emit(
            "Rollout speed-up over no speculation (one engine, all cores)",
            rollout.speedup_table(res["methods"]),
            "rollout.png",
        )
        emit("Rollout throughput, every cell", rollout.method_table(res["methods"]))

    runs: dict[str, dict[int, list[dict]]] = {}  # variant -> seed -> metrics rows
    if "grpo" in sections:
        log(f"[grpo] {len(names)} variants x {len(seeds)} seed(s) x {steps} steps")
        jobs = [(sd, n) for sd in seeds for n in names]  # seed-major: a stopped benchmark has whole seeds
        if args.lockstep and not args.report_only:
            for sd in seeds:
                for n, got in run_grpo_lockstep(names, steps, out, args.quick, sd, args.resume).items():
                    if isinstance(got, str):
                        log(f"  SKIPPED {n}, seed {sd}: {got}")
                        results.setdefault("failed", {})[f"{n}, seed {sd}"] = got
                    else:
                        runs.setdefault(n, {})[sd] = got
            jobs = []
        for i, (sd, n) in enumerate(jobs, 1):
            log(f"[grpo {i}/{len(jobs)}]")
            config, overrides = GRPO_VARIANTS[n]
            try:
                rows = (
                    load_rows(run_dir(out, n, sd))
                    if args.report_only
                    else run_grpo(n, config, overrides, steps, out, args.quick, sd, args.resume)
                )
                runs.setdefault(n, {})[sd] = rows
            except (RuntimeError, FileNotFoundError) as e:  # one broken variant must not lose the others' numbers
                log(f"  SKIPPED {n}, seed {sd}: {e}")
                results.setdefault("failed", {})[f"{n}, seed {sd}"] = str(e)
        per_seed = {n: {sd: step_stats(r) for sd, r in per.items()} for n, per in runs.items()}
        stats = {n: combine_seeds(per_seed[n]) for n in per_seed}
        for n in stats:
            stats[n]["speculation"] = spec_label(*GRPO_VARIANTS[n])
            stats[n]["name"] = n
        pool_train_time(stats)
        first = {n: per[min(per)] for n, per in runs.items()}  # one seed's rows for the per-step plots
        results["grpo"] = {
            "steps": steps,
            "seeds": seeds,
            "lockstep": args.lockstep,
            "stats": stats,
            "variants": {n: GRPO_VARIANTS[n] for n in names},
        }
        plot_grpo(first, stats, out / "grpo_steps.png")
        plot_tail(first, stats, out / "long_tail.png")
        seed_note = f", mean of seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f", seed {seeds[0]}"
        configs = ", ".join(sorted({Path(GRPO_VARIANTS[n][0]).name for n in stats}))
        turns = ", variants in lockstep" if args.lockstep else ""
        emit(f"GRPO step time ({steps} steps, {configs}{seed_note}{turns})", grpo_table(stats), "grpo_steps.png")
        emit("Per-phase share of step time", phase_table(stats))
        emit("The long tail (mean over steps)", tail_table(stats), "long_tail.png")
        if pooled := length_pool.length_pooled_table(stats, family, baseline_of):
            emit("Sampled tails: generation per token of the longest rollout", pooled)
        if "grpo_base" in stats:
            verdict = verdict_text(stats)
            results["grpo"]["verdict"] = verdict
            emit("Verdict", verdict)
        if {"grpo_spec", "grpo_spec policy 2x"} <= set(stats):
            emit("Policy workers", policy_workers_text(stats))
        if PRECISION_VARIANTS & set(stats):
            dirs = {n: {sd: run_dir(out, n, sd) for sd in per} for n, per in runs.items()}
            emit("Precision: fp32 against bf16-mixed", precision_runs.precision_table(stats, per_seed, dirs))
        if OVERLAP_VARIANTS & set(stats):
            dirs = {n: {sd: run_dir(out, n, sd) for sd in per} for n, per in runs.items()}
            emit("Overlap: max_staleness 0 against 1", overlap_runs.overlap_table(stats, per_seed, runs, dirs))
            emit("Overlap, modelled per device split (docs/scaling.md)", overlap_runs.split_table(stats))

    if "staleness" in sections:
        series = {}
        for name, (config, overrides) in drafter_life.RUNS.items():
            n_steps = args.cold_steps if name == "cold start" else args.staleness_steps
            if args.quick:
                n_steps = steps
            if args.report_only:
                series[name] = load_rows(run_dir(out, f"drafter {name}", seeds[0]))
            else:
                log(f"[staleness] drafter {name}: {n_steps} steps")
                series[name] = run_grpo(
                    f"drafter {name}", config, overrides, n_steps, out, args.quick, seeds[0], args.resume
                )
        results["staleness"] = series
        drafter_life.plot(series, out / "drafter_life.png", _plt())
        plot_staleness(series["frozen"], out / "staleness.png")
        body = drafter_life.staleness_table(series) + "\n\n" + drafter_life.staleness_verdict(series)
        emit(
            f"Drafter staleness: frozen and trained online ({len(series['frozen'])} steps, seed {seeds[0]})",
            body,
            "drafter_life.png",
        )
        emit(
            f"Drafter cold start ({len(series['cold start'])} steps, untrained drafter, online training)",
            drafter_life.cold_table(series["cold start"]),
        )
        if "grpo" in results:
            emit("The cost of online drafter training", drafter_life.cost_text(results["grpo"]["stats"]))

    if "peer" in sections:
        peer_steps = args.peer_steps or (4 if args.quick else steps)
        log(f"[peer] TRL GRPOTrainer, {peer_steps} steps")
        cmd = [
            sys.executable,
            str(REPO / "benchmarks/peer_trl.py"),
            "--config",
            str(REPO / "configs/grpo_base.yaml"),
            "--steps",
            str(peer_steps),
            "--out",
            str(out),
        ]
        saved = out / "peer_trl.json"
        reuse = args.resume and saved.exists() and json.loads(saved.read_text())["summary"].get("steps") == peer_steps
        if args.report_only or reuse:
            rc = 0
            log(f"  reusing {saved}" if reuse else f"  reading {saved}")
        else:
            with open(out / "peer_trl.log", "w") as fh:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO).returncode
        if rc != 0:
            body = (
                f"TRL run failed (rc={rc}); see {out / 'peer_trl.log'}. Is trl installed? (pip install -e '.[bench]')"
            )
        else:
            trl = json.loads((out / "peer_trl.json").read_text())
            trl["summary"].update(peer_trl.summarize(trl["rows"]))  # the current definitions, also for older files
            results["peer"] = trl
            body = peer_table(trl, results.get("grpo", {}).get("stats", {}))
        emit("Peer: TRL GRPOTrainer on the same task, model and batch", body)

    (out / "report.md").write_text("\n".join(report) + "\n")
    (out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    log(f"done in {time.time() - t_start:.0f}s; report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
