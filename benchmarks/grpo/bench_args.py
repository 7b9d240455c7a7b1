"""bench.py's arguments, checked (each bad one named with what it may be), and the invocation they make."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import bench_common
from benchmarks.grpo.bench_variants import (
    COMMON,
    GRPO_VARIANTS,
    OVERLAP_VARIANTS,
    QUICK_VARIANTS,
    REPO,
    lockstep_memory_problem,
)
from benchmarks.rollout import rollout

SECTIONS = ("rollout", "grpo", "staleness", "peer")
QUICK_SECTIONS = ("rollout", "grpo")  # --quick: staleness and peer only when asked for (--sections)
DEFAULT_CONFIG = "configs/grpo_spec.yaml"  # the shipped default: its grpo.max_steps is the default --steps
QUICK_STEPS = 4


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


def default_steps() -> int:
    """The shipped default's own length: ``grpo.max_steps`` of configs/grpo_spec.yaml."""
    from rl_specdec.config import load_config

    return load_config(REPO / DEFAULT_CONFIG).grpo.max_steps


def parser(description: str, section: str | None = None) -> argparse.ArgumentParser:
    """bench.py's options; ``section``: one section's command (``python -m benchmarks grpo``), without
    --sections and with its own results folder."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"small: the shipped default ({DEFAULT_CONFIG}, {' against '.join(reversed(QUICK_VARIANTS))}) for "
        f"{QUICK_STEPS} steps in lockstep" + ("" if section else ", and the rollout section small"),
    )
    if section:
        bench_common.add_out(p, section, "report.md, bench.json, *.png, runs/")
    else:
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
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"GRPO steps per variant (default: {DEFAULT_CONFIG}'s grpo.max_steps; --quick {QUICK_STEPS})",
    )
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
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a seed's GRPO variants together, taking turns step by step, so that the machine's drift "
        "falls on each alike (benchmarks/grpo/lockstep.py; not for max_staleness=1 variants; default: on with --quick)",
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
    p.add_argument(
        "--drafter",
        choices=("draft_model", "eagle3"),
        default="draft_model",
        help="the staleness section's drafter: the toy draft model, or an EAGLE-3 head (toy:eagle3)",
    )
    p.add_argument("--peer-steps", type=int, default=None, help=f"TRL steps (default: --steps; --quick {QUICK_STEPS})")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every GRPO run, before each variant's own (repeatable), e.g. policy.precision=fp32",
    )
    return p


def parse(argv, description: str, section: str | None = None) -> Bench:
    """The arguments, checked: each bad one is named with what it may be."""
    p = parser(description, section)
    args = p.parse_args(argv)
    COMMON.extend(args.set)
    if section:
        sections = [section]
    else:
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
    if args.lockstep is None:  # --quick's pair is small: lockstep costs it nothing and evens out the drift
        args.lockstep = bool(args.quick and not OVERLAP_VARIANTS & set(names) and not lockstep_memory_problem(names))
    if args.lockstep and (bad := OVERLAP_VARIANTS & set(names)):
        p.error(f"--lockstep: {', '.join(sorted(bad))} generate beside training, outside the baton; run without it")
    if args.lockstep and (why := lockstep_memory_problem(names)):
        p.error(why)
    head_only = sections == ["staleness"] and args.drafter == "eagle3"  # the head's cost is the wide grpo's
    if ("peer" in sections or "staleness" in sections) and "grpo" not in sections and not head_only:
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
    steps = args.steps or (QUICK_STEPS if args.quick else default_steps())
    return Bench(args, sections, names, steps, seeds, Path(args.out))
