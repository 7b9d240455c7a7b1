"""What speculation buys on a GPU, predicted: a roofline step-cost model per device and model pair,
calibrated on this CPU, driving a simulated GRPO generation phase under every policy, the package's own
adaptive controller among them. Everything it prints about a GPU is a prediction.

    python -m benchmarks gpu-whatif                     # calibration, the GPU tables and the plot (< 2 min)
    python -m benchmarks gpu-whatif --calibrate results/cost-table/cost_table_*.json   # other measured tables
    python -m benchmarks gpu-whatif --calibrate docs/data/cost_table_wide.json \\
        --grpo-metrics logs/grpo_spec_wide/metrics.jsonl --pair wide --policy controller:5 --k 5 --grpo-prompt-len 5

The model, its constants and their sources: benchmarks/whatif/ (costmodel.py, hardware.py, models.py,
workload.py); the policies: whatif/policies.py; the results: docs/performance.md, "On a GPU, predicted", and
docs/lab/gpu.md, "Predicted speed-ups"; the calibration: docs/lab/gpu.md, "How good the calibration is".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np

from benchmarks import bench_common
from benchmarks.whatif import calibrate as CAL
from benchmarks.whatif import hardware as H
from benchmarks.whatif import measured
from benchmarks.whatif import report as R
from benchmarks.whatif import workload as W
from benchmarks.whatif.adapter import controller_api
from benchmarks.whatif.experiments import Setup, batch_sensitivity, run_all, speedups


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the GPU what-if")
    g.add_argument(
        "--devices", default="H100,H200,A100,L40S,H20", help="comma-separated (GB200 is added for the anchors)"
    )
    g.add_argument("--pairs", default=",".join(W.GPU_PAIRS))
    g.add_argument(
        "--gpu-measured",
        metavar="JSON",
        help="a benchmarks/gpu/gpu_torch.py measurement: add its GPU with the kernel constants fitted to it",
    )
    g.add_argument("--batch", type=int, default=128, help="sequences per engine in one GRPO step")
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--length-median", type=float, default=1000.0)
    g.add_argument("--length-sigma", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=8192)
    g.add_argument("--lengths-from", help="a metrics.jsonl: the response lengths of its last training row instead")
    g.add_argument("--acceptance", action="append", default=[], help="PAIR=ALPHA1,DECAY (override a pair's acceptance)")
    g.add_argument("--warmup-phases", type=int, default=2, help="phases the controller runs before the measured one")
    g.add_argument("--k-max", type=int, default=5)
    g.add_argument("--seed", type=int, default=0)
    bench_common.add_out(g, "gpu-whatif", "gpu_whatif.md, gpu_whatif.json, speedup_vs_batch.png")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-calibration", action="store_true", help="skip the calibration on docs/data's measured tables")
    c = p.add_argument_group("calibration on this CPU")
    c.add_argument(
        "--calibrate", nargs="+", metavar="JSON", help="measured t(b,k) tables (benchmarks/rollout/cost_table.py)"
    )
    c.add_argument("--model-config", help="config.json of a table's policy whose shapes are not known (the wide pair)")
    c.add_argument("--drafter-config", help="config.json of its drafter")
    c.add_argument("--cpu-constants", help="fitted constants (JSON written by --calibrate) instead of fitting")
    c.add_argument("--grpo-metrics", help="a run's metrics.jsonl: predict each step's generation phase")
    c.add_argument("--pair", default="toy", help="the run's pair: toy | longtail | wide | a table's pair name")
    c.add_argument(
        "--policy",
        default=None,
        help="none | fixed:K | schedule:JSON | controller:K_MAX (default: "
        "none, or fixed:--k when the rows have an acceptance length)",
    )
    c.add_argument("--k", type=int, default=3, help="the run's num_speculative_tokens (for its acceptance)")
    c.add_argument("--engines", type=int, default=1)
    c.add_argument("--grpo-prompt-len", type=int, default=10, help="the run's prompt tokens (toy task: ~10)")
    c.add_argument(
        "--max-num-seqs", type=int, default=256, help="the run's max_num_seqs (vLLM 0.32's CPU default: 256)"
    )
    c.add_argument("--also-gpu", action="store_true", help="with --calibrate/--grpo-metrics: print the GPU tables too")
    return p.parse_args(argv)


def pairs_of(args) -> list[W.Pair]:
    out = []
    over = dict(a.split("=", 1) for a in args.acceptance)
    for key in args.pairs.split(","):
        pair = W.PAIRS[key]
        if key in over:
            a1, dec = map(float, over[key].split(","))
            pair = replace(pair, alpha1=a1, decay=dec, acceptance_source=f"--acceptance {over[key]}")
        out.append(pair)
    return out


def lengths_of(args) -> tuple[np.ndarray, list, str]:
    """(the measured phase's lengths, the controller's warm-up phases' lengths, where they come from)."""
    if args.lengths_from:
        rows = W.read_metrics(args.lengths_from)
        lens = [W.lengths_from_row(r) for r in rows[-(args.warmup_phases + 1) :]]
        return lens[-1], lens[:-1] or [lens[-1]] * args.warmup_phases, f"rebuilt from {args.lengths_from}"
    dist = W.LengthDist(args.length_median, args.length_sigma, args.max_new_tokens)
    main = dist.sample(args.batch, np.random.default_rng([args.seed, 0]))
    warm = [dist.sample(args.batch, np.random.default_rng([args.seed, 100 + i])) for i in range(args.warmup_phases)]
    return (
        main,
        warm,
        (
            f"lognormal, median {dist.median:.0f}, sigma {dist.sigma}, capped at {dist.cap} (sigma 1: p99 ~10x the "
            "median, as reasoning-RL runs show; median and cap illustrative: whatif/workload.py LengthDist)"
        ),
    )


def gpu_report(args) -> None:
    t0 = time.perf_counter()
    devices = [H.by_name(n) for n in args.devices.split(",")]
    if args.gpu_measured:
        from benchmarks.whatif.gpu_report import measured_device

        devices.append(measured_device(json.load(open(args.gpu_measured))))
    pairs = pairs_of(args)
    lengths, warm, src = lengths_of(args)
    setup = Setup(
        batch=len(lengths),
        prompt_len=args.prompt_len,
        k_max=args.k_max,
        warmup_phases=args.warmup_phases,
        seed=args.seed,
    )
    _, _, where = controller_api()
    print("# On a GPU, predicted (a model, not a measurement)\n")
    print(
        f"Workload per engine: {len(lengths)} rollouts, prompt {args.prompt_len} tokens, response lengths {src}: "
        f"median {np.median(lengths):.0f}, mean {lengths.mean():.0f}, max {lengths.max()}, {lengths.sum()} tokens."
    )
    print(
        f"Controller: {where}, k 0..{args.k_max}, default speculation_control settings, "
        f"{args.warmup_phases} warm-up phase(s), then the mean of {setup.measured_phases} phases on the workload.\n"
    )
    print(R.acceptance_table(pairs))
    print(
        "\nDevices (datasheet, dense bf16): "
        + "; ".join(
            f"{d.name} {d.bandwidth / 1e12:.2f} TB/s, {d.flops / 1e12:.0f} TFLOPS, ridge {d.ridge:.0f} FLOP/B"
            for d in devices
        )
    )
    anchor_devices = devices + [H.GB200]
    results = run_all(pairs, anchor_devices, setup, lengths, warm, log=lambda s: print(s, file=sys.stderr))
    save_speedups(args.out, results)
    print(R.speedup_tables(results, devices))
    print("\n" + R.controller_tables(results, devices))
    print("\n### Beside the published figures (their workloads differ from ours: compare directions, not digits)\n")
    print(R.anchor_table(results, {p.key: p for p in pairs}))
    if not args.lengths_from:
        batches = (32, 128, 512)
        dist = W.LengthDist(args.length_median, args.length_sigma, args.max_new_tokens)
        sens = batch_sensitivity(pairs, devices, setup, dist, batches)
        print("\n### The per-engine batch moves the answer (fixed k only, same length distribution)\n")
        print(R.sensitivity_table(sens, batches))
    if not args.no_plot:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "speedup_vs_batch.png")
        tps = {(pk, d): r["tp"] for pk, by in results.items() for d, r in by.items()}
        R.plot(path, pairs, devices, args.prompt_len + float(np.median(lengths)), tps)
        print(f"\nPlot: {path}")
    print(f"\n(ran in {time.perf_counter() - t0:.1f} s)")


def save_speedups(out: str, results: dict) -> None:
    """``<out>/gpu_whatif.json``: {pair: {device: {policy: [generation speed-up, step speed-up]}}}."""
    os.makedirs(out, exist_ok=True)
    table = {pk: {d: speedups(r) for d, r in by.items()} for pk, by in results.items()}
    with open(os.path.join(out, "gpu_whatif.json"), "w") as f:
        json.dump({"machine": bench_common.header(versions=False), "speedups": table}, f, indent=1, default=float)


def cpu_report(args) -> None:
    theta = None
    if args.calibrate:
        tables = CAL.load_tables(args.calibrate)
        theta, prepared, meas, pred = CAL.fit(tables, args.model_config, args.drafter_config)
        print("# Calibration on this CPU\n")
        print(f"Tables: {', '.join(t['_path'] for t in tables)}")
        print(CAL.report(theta, prepared, meas, pred))
        os.makedirs(args.out, exist_ok=True)
        CAL.save_constants(os.path.join(args.out, "cpu_constants.json"), theta)
        print(f"\nConstants written to {os.path.join(args.out, 'cpu_constants.json')}")
    elif args.cpu_constants:
        theta = CAL.load_constants(args.cpu_constants)
    if args.grpo_metrics:
        if theta is None:
            sys.exit("--grpo-metrics needs the CPU constants: --calibrate TABLES or --cpu-constants JSON")
        from benchmarks.whatif.grpo import predict_grpo

        rows = W.read_metrics(args.grpo_metrics)
        spec = any(r.get("spec_decode/acceptance_length") for r in rows)
        policy = args.policy or (f"fixed:{args.k}" if spec else "none")
        pair = W.TOY_PAIRS.get(args.pair)
        if pair is None:
            tables = CAL.load_tables(args.calibrate or [])
            tbl = next((t for t in tables if t["pair"] == args.pair), None)
            if tbl is None:
                sys.exit(f"--pair {args.pair}: not a toy pair and no --calibrate table measured it")
            pair = CAL.table_pair(tbl, args.model_config, args.drafter_config)
        print(f"\n# The generation phase of {args.grpo_metrics}, predicted\n")
        print(
            predict_grpo(
                rows, theta, pair, policy, args.k, args.engines, args.grpo_prompt_len, max_seqs=args.max_num_seqs
            )
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    with bench_common.markdown_report(args.out, "gpu_whatif.md", "What speculation buys on a GPU, predicted"):
        if args.calibrate or args.grpo_metrics or args.cpu_constants:
            cpu_report(args)
            if not args.also_gpu:
                return
        if not args.no_calibration and measured.available():
            print(measured.calibration_report(log=lambda s: print(s, file=sys.stderr)) + "\n")
        gpu_report(args)


if __name__ == "__main__":
    main()
