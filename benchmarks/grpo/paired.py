"""Paired GRPO: one training trajectory, and at every step every variant generates from the same weights and the
same prompts. What a speed-up of GRPO is measured with when chance must not decide it.

Two runs with different configs diverge after step 1, each training on its own samples, so their rollout
lengths and train phases differ by chance. Here one run trains (``--trained``, the first variant by default):
its engines' rollouts are the ones trained on. Every other variant is an engine group of its own config. It
takes every refit the run's engines take (the same buckets, verified), so at every step all variants hold the
trainer's weights, and it generates every rollout call of the step: the same prompts, the same sampling settings
and seeds, in an order that rotates by step. Validation runs on the trained run's engines alone.

The phases other than generation (rewards, the policy's update, its refit) are the trained run's, and shared. The
drafter's work is not: the trained variant's (its head's part of the update, measured apart on the same batch, its
drafter's wait and refit) is charged to it alone, and a variant whose drafter does not train pays none
(:mod:`benchmarks.grpo.paired_account`). A variant whose drafter would train online must be the trained one.
Each variant's first-use builds are reported once, apart from the steps. Per variant, against the baseline (the
first variant):

* the generation speed-up of each step (the baseline's seconds over the variant's) and of each seed (pooled:
  seconds summed over steps), with a 95% interval over the steps of all seeds (a t-interval on log ratios);
* the step speed-up with every variant's own costs in, the bound Amdahl's law sets on it from generation's share
  of the baseline's step and the variant's drafter work, and that work's seconds a step;
* generated tokens (lossless in distribution, not sample by sample: they differ by chance), acceptance length.

and, per step, the trained run's rollout lengths (median, p90, max): how much of each call is a long tail.

A multi-turn task's episodes reach the engines over HTTP, which no group call sees, so they are paired at the
rollout source instead (:class:`PairedSource`): every variant's own source plays the step's episodes (the same
episodes and seeds) on its own engines, each serving its config's server. Their counters cover every turn of the
step, and each turn's own counters (from the servers' responses) give the acceptance length per turn.

::

    python -m benchmarks paired --seeds 0,1 --steps 4      # the real model: none against configs/smollm2_spec.yaml
    python -m benchmarks paired --variants "none: configs/agent_base.yaml; spec: configs/agent_spec.yaml"

Writes ``paired.json`` (every step of every variant) and ``paired.md`` to ``--out`` (results/paired).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import bench_common
from benchmarks.bench_common import log
from benchmarks.grpo.paired_account import (
    LENGTHS,
    builds_line,
    drafter_seconds,
    lengths_line,
    step_rows,
    summarise,
    table,
)
from benchmarks.rollout.batch_sweep import KV, variants_or_exit

DEFAULT_VARIANTS = "none: configs/smollm2_base.yaml; shipped: configs/smollm2_spec.yaml"
# the trained run: no validation and no checkpoints (neither is timed), no pipelining (the steps must be whole)
# the trained run's figures each step's drafter work is taken from, kept in paired.json
PARTS = ("timing/train", "train/forward_backward_s", "drafter/optimizer_s", "timing/drafter_train")
PARTS += ("timing/drafter_wait", "timing/drafter_refit")
# an engine that dies stops the measurement: a replacement's start and refit would be charged to one variant
TRAINED = [
    "grpo.val_every=0",
    "checkpoint.enabled=false",
    "logger.wandb.enabled=false",
    "grpo.max_staleness=0",
    "policy.generation.engine_restart.enabled=false",
]


class PairedGeneration:
    """The trained run's engine group in its place, with the other variants' groups beside it: every refit goes
    to all of them, and every rollout call (temperature > 0) runs on all of them, timed; the trained group's
    output is the one returned. Anything else is the trained group's."""

    def __init__(self, trained_name: str, trained, others: dict):
        self.groups = {trained_name: trained, **others}
        self.trained_name, self.trained = trained_name, trained
        self.calls: list[dict[str, dict]] = []  # per rollout call: variant -> {s, tokens, counters}
        self.others_refit_s = 0.0  # seconds the other groups' refits took (not the trained run's work)

    def generate(self, prompt_token_ids, sampling):
        if sampling.temperature == 0:  # validation: the trained run's, untimed here
            return self.trained.generate(prompt_token_ids, sampling)
        # only the trained variant's drafter trains: no other group returns (and pays for) its top-k log-probs
        plain = dataclasses.replace(sampling, logprobs=0) if sampling.logprobs else sampling
        return time_each(
            self.calls,
            list(self.groups),
            self.trained_name,
            lambda name: self.groups[name].generate(prompt_token_ids, sampling if name == self.trained_name else plain),
        )

    def update_weights_buckets(self, buckets) -> None:
        buckets = list(buckets)  # every group reads them
        self.trained.update_weights_buckets(buckets)
        t0 = time.perf_counter()
        self.refit_others(buckets)
        self.others_refit_s += time.perf_counter() - t0

    def refit_others(self, buckets) -> None:
        """The other groups to the trainer's weights (the run's own engines took them at set-up)."""
        buckets = list(buckets)
        for name, g in self.groups.items():
            if name != self.trained_name:
                g.update_weights_buckets(buckets)

    def shutdown_others(self) -> None:
        for name, g in self.groups.items():
            if name != self.trained_name:
                g.shutdown()

    def __getattr__(self, name):
        return getattr(self.trained, name)


def time_each(calls: list[dict], names: list[str], trained_name: str, generate) -> Any:
    """``generate(name)`` for every variant, timed, in an order that rotates with the calls so far; the record
    (variant -> {s, tokens, counters, turn_counters}) appended to ``calls``; the trained variant's output returned."""
    from rl_specdec.rollout.serving.episodes import EpisodeOutput, per_turn_counters

    shift = len(calls) % len(names)
    record, out = {}, None
    for name in names[shift:] + names[:shift]:
        t0 = time.perf_counter()
        res = generate(name)
        record[name] = {
            "s": time.perf_counter() - t0,
            "tokens": sum(len(ids) for ids in res.token_ids),
            "counters": res.spec_counters,
            "turn_counters": per_turn_counters(res.episodes) if isinstance(res, EpisodeOutput) else [],
        }
        out = res if name == trained_name else out
    calls.append(record)
    return out


@dataclass
class VariantRun:
    """What a variant's own rollout source reads of a run: its engine group, the task, its config."""

    generation: Any
    task: Any
    cfg: Any
    tokenizer: Any = None


class PairedSource:
    """The trained run's rollout source in its place where the source drives the engines itself (episodes through
    the servers, which no group call sees): each step's request is generated by every variant's own source (the
    same episodes and seeds, each variant's engines), timed as :class:`PairedGeneration` times a call, and the
    trained source's output is the one returned. Anything else is the trained source's."""

    def __init__(self, trained_name: str, trained, others: dict, calls: list[dict]):
        self.sources = {trained_name: trained, **others}
        self.trained_name, self.trained, self.calls = trained_name, trained, calls

    def generate(self, request):
        return time_each(self.calls, list(self.sources), self.trained_name, lambda n: self.sources[n].generate(request))

    def __getattr__(self, name):
        return getattr(self.trained, name)


class HeadFreeTiming:
    """The trained run's policy group in its place: beside each update, the same batch's forwards and backwards
    run once more without the head (nothing steps), timed, so the head's part of the update is measured on the
    batch it learnt from. The extra pass runs before the update on even steps and after it on odd ones, so
    neither side is always the one that finds the allocator cold, and the first update is preceded by one more
    pass, not kept, so the first step's cold start lands in neither. Anything else is the policy's."""

    def __init__(self, policy):
        self.policy = policy
        self.forward_backward_s: float | None = None  # the last update's, without the head
        self.wall_s = 0.0  # seconds the extra passes took (the benchmark's work, in no variant's step)
        self.updates = 0

    def train_step(self, batch, loss_fn):
        first = self.updates % 2 == 0
        if self.updates == 0:
            self._apart(batch, loss_fn)  # warm-up: cold allocations and first-call dispatch, not the head's
        self.updates += 1
        if first:
            self._apart(batch, loss_fn)
        out = self.policy.train_step(batch, loss_fn)
        if not first:
            self._apart(batch, loss_fn)
        return out

    def _apart(self, batch, loss_fn) -> None:
        t0 = time.perf_counter()
        self.forward_backward_s = self.policy.forward_backward_time(batch, loss_fn)
        self.wall_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.policy, name)


def trains_head(cfg) -> bool:
    spec = cfg.policy.generation.speculation
    return spec is not None and spec.is_head and cfg.policy.generation.drafter_training.enabled


def checked_variants(p, variants, trained: str) -> None:
    """Refuse, before anything starts, a variant other than the trained one whose drafter trains online: its
    rollouts are not trained on, so its drafter's work would not be measured."""
    from rl_specdec.config import load_config

    for n, c, o in variants:
        if n != trained and load_config(c, o).policy.generation.drafter_training.enabled:
            p.error(
                f"variant {n!r} trains its drafter online, but only the trained variant's drafter work is measured:"
                f" pass --trained {n!r}, or freeze it with policy.generation.drafter_training.enabled=false"
            )


def first_use_builds(variants) -> dict[str, float | None]:
    """Every variant's models built now where they are not yet (so no step waits on a build), and the seconds
    each one's build took, by model name (None: built before build times were kept); models built together (a
    toy pair) share one entry, their names joined by " + "."""
    from rl_specdec.config import load_config
    from rl_specdec.toy.build import built_seconds, built_where
    from rl_specdec.toy.resolve import prepare_models

    by_build: dict[Path, list[str]] = {}
    for _, c, o in variants:
        cfg = load_config(c, o)
        ready = prepare_models(load_config(c, o), log=log)
        pairs = [(cfg.policy.model_name, ready.policy.model_name)]
        if cfg.policy.generation.speculation is not None and cfg.policy.generation.speculation.model:
            pairs.append((cfg.policy.generation.speculation.model, ready.policy.generation.speculation.model))
        for name, folder in pairs:
            if Path(folder).is_dir():
                names = by_build.setdefault(built_where(Path(folder)), [])
                names += [] if name in names else [name]
    return {" + ".join(names): built_seconds(root) for root, names in by_build.items()}


def run_seed(variants, trained: str, seed: int, steps: int, out: Path) -> list[dict]:
    """One trained run of ``steps`` steps with every other variant's engines beside it; the per-step rows."""
    from rl_specdec.config import load_config
    from rl_specdec.grpo.episodes import EpisodeSource
    from rl_specdec.grpo.run import engine_group, setup
    from rl_specdec.grpo.step import grpo_step
    from rl_specdec.grpo.stop import StopSignals
    from rl_specdec.rollout.placement import stop_ray
    from rl_specdec.tasks import is_episodic
    from rl_specdec.toy.resolve import prepare_models

    by_name = {n: (c, o) for n, c, o in variants}
    common = [f"seed={seed}", KV, f"cluster.num_cpus={4 * len(variants) + 2}"]
    config, overrides = by_name[trained]
    extra = [f"grpo.max_steps={steps}", f"logger.log_dir={out / f'seed{seed}'}"]
    cfg = load_config(config, overrides + common + TRAINED + extra)
    with StopSignals(cfg.checkpoint.grace_s, None) as stop:
        run = setup(cfg)
        run.stop, paired, walls, lengths, drafter, parts = stop, None, [], [], [], []
        try:
            others, configs = {}, {}
            for n, (c, o) in by_name.items():
                if n != trained:
                    log(f"seed {seed}: starting {n}: {c} {' '.join(o)}")
                    configs[n] = prepare_models(load_config(c, o + common))
                    others[n] = engine_group(configs[n])  # its seed is the trained run's (common)
            paired = run.generation = PairedGeneration(trained, run.generation, others)
            paired.refit_others(run.policy.state_dict_buckets())
            if is_episodic(run.task):  # episodes reach the engines over HTTP: paired at the source instead
                own = {n: EpisodeSource(VariantRun(g, run.task, configs[n], run.tokenizer)) for n, g in others.items()}
                run.source = PairedSource(trained, run.source, own, paired.calls)
            timing = HeadFreeTiming(run.policy) if trains_head(cfg) else None
            run.policy = timing or run.policy
            for step in range(steps):
                t0, extra0 = time.perf_counter(), paired.others_refit_s + (timing.wall_s if timing else 0.0)
                row = grpo_step(run, step)
                extra = paired.others_refit_s + (timing.wall_s if timing else 0.0) - extra0
                walls.append(time.perf_counter() - t0 - extra)
                drafter.append(drafter_seconds(row, timing.forward_backward_s if timing else None))
                lengths.append([row.get(f"generation/response_length_{q}", float("nan")) for q in LENGTHS])
                parts.append({k: row[k] for k in PARTS if k in row})
                parts[-1]["head_free_forward_backward_s"] = timing.forward_backward_s if timing else None
                log(
                    f"seed {seed} step {step + 1}: "
                    + ", ".join(f"{n} {v['s']:.1f} s" for n, v in paired.calls[-1].items())
                    + f"; train {row.get('timing/train', 0):.1f} s, drafter {drafter[-1]:.1f} s; lengths "
                    + "/".join(f"{v:.0f}" for v in lengths[-1])
                )
        finally:
            if paired is not None:
                paired.shutdown_others()
                run.generation = paired.trained
            if isinstance(run.source, PairedSource):
                run.source = run.source.trained
            if isinstance(run.policy, HeadFreeTiming):
                run.policy = run.policy.policy
            run.shutdown()
            stop_ray()
    rows = step_rows(paired.calls, walls, drafter, trained)
    for r, lens, part in zip(rows, lengths, parts):
        r["lengths"], r["trained_parts"] = lens, part
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="name: config [key=value ...]; ... (first: baseline)")
    p.add_argument("--trained", default=None, help="the variant whose rollouts are trained on (default: the first)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=4)
    bench_common.add_out(p, "paired", "paired.json and .md")
    args = p.parse_args(argv)
    variants = variants_or_exit(p, args.variants)
    names = [v[0] for v in variants]
    trained = args.trained or names[0]
    if trained not in names:
        p.error(f"--trained {trained!r} is not one of the variants ({', '.join(names)})")
    checked_variants(p, variants, trained)
    head = bench_common.header()
    print(f"# paired GRPO: {head}", flush=True)
    builds = first_use_builds(variants)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for s in (int(x) for x in args.seeds.split(",")):
        rows[s] = run_seed(variants, trained, s, args.steps, out)
        # every finished seed's rows on disk before anything is derived from them: a failure later loses nothing
        (out / "paired_rows.json").write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=1))
    summary = summarise(rows, names)
    result = {
        "machine": head,
        "command": "python -m benchmarks paired " + " ".join(sys.argv[1:]),
        "trained": trained,
        "variants": [{"name": n, "config": c, "overrides": o} for n, c, o in variants],
        "first_use_builds_s": builds,
        "steps": {str(s): r for s, r in rows.items()},
        "summary": summary,
    }
    (out / "paired.json").write_text(json.dumps(result, indent=1))
    with bench_common.markdown_report(out, "paired.md", "Paired GRPO", head):
        print(
            f"trained on {trained}'s rollouts; every variant generates each step's rollouts from the same weights;"
            " a step is the shared phases, the variant's generation and its own drafter work"
        )
        print(table(summary, names[0]))
        print(f"\n{lengths_line(rows)}")
        print(f"\n{builds_line(builds, head.split(':')[0])}")
    print(f"written to {out / 'paired.json'} and {out / 'paired.md'}")


if __name__ == "__main__":
    main()
