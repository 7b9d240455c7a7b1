"""Is speculative decoding invisible to learning? Every sampled token's engine log-prob against the trainer's.

Engines are built from the GRPO run's own config (``--pair toy``: configs/grpo_spec.yaml, ``--pair wide``:
configs/grpo_spec_wide.yaml) in fp32, with prefix caching on and the run's generate calls (its task's P
problems each repeated G times, its max_new_tokens, temperature 1, the steps' seeds). Each sampled token's
log-prob as the engine reports it is compared with the trainer's: the same token sequences scored in
transformers (fp32) the way the GRPO trainer scores them (right-padded, length-sorted micro-batches,
``token_logprobs_and_entropy``). Modes, each its own stretch of calls:

* ``none``: no speculation (the control: the engine's own numerics against the trainer's);
* ``warmup``: the adaptive controller, restarted before every call so that every call runs its warm-up
  (each k for a few steps: the stretch of a run that switches k most), then its exploration;
* ``random``: k drawn at random in 0..k_max for every engine step (k changes within calls, in and out of
  the k=0 fast path, while requests finish at their own lengths and, where a call has more requests than
  the engine runs at once, others arrive);
* ``stretch``: k=0 for 3-40 steps, then k>0 for 1-12 steps: drafting after every stretch starts with the
  drafter catch-up;
* ``stale-drafter``: as ``stretch`` with the drafter catch-up switched off, so the drafter proposes from a KV
  cache with holes: what it proposes changes, what is sampled must not (the drafter only proposes);
* ``refit``: as ``random``, after a refit of a perturbed drafter before every call (the drafter-training
  refit path; lossless must hold for any drafter).

It prints a markdown table (tokens, max, p99.99, p99 and median of |engine - trainer| per mode, and the bound
derived from the control) and the worst tokens with their context, and writes JSON::

    python -m benchmarks.exactness.exactness --pair toy --tokens 200000
    python -m benchmarks.exactness.exactness --pair wide --tokens 1000000 --modes none,warmup

``--perturb-target 1e-4`` refits the speculating engines' target with weights off by that relative noise:
the negative control, which the check must flag.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.exactness import exactness_check as ec
from benchmarks.exactness import exactness_engine
from benchmarks.exactness.exactness_run import Run
from benchmarks.step_records import importable

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"toy": REPO / "configs" / "grpo_spec.yaml", "wide": REPO / "configs" / "grpo_spec_wide.yaml"}
GEN = "policy.generation"
SPEC, CONTROL = f"{GEN}.vllm_kwargs.speculative_config", f"{GEN}.speculation_control"
# engine -> overrides of the run's config; modes run on the engine named here
ENGINES = {
    "none": [f"{SPEC}=null", f"{CONTROL}.mode=off"],
    "adaptive": [f"{CONTROL}.mode=adaptive", f"{CONTROL}.draft_below=null", f"{CONTROL}.start=zero"],
    "fixed": [f"{CONTROL}.mode=fixed", f"{CONTROL}.draft_below=null"],
}
MODES = {
    "none": "none",
    "warmup": "adaptive",
    "random": "fixed",
    "stretch": "fixed",
    "stale-drafter": "fixed",
    "refit": "fixed",
}
# the EAGLE-3 head each pair's target drafts with under --drafter eagle3 (built and cached at first use)
HEADS = {"toy": "toy:eagle3", "wide": "toy:wide-eagle3"}
# the catch-up switched off is checked with the draft model only
NOT_FOR_HEADS = ("stale-drafter",)
# of --tokens (and of --minutes)
SHARE = {"none": 0.1, "warmup": 0.35, "random": 0.15, "stretch": 0.15, "stale-drafter": 0.1, "refit": 0.15}


def load(pair: str, engine: str, extra: list[str], drafter: str = "draft_model"):
    from rl_specdec.config import load_config
    from rl_specdec.toy.resolve import prepare_models

    heads = [f"{SPEC}.method=eagle3", f"{SPEC}.model={HEADS[pair]}"] if drafter == "eagle3" else []
    return prepare_models(load_config(CONFIGS[pair], ["policy.precision=fp32", *heads, *ENGINES[engine], *extra]))


def schedule(mode: str, k_max: int, seed: int, n: int = 4999) -> list[int] | None:
    """k per engine step for the fixed engine's modes (read cyclically by the engine)."""
    rng = random.Random(seed)
    if mode in ("random", "refit"):
        return [rng.randint(0, k_max) for _ in range(n)]
    if mode in ("stretch", "stale-drafter"):
        out: list[int] = []
        while len(out) < n:
            out += [0] * rng.randint(3, 40) + [rng.randint(1, k_max)] * rng.randint(1, 12)
        return out
    return None


class Calls:
    """The run's generate calls: step s's problems repeated G times, its sampling settings."""

    def __init__(self, cfg, seed: int):
        from transformers import AutoTokenizer

        from rl_specdec.tasks import make_task

        self.cfg, self.seed = cfg, seed
        self.task = make_task(cfg.task.name, **cfg.task.kwargs)
        self.tok = AutoTokenizer.from_pretrained(cfg.policy.model_name)

    def __call__(self, step: int):
        from rl_specdec.grpo.sources import prompt_seed, sampling_seed
        from rl_specdec.rollout import SamplingSettings
        from rl_specdec.tasks import encode_prompts

        g = self.cfg.grpo
        samples = self.task.make_batch(seed=prompt_seed(self.seed, step), n=g.num_prompts_per_step)
        prompts = [
            ids for ids in encode_prompts(self.task, self.tok, samples) for _ in range(g.num_generations_per_prompt)
        ]
        return prompts, SamplingSettings.from_config(self.cfg.policy.generation, seed=sampling_seed(self.seed, step))


def perturbed(path: str, scale: float, seed: int, method: str = "draft_model") -> dict:
    """The model's (or the EAGLE-3 head's) weights plus Gaussian noise of ``scale`` times each tensor's std
    (seeded), under the names the engine's refit takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_specdec.heads.eagle3 import load_head

    if method == "eagle3":
        sd = load_head(path).vllm_state_dict()
    else:
        sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g) * v.std() * scale if v.numel() > 1 else v for k, v in sd.items()}


def before_call(group, mode: str, cfg, call: int, args) -> None:
    if mode == "warmup":
        group.engine_rpc("rl_specdec_exactness", restart_controller=True)
    if mode == "refit":
        spec = cfg.policy.generation.speculation
        noisy = perturbed(spec.model, 0.05, args.seed * 1000 + call, spec.method)
        group.update_weights(noisy, target="drafter")


def run_mode(group, model, cfg, mode: str, run: Run, args, bar) -> None:
    """Calls until the mode's share of ``--tokens`` is checked (or its share of ``--minutes`` is spent), the run
    saved after every call."""
    calls, spec = Calls(cfg, args.seed), mode != "none"
    k_max = cfg.policy.generation.speculation.k if spec else 0
    info, tally = run.info[mode], run.tallies[mode]
    if spec:  # a resumed run goes on with the schedule where the saved calls left it
        sched = schedule(mode, k_max, args.seed + 7919 * info["calls"])
        group.engine_rpc("rl_specdec_exactness", schedule=sched, catch_up=mode != "stale-drafter", take=True)
    deadline = time.monotonic() + 60 * args.minutes * run.time_share(mode, args)
    while info["tokens"] < run.budget(mode, args) and time.monotonic() < deadline and not run.stops.requested:
        call = info["calls"]
        prompts, sampling = calls(10_000 * (1 + list(MODES).index(mode)) + call)  # each mode its own steps
        before_call(group, mode, cfg, call, args)
        t0 = time.perf_counter()
        try:
            with run.stops.abandonable():  # Ctrl-C drops the call in flight: the saved calls are all kept
                out = group.generate(prompts, sampling)
        except KeyboardInterrupt:
            if not run.stops.requested:
                raise
            break
        info["generate_s"] += time.perf_counter() - t0
        ctx = None
        if spec:
            steps = group.engine_rpc("rl_specdec_exactness", take=True)[0]["steps"]
            ctx = ec.token_contexts(steps, [len(t) for t in out.token_ids])
            info["catch_up_tokens"] += sum(r[4] for s in steps for r in s["reqs"].values())
        ref = ec.recompute(model, prompts, out.token_ids, cfg.policy.micro_batch_size, calls.tok.pad_token_id)
        tally.add(call, prompts, out.token_ids, out.logprobs, ref, ctx)
        got = sum(len(t) for t in out.token_ids)
        info["tokens"], info["calls"] = info["tokens"] + got, call + 1
        run.save()
        bar.update(got)
    if spec and not run.stops.requested:
        group.engine_rpc("rl_specdec_exactness", schedule=None, catch_up=True)
    tally.explain(model)
    run.save()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        print(table(json.loads(Path(args.report).read_text())))
        return 0
    from rl_specdec.grpo.stop import StopSignals, signal_name

    importable()
    if args.resume:
        run = Run.resume(Path(args.resume), args, SHARE, machine())
    else:
        run = Run.new(args, SHARE, machine())
    by_engine: dict[str, list[str]] = {}
    for m in args.modes:
        if run.info[m]["tokens"] < run.budget(m, args):
            by_engine.setdefault(MODES[m], []).append(m)
    again = f"python -m benchmarks exactness --resume {run.path} --tokens {args.tokens}"
    with StopSignals(grace_s=120.0, resume_command=again) as run.stops:
        for engine, modes in by_engine.items():
            if not run.stops.requested:
                run_engine(engine, modes, args, run)
    results = run.save()
    print(table(results))
    print(f"written {run.path}; to add tokens: {again}", file=sys.stderr)
    if run.stops.requested:
        print(f"stopped by {signal_name(run.stops.signum)}; nothing saved is lost", file=sys.stderr)
        return 128 + run.stops.signum
    bad = [m for m, r in results["modes"].items() if m != "none" and r["max"] > results.get("bound", float("inf"))]
    return 1 if bad else 0


def run_engine(engine: str, modes: list[str], args, run: Run) -> None:
    """One engine for ``modes`` (run in turn on it), shut down before the next engine starts."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    cfg = load(args.pair, engine, args.set, args.drafter)
    group = exactness_engine.engine_group()(cfg.policy.model_name, cfg.policy.generation, cfg.cluster, seed=args.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name, dtype=torch.float32).eval()
    try:
        if args.perturb_target and engine != "none":
            group.update_weights(perturbed(cfg.policy.model_name, args.perturb_target, 7), target="policy")
        for m in modes:
            if run.stops.requested:
                break
            budget, done = run.budget(m, args), run.info[m]["tokens"]
            with tqdm(total=budget, initial=done, desc=f"{args.pair} {m}", unit="tok", file=sys.stderr) as bar:
                run_mode(group, model, cfg, m, run, args, bar)
            r = run.results["modes"].get(m)
            if r:
                print(f"{m}: {r['tokens']} tokens, max {r['max']:.2e}", file=sys.stderr, flush=True)
    finally:
        group.shutdown()


def table(results: dict) -> str:
    control = results["modes"].get("none", {}).get("max")
    lines = [
        f"exactness, {results['pair']} pair, {results.get('drafter', 'draft_model')}, {results['machine']}: "
        "|engine log-prob - trainer log-prob| (fp32)",
        "",
        "| mode | tokens | calls | gen tokens/s | catch-up tokens | max | p99.99 | p99 | median | max / control's "
        "| worst sequence's mean |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, r in results["modes"].items():
        ratio = f"{r['max'] / control:.1f}x" if control else "-"
        lines.append(
            f"| {m} | {r['tokens']:,} | {r['calls']} | {r['tokens_per_s']:.0f} | {r['catch_up_tokens']:,} | "
            f"{r['max']:.2e} | {r['p99.99']:.2e} | {r['p99']:.2e} | {r['median']:.2e} | {ratio} "
            f"| {r.get('worst_sequence_mean', float('nan')):.2e} |"
        )
    if "bound" in results:
        lines += ["", f"bound (max(10 x control's max, 16 fp32 ulps x log-prob scale)): {results['bound']:.2e}"]
    lines += [
        "",
        "| mode | diff | engine | trainer | diff to the sequence alone | call | step | k history | batch | position "
        "| kind | catch-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, r in results["modes"].items():
        for w in r["worst"][:3]:
            kind = ec.kind(w) if "plain" in w else "-"
            lines.append(
                f"| {m} | {w['diff']:.2e} | {w['engine']:.4f} | {w['trainer']:.4f} "
                f"| {abs(w['engine'] - w['alone']):.2e} "
                f"| {w['call']} | {w.get('step', '-')} | {w.get('k_history', '-')} | {w.get('batch', '-')} | "
                f"{w['prompt_len'] + w['token']} | {kind} | {w.get('catch_up_before_drafts', '-')} |"
            )
    return "\n".join(lines)


def machine() -> str:
    import os
    import platform

    name = platform.processor() or platform.machine()
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        text = Path("/proc/cpuinfo").read_text()
        name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), name)
        flags = " AVX-512" if "avx512f" in text else ""
    from rl_specdec.toy.presets import usable_cores

    return f"{name}, {usable_cores()} cores{flags}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=sorted(CONFIGS), default="toy")
    p.add_argument("--tokens", type=int, default=20000, help="sampled tokens to check, shared among the modes")
    p.add_argument("--modes", help=f"comma-separated, among {', '.join(MODES)} (default: all the drafter takes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=1e9, help="wall-time cap, shared among the modes as --tokens is")
    p.add_argument("--set", action="append", default=[], help="a config override, e.g. policy.micro_batch_size=4")
    p.add_argument("--perturb-target", type=float, default=0.0, help="negative control: target weights' noise")
    p.add_argument("--out", default=str(REPO / "results" / "exactness"))
    p.add_argument("--report", help="print the tables of a JSON this command wrote, and run nothing")
    p.add_argument("--resume", help="a JSON this command wrote: add tokens to it, up to --tokens (its settings kept)")
    p.add_argument(
        "--drafter", choices=("draft_model", "eagle3"), default="draft_model", help="eagle3: the pair's head"
    )
    args = p.parse_args(argv)
    takes = [m for m in MODES if args.drafter == "draft_model" or m not in NOT_FOR_HEADS]
    args.modes = [m for m in (args.modes or ",".join(takes)).split(",") if m]
    unknown = [m for m in args.modes if m not in takes]
    if unknown:
        p.error(f"--modes: {', '.join(unknown)} not for --drafter {args.drafter}; choose among {', '.join(takes)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
