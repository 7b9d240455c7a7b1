"""What speculation buys in RL, measured side by side in one run.

    python -m benchmarks grpo --quick             # the shipped default (grpo_spec) against grpo_base, 4 steps
    python -m benchmarks grpo --seeds 0,1         # every GRPO variant (hours on 2 cores)
    python -m benchmarks staleness                # one section per command: grpo, staleness, peer
    python -m benchmarks.grpo.bench --quick      # under 5 min on 2 cores: the rollout and GRPO sections, small
    python -m benchmarks.grpo.bench --seeds 0,1  # every section and variant in one report

Sections (each prints markdown tables; all write ``<out>/report.md``, JSON and PNGs):

rollout
    Rollout throughput of one vLLM engine: no speculation, draft_model, ngram and
    (with ``arctic-inference``) suffix at k in {1, 2, 3, 5}, draft_model with a
    batch-size schedule, batch sizes {1, 8, 64, 256}, temperatures 0 and 1;
    tokens/s, acceptance, speed-up over no speculation in the same run
    (``benchmarks/rollout/rollout.py``).
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
    online training from an untrained drafter (``benchmarks/grpo/drafter_life.py``).
peer
    TRL's GRPOTrainer on the same task, model, batch and step count
    (``benchmarks/grpo/peer_trl.py``), against rl_specdec's step time and rollout tokens/s.

Every GRPO figure comes from a fresh subprocess per run, with wandb and
checkpoints off (identical for every variant) and its metrics read back from
``metrics.jsonl``. Step time is the median over the steps after the first (the
first pays for compilation and cache warm-up). Nothing else should run on the
machine meanwhile; the report prints the load average. With ``--lockstep`` a
seed's variants run together and take turns step by step
(``benchmarks/grpo/lockstep.py``), so a machine that slows down over minutes slows
every variant alike.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import bench_common
from benchmarks.bench_common import log
from benchmarks.grpo import bench_report as rep
from benchmarks.grpo import drafter_life, length_pool, overlap_runs, peer_trl, precision_runs, real_model_runs
from benchmarks.grpo.bench_args import QUICK_STEPS, SECTIONS, Bench, parse
from benchmarks.grpo.bench_runs import (
    build_models,
    combine_seeds,
    load_rows,
    pool_train_time,
    run_dir,
    run_grpo,
    run_grpo_lockstep,
    step_stats,
)
from benchmarks.grpo.bench_variants import (
    GRPO_VARIANTS,
    OVERLAP_VARIANTS,
    PRECISION_VARIANTS,
    REPO,
    baseline_of,
    family,
    spec_label,
)
from benchmarks.rollout import rollout, rollout_report


def section_rollout(b: Bench) -> None:
    log("[rollout] one engine per (method, k)")
    rollout_parser = argparse.ArgumentParser(add_help=False)
    rollout.add_args(rollout_parser)
    ra = rollout_parser.parse_args(["--out", str(b.out)] + (["--quick"] if b.args.quick else []))
    rollout.finish_args(ra)
    saved = b.out / "rollout.json"
    reuse = b.args.resume and saved.exists() and json.loads(saved.read_text()).get("quick", False) == b.args.quick
    if b.args.report_only or reuse:
        res = json.loads(saved.read_text())
        log(f"  reusing {saved}" if reuse else f"  reading {saved}")
        rollout_report.plot_methods(res["methods"], b.out / "rollout.png")
    else:
        res = rollout.run(ra, print_tables=False)
    b.results["rollout"] = res
    if not rollout.has_suffix():
        log("  suffix skipped: arctic-inference is not installed (bash scripts/install_arctic_inference.sh)")
        b.report += [
            "_suffix skipped: arctic-inference is not installed (bash scripts/install_arctic_inference.sh)._",
            "",
        ]
    b.emit(
        "Rollout speed-up over no speculation (one engine, all cores)",
        rollout_report.speedup_table(res["methods"]),
        "rollout.png",
    )
    b.emit("Rollout throughput, every cell", rollout_report.method_table(res["methods"]))


def grpo_runs(b: Bench) -> dict[str, dict[int, list[dict]]]:
    """variant -> seed -> metrics rows: run (seed-major, so a stopped benchmark has whole seeds), or read back."""
    runs: dict[str, dict[int, list[dict]]] = {}
    args = b.args
    jobs = [(sd, n) for sd in b.seeds for n in b.names]
    if args.lockstep and not args.report_only:
        for sd in b.seeds:
            for n, got in run_grpo_lockstep(b.names, b.steps, b.out, args.quick, sd, args.resume).items():
                if isinstance(got, str):
                    log(f"  SKIPPED {n}, seed {sd}: {got}")
                    b.results.setdefault("failed", {})[f"{n}, seed {sd}"] = got
                else:
                    runs.setdefault(n, {})[sd] = got
        jobs = []
    for i, (sd, n) in enumerate(jobs, 1):
        log(f"[grpo {i}/{len(jobs)}]")
        config, overrides = GRPO_VARIANTS[n]
        try:
            rows = (
                load_rows(run_dir(b.out, n, sd))
                if args.report_only
                else run_grpo(n, config, overrides, b.steps, b.out, args.quick, sd, args.resume)
            )
            runs.setdefault(n, {})[sd] = rows
        except (RuntimeError, FileNotFoundError) as e:  # one broken variant must not lose the others' numbers
            log(f"  SKIPPED {n}, seed {sd}: {e}")
            b.results.setdefault("failed", {})[f"{n}, seed {sd}"] = str(e)
    return runs


def section_grpo(b: Bench) -> None:
    log(f"[grpo] {len(b.names)} variants x {len(b.seeds)} seed(s) x {b.steps} steps")
    runs = grpo_runs(b)
    per_seed = {n: {sd: step_stats(r) for sd, r in per.items()} for n, per in runs.items()}
    stats = {n: combine_seeds(per_seed[n]) for n in per_seed}
    for n in stats:
        stats[n]["speculation"] = spec_label(*GRPO_VARIANTS[n])
        stats[n]["name"] = n
    pool_train_time(stats)
    first = {n: per[min(per)] for n, per in runs.items()}  # one seed's rows for the per-step plots
    b.results["grpo"] = {
        "steps": b.steps,
        "seeds": b.seeds,
        "lockstep": b.args.lockstep,
        "stats": stats,
        "variants": {n: GRPO_VARIANTS[n] for n in b.names},
    }
    rep.plot_grpo(first, stats, b.out / "grpo_steps.png")
    rep.plot_tail(first, stats, b.out / "long_tail.png")
    seeds = b.seeds
    seed_note = f", mean of seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f", seed {seeds[0]}"
    configs = ", ".join(sorted({Path(GRPO_VARIANTS[n][0]).name for n in stats}))
    turns = ", variants in lockstep" if b.args.lockstep else ""
    b.emit(f"GRPO step time ({b.steps} steps, {configs}{seed_note}{turns})", rep.grpo_table(stats), "grpo_steps.png")
    b.emit("Per-phase share of step time", rep.phase_table(stats))
    b.emit("The long tail (mean over steps)", rep.tail_table(stats), "long_tail.png")
    grpo_extras(b, stats, per_seed, runs)


def grpo_extras(b: Bench, stats: dict, per_seed: dict, runs: dict) -> None:
    """The tables only some variants have: sampled tails, the verdict, policy workers, precision, overlap."""
    if pooled := length_pool.length_pooled_table(stats, family, baseline_of):
        b.emit("Sampled tails: generation per token of the longest rollout", pooled)
    if "grpo_base" in stats:
        verdict = rep.verdict_text(stats)
        b.results["grpo"]["verdict"] = verdict
        b.emit("Verdict", verdict)
    if {"grpo_spec", "grpo_spec policy 2x"} <= set(stats):
        b.emit("Policy workers", rep.policy_workers_text(stats))
    dirs = {n: {sd: run_dir(b.out, n, sd) for sd in per} for n, per in runs.items()}
    if PRECISION_VARIANTS & set(stats):
        b.emit("Precision: fp32 against bf16-mixed", precision_runs.precision_table(stats, per_seed, dirs))
    if set(real_model_runs.VARIANTS) & set(stats):
        b.emit("The real model: held-out accuracy and log-prob mismatch", real_model_runs.learning_table(dirs))
    if OVERLAP_VARIANTS & set(stats):
        b.emit("Overlap: max_staleness 0 against 1", overlap_runs.overlap_table(stats, per_seed, runs, dirs))
        b.emit("Overlap, modelled per device split (docs/scaling.md)", overlap_runs.split_table(stats))


def section_staleness(b: Bench) -> None:
    args, series = b.args, {}
    head = args.drafter == "eagle3"
    for name, (config, overrides) in (drafter_life.HEAD_RUNS if head else drafter_life.RUNS).items():
        n_steps = args.cold_steps if name == "cold start" else args.staleness_steps
        if args.quick:
            n_steps = b.steps
        run = f"{'head' if head else 'drafter'} {name}"
        if args.report_only:
            series[name] = load_rows(run_dir(b.out, run, b.seeds[0]))
        else:
            log(f"[staleness] {run}: {n_steps} steps")
            series[name] = run_grpo(run, config, overrides, n_steps, b.out, args.quick, b.seeds[0], args.resume)
    b.results["staleness"] = series
    drafter_life.plot(series, b.out / "drafter_life.png", rep._plt())
    rep.plot_staleness(series["frozen"], b.out / "staleness.png")
    body = drafter_life.staleness_table(series) + "\n\n" + drafter_life.staleness_verdict(series)
    b.emit(
        f"Drafter staleness: frozen and trained online ({len(series['frozen'])} steps, seed {b.seeds[0]})",
        body,
        "drafter_life.png",
    )
    b.emit(
        f"Drafter cold start ({len(series['cold start'])} steps, untrained drafter, online training)",
        drafter_life.cold_table(series["cold start"]),
    )
    if "grpo" in b.results:
        b.emit("The cost of online drafter training", drafter_life.cost_text(b.results["grpo"]["stats"]))


def section_peer(b: Bench) -> None:
    args, out = b.args, b.out
    peer_steps = args.peer_steps or (QUICK_STEPS if args.quick else b.steps)
    log(f"[peer] TRL GRPOTrainer, {peer_steps} steps")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.grpo.peer_trl",
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
        body = f"TRL run failed (rc={rc}); see {out / 'peer_trl.log'}. Is trl installed? (pip install -e '.[bench]')"
    else:
        trl = json.loads((out / "peer_trl.json").read_text())
        trl["summary"].update(peer_trl.summarize(trl["rows"]))  # the current definitions, also for older files
        b.results["peer"] = trl
        body = rep.peer_table(trl, b.results.get("grpo", {}).get("stats", {}))
    b.emit("Peer: TRL GRPOTrainer on the same task, model and batch", body)


SECTION_RUNNERS = {
    "rollout": section_rollout,
    "grpo": section_grpo,
    "staleness": section_staleness,
    "peer": section_peer,
}


def main(argv=None, section: str | None = None) -> int:
    """Every section asked for (``--sections``), or one (``section``: ``python -m benchmarks grpo``)."""
    b = parse(argv, __doc__, section)
    b.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    head = bench_common.header()
    log(f"benchmark: {head}")
    build_models(b.sections, b.names)
    b.report = [f"# rl_specdec benchmark{' (--quick)' if b.args.quick else ''}", "", f"_{head}_", ""]
    b.results = {"header": head, "quick": b.args.quick}
    for name in SECTIONS:  # in this order, whatever the order asked for
        if name in b.sections:
            SECTION_RUNNERS[name](b)
    (b.out / "report.md").write_text("\n".join(b.report) + "\n")
    (b.out / "bench.json").write_text(json.dumps(b.results, indent=1, default=str))
    log(f"done in {time.time() - t_start:.0f}s; report: {b.out / 'report.md'}")
    return 0


def grpo_main(argv=None) -> int:
    return main(argv, "grpo")


def staleness_main(argv=None) -> int:
    return main(argv, "staleness")


def peer_main(argv=None) -> int:
    return main(argv, "peer")


if __name__ == "__main__":
    sys.exit(main())
