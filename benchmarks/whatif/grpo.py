"""The generation phase of real GRPO steps (a run's metrics.jsonl), predicted with the calibrated CPU constants."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.whatif import policies as P
from benchmarks.whatif.calibrate import (
    CALL_OVERHEAD_PER_REQUEST_S,
    CALL_OVERHEAD_S,
    TOLERANCE,
    device_of,
    with_acceptance,
)
from benchmarks.whatif.costmodel import Pricer
from benchmarks.whatif.report import table
from benchmarks.whatif.simulate import simulate_feedback, simulate_static
from benchmarks.whatif.workload import Pair, Workload, lengths_from_row


def parse_policy(spec: str):
    """``none``, ``fixed:K``, ``schedule:[[lo,hi,k],...]`` or ``controller:K_MAX``: what the run ran."""
    kind, _, arg = spec.partition(":")
    if kind == "none":
        return P.NoSpec()
    if kind == "fixed":
        return P.Fixed(int(arg))
    if kind == "schedule":
        return P.Schedule(json.loads(arg), name=f"schedule {arg}")
    if kind == "controller":
        return P.ControllerPolicy(int(arg or 4))
    raise ValueError(f"--policy {spec!r}: none | fixed:K | schedule:JSON | controller:K_MAX")


def phase_time(pair: Pair, wl: Workload, policy, dev, rng) -> float:
    pricer = Pricer(dev, pair, 1)
    if policy.static:
        t = float(pricer.rows(simulate_static(pair, wl, policy, rng).rows).sum())
    else:
        t = simulate_feedback(pair, wl, policy, pricer, rng).time
    return t + CALL_OVERHEAD_S + CALL_OVERHEAD_PER_REQUEST_S * len(wl.lengths)


def grpo_errors(
    rows: list[dict],
    theta,
    pair: Pair,
    policy_spec: str,
    k: int,
    engines: int = 1,
    prompt_len: int = 10,
    dtype: str = "float32",
    seed: int = 0,
    max_seqs: int | None = 256,
) -> tuple[list[list], np.ndarray, str]:
    """(one table row per training row, the relative errors, the policy's name): measured against predicted
    generation time. The lengths are rebuilt from the row's mean, median, max and total; the acceptance from
    its acceptance length at ``k`` (flat alpha); at most ``max_seqs`` run at once (vLLM 0.32's CPU default for
    ``LLM``: 256); one controller, if any, is carried over the rows as in the run."""
    dev = device_of(theta, dtype)
    policy = parse_policy(policy_spec)
    out, errs = [], []
    for i, row in enumerate(rows):
        wl = Workload(lengths_from_row(row, engines), prompt_len, max_seqs)
        p = with_acceptance(pair, row.get("spec_decode/acceptance_length"), k if policy.spec else 0)
        t = phase_time(p, wl, policy, dev, np.random.default_rng([seed, i]))
        meas = float(row["timing/generation"])
        errs.append(t / meas - 1)
        miss = "MISS" if abs(errs[-1]) > TOLERANCE else ""
        out.append([row.get("step", i + 1), len(wl.lengths), wl.tokens, f"{meas:.3f}", f"{t:.3f}"])
        out[-1] += [f"{errs[-1] * 100:+.1f}%", miss]
    return out, np.array(errs), policy.name


def predict_grpo(rows: list[dict], theta, pair: Pair, policy_spec: str, k: int, *args, **kw) -> str:
    """A table of measured against predicted generation time per training row, and a summary
    (:func:`grpo_errors`)."""
    out, e, name = grpo_errors(rows, theta, pair, policy_spec, k, *args, **kw)
    body = table(["step", "rollouts/engine", "tokens/engine", "measured s", "predicted s", "error", ""], out)
    summary = (
        f"\n{int(np.sum(np.abs(e) <= TOLERANCE))} of {len(e)} steps within {TOLERANCE:.0%}; median error "
        f"{np.median(e) * 100:+.1f}%, median |error| {np.median(np.abs(e)) * 100:.1f}% ({name}, {pair.key})"
    )
    return body + summary
