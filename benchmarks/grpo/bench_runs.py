"""bench.py's GRPO runs: one fresh process per run (or a seed's variants in lockstep), read back from
metrics.jsonl, and the figures taken from their rows."""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.grpo import length_pool, lockstep
from benchmarks.grpo.bench_variants import (
    COMMON,
    DRAFTER_VARIANTS,
    GRPO_VARIANTS,
    OVERLAP_VARIANTS,
    PHASES,
    PRECISION_VARIANTS,
    QUICK,
    REPO,
    TRAINER_VARIANTS,
    family,
)
from benchmarks.rollout.rollout import log


# ---- running ------------------------------------------------------------------------
def run_dir(out: Path, name: str, seed: int) -> Path:
    return out / "runs" / f"seed{seed}" / name.replace(" ", "_").replace("=", "")


def load_rows(log_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows after the step-0 baseline."""
    rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    return [r for r in rows if r["step"] >= 1]


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
    """A seed's variants as one ring (``benchmarks/grpo/lockstep.py``): they take turns step by step. Returns each
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
        "acceptance_length": mean_or_none(rs, "spec_decode/acceptance_length"),
        "acceptance_rate": mean_or_none(rs, "spec_decode/acceptance_rate"),
        **length_pool.per_run(rs),
    }
    for p in PHASES:
        out[f"{p}_s"] = mean(f"timing/{p}")
    out["drafter_train_s"] = mean_or_none(rs, "timing/drafter_train")
    for pct in (50, 90, 100):
        out[f"done{pct}_s"] = mean_or_none(rs, f"generation/time_to_{pct}pct_done")
    out["len_max_over_median"] = mean_or_none(
        [
            {"x": r["generation/response_length_max"] / r["generation/response_length_median"]}
            for r in rs
            if r.get("generation/response_length_median")
        ],
        "x",
    )
    out["last10_share"] = mean_or_none(
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
    own = TRAINER_VARIANTS | DRAFTER_VARIANTS | PRECISION_VARIANTS | OVERLAP_VARIANTS
    groups: dict[tuple[bool, str], list[str]] = {}  # engine layout and workload (the real model's too) -> variants
    for n in stats:
        if n not in own:
            groups.setdefault(("2x1" in n, family(n)), []).append(n)
    for group in groups.values():
        pooled = statistics.fmean(stats[n]["train_s"] for n in group)
        for n in group:
            stats[n]["step_pooled_s"] = stats[n]["step_mean_s"] - stats[n]["train_s"] + pooled
    # their train phase is what they change: pooled only with itself
    for n in own & set(stats):
        stats[n]["step_pooled_s"] = stats[n]["step_mean_s"]


def mean_or_none(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def build_models(sections: list[str], names: list[str]) -> None:
    """The toy models the runs need, built once before anything is timed."""
    from rl_specdec.toy.build import build_toy_models

    build_toy_models(log=log)
    if "grpo" in sections and any(GRPO_VARIANTS[n][0].endswith(("_longtail.yaml", "_wide.yaml")) for n in names):
        from rl_specdec.toy.longtail import build_longtail_models
        from rl_specdec.toy.wide import build_wide_models

        build_longtail_models(log=log)
        build_wide_models(log=log)
