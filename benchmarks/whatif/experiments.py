"""Run every policy on every device and pair: one generation phase each, the same rollout lengths for all."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.whatif import costmodel as C
from benchmarks.whatif import policies as P
from benchmarks.whatif.hardware import Device
from benchmarks.whatif.simulate import simulate_feedback, simulate_static
from benchmarks.whatif.workload import Pair, Workload


@dataclass
class Cell:
    """One policy's generation phase on one device and pair, with the step's train phase beside it."""

    gen: float  # seconds
    train: float  # seconds
    steps: int
    tokens: int
    k_steps: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def step(self) -> float:
        return self.gen + self.train


@dataclass
class Setup:
    batch: int = 128  # sequences per engine in one GRPO step
    prompt_len: int = 256
    k_max: int = 5  # the controller's and DAS's largest k
    av_k: int = 3  # adaptive verification's drafts per request
    warmup_phases: int = 2  # phases the controller runs before the measured ones (its first call warms it up)
    measured_phases: int = 2  # the controller's figure: the mean of this many phases on the measured workload
    noise: float = 0.03  # lognormal sigma of a step's measured time
    seed: int = 0
    controller_config: dict = field(default_factory=dict)


def static_phases(pair: Pair, wl: Workload, setup: Setup) -> dict:
    """{policy name: Phase} for the static policies (device-independent)."""
    out = {}
    for i, pol in enumerate(P.gpu_policies()):
        if isinstance(pol, P.DAS):
            pol.k_max = setup.k_max
        out[pol.name] = simulate_static(pair, wl, pol, np.random.default_rng([setup.seed, 1, i]))
    return out


def controller_phase(pair: Pair, wl: Workload, pricer, setup: Setup, warmups: list[Workload]):
    """The controller after ``warmups`` (its state carries over, as across GRPO steps), then ``measured_phases``
    phases on the measured workload: (name, the mean phase as a Phase, each phase's time)."""
    pol = P.ControllerPolicy(setup.k_max, max(256, len(wl.lengths)), setup.seed, **setup.controller_config)
    for w, wlw in enumerate(warmups):
        simulate_feedback(pair, wlw, pol, pricer, np.random.default_rng([setup.seed, 2, w]), setup.noise)
    phases = [
        simulate_feedback(pair, wl, pol, pricer, np.random.default_rng([setup.seed, 3, i]), setup.noise)
        for i in range(setup.measured_phases)
    ]
    last = phases[-1]
    last.time = float(np.mean([ph.time for ph in phases]))
    last.extra["phase_times"] = [ph.time for ph in phases]
    return pol.name, last


def run_pair(
    pair: Pair, wl: Workload, devices: list[Device], setup: Setup, warmups: list[Workload], feedback: bool = True
) -> dict:
    """{device name: {policy name: Cell}} for one pair."""
    statics = static_phases(pair, wl, setup)
    out = {}
    for dev in devices:
        tp = C.choose_tp(dev, pair, wl)
        pricer = C.Pricer(dev, pair, tp)
        train = C.train_time(dev, pair, wl, tp)
        cells = {}
        for name, ph in statics.items():
            cells[name] = Cell(float(pricer.rows(ph.rows).sum()), train, ph.steps, ph.tokens, ph.k_steps)
        if feedback and not dev.anchor_only:
            av = P.AdaptiveVerification(setup.av_k)
            ph = simulate_feedback(pair, wl, av, pricer, np.random.default_rng([setup.seed, 4]), setup.noise)
            cells[av.name] = Cell(ph.time, train, ph.steps, ph.tokens, ph.k_steps, ph.extra)
            name, ph = controller_phase(pair, wl, pricer, setup, warmups)
            cells[name] = Cell(ph.time, train, ph.steps, ph.tokens, ph.k_steps, ph.extra)
        head = C.head_train_time(dev, pair, wl, tp)
        out[dev.name] = {"tp": tp, "cells": cells, "memory": C.memory_needed(dev, pair, wl), "head_train": head}
    return out


def run_all(pairs: list[Pair], devices: list[Device], setup: Setup, lengths, warmup_lengths, log=print) -> dict:
    """{pair key: {device name: {...}}}; ``lengths``: the measured phase's, ``warmup_lengths``: the controller's
    warm-up phases'."""
    wl = Workload(np.asarray(lengths), setup.prompt_len)
    warm = [Workload(np.asarray(x), setup.prompt_len) for x in warmup_lengths]
    out = {}
    for pair in pairs:
        t0 = time.perf_counter()
        out[pair.key] = run_pair(pair, wl, devices, setup, warm)
        log(f"  simulated {pair.key} on {len(devices)} devices in {time.perf_counter() - t0:.1f} s")
    return out


def speedups(dev_result: dict) -> dict:
    """{policy: (generation speed-up, step speed-up)} against ``none`` on the same device and pair."""
    base = dev_result["cells"]["none"]
    return {n: (base.gen / c.gen, base.step / c.step) for n, c in dev_result["cells"].items()}


def batch_sensitivity(pairs: list[Pair], devices: list[Device], setup: Setup, dist, batches=(32, 128, 512)) -> dict:
    """{(pair, device, batch): {policy: generation speed-up}} for no speculation and fixed k only: how the
    per-engine batch (the main unknown of a user's setup) moves the answer."""
    out = {}
    pols = [P.NoSpec()] + [P.Fixed(k) for k in range(1, 7)]
    for pair in pairs:
        for B in batches:
            wl = Workload(dist.sample(B, np.random.default_rng([setup.seed, 0])), setup.prompt_len)
            phases = {
                p.name: simulate_static(pair, wl, p, np.random.default_rng([setup.seed, 5, i]))
                for i, p in enumerate(pols)
            }
            for dev in devices:
                pricer = C.Pricer(dev, pair, C.choose_tp(dev, pair, wl))
                t = {n: float(pricer.rows(ph.rows).sum()) for n, ph in phases.items()}
                out[(pair.key, dev.name, B)] = {n: t["none"] / v for n, v in t.items()}
    return out
