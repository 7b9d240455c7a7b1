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
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import bench_report as rep
import drafter_life  # siblings: the script's folder is on sys.path when it runs as benchmarks/bench.py
import length_pool
import overlap_runs
import peer_trl
import precision_runs
import rollout
import rollout_report
from bench_runs import (  # noqa: F401  (run_grpo: benchmarks/runtime_libs.py calls bench.run_grpo)
    build_models,
    combine_seeds,
    load_rows,
    pool_train_time,
    run_dir,
    run_grpo,
    run_grpo_lockstep,
    step_stats,
)
from bench_variants import (
    COMMON,
    GRPO_VARIANTS,
    OVERLAP_VARIANTS,
    PRECISION_VARIANTS,
    QUICK_VARIANTS,
    REPO,
    baseline_of,
    family,
    lockstep_memory_problem,
    spec_label,
)
from rollout import log

SECTIONS = ("rollout", "grpo", "staleness", "peer")
QUICK_SECTIONS = ("rollout", "grpo")  # --quick: staleness and peer only when asked for (--sections)


@dataclass
class Bench:
    """One invocation: its arguments, what it runs, and the report and results it builds."""

    args: argparse.Namespace
    sections: list[str]
    names: list[str]  # GRPO variants
    steps: int
    seeds: list[int]
    out: Path
    report: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)

    def emit(self, title: str, body: str, image: str | None = None) -> None:
        print(f"\n### {title}\n\n{body}", flush=True)
        self.report.extend([f"## {title}", "", body, ""] + ([f"![{title}]({image})", ""] if image else []))


def parser() -> argparse.ArgumentParser:
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
    return p


def parse(argv) -> Bench:
    """The arguments, checked: each bad one is named with what it may be."""
    p = parser()
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
    if args.lockstep and (why := lockstep_memory_problem(names)):
        p.error(why)
    if ("peer" in sections or "staleness" in sections) and "grpo" not in sections:
        # the rows peer and cost compare against
        names = [
            n for n in names if n in ("grpo_base", "grpo_spec", "grpo_spec drafter online", "grpo_spec drafter light")
        ]
        sections = ["grpo", *sections]
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers, e.g. --seeds 0,1")
    if not seeds:
        p.error("--seeds: give at least one seed, e.g. --seeds 0")
    steps = args.steps or (4 if args.quick else 60)
    return Bench(args, sections, names, steps, seeds, Path(args.out))


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
    if OVERLAP_VARIANTS & set(stats):
        b.emit("Overlap: max_staleness 0 against 1", overlap_runs.overlap_table(stats, per_seed, runs, dirs))
        b.emit("Overlap, modelled per device split (docs/scaling.md)", overlap_runs.split_table(stats))


def section_staleness(b: Bench) -> None:
    args, series = b.args, {}
    for name, (config, overrides) in drafter_life.RUNS.items():
        n_steps = args.cold_steps if name == "cold start" else args.staleness_steps
        if args.quick:
            n_steps = b.steps
        if args.report_only:
            series[name] = load_rows(run_dir(b.out, f"drafter {name}", b.seeds[0]))
        else:
            log(f"[staleness] drafter {name}: {n_steps} steps")
            series[name] = run_grpo(
                f"drafter {name}", config, overrides, n_steps, b.out, args.quick, b.seeds[0], args.resume
            )
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
    peer_steps = args.peer_steps or (4 if args.quick else b.steps)
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


def main(argv=None) -> int:
    b = parse(argv)
    b.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    head = rep.header()
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


if __name__ == "__main__":
    sys.exit(main())
