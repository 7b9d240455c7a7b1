"""The ``spec_decode/*`` metrics of run-time k: what each engine's controller decided and what it got.

Each engine reports, per generate call (``GenerationOutput.spec_control``, see
``rl_specdec.rollout.runtime_k.control``): the k it runs for each batch-size
bucket, its predicted and realised emitted tokens per second over the call's
decode steps, and how many steps were plain (the k=0 fast path), explored or
caught the drafter up. :func:`control_metrics` turns a call's reports into
flat metrics: per-bucket k averaged over engines, rates summed over engines
(they run side by side), counts summed.
"""

from __future__ import annotations

from typing import Any, Iterable


def control_metrics(reports: Iterable[dict[str, Any]]) -> dict[str, float]:
    """``spec_decode/k_bucket_{lo}_{hi}``, ``…/predicted_tokens_per_s``, ``…/realised_tokens_per_s``, and step shares; {} without reports."""
    reports = [r for r in reports or [] if r]
    if not reports:
        return {}
    out: dict[str, float] = {}
    for lo, hi, _ in reports[0]["buckets"]:
        ks = [k for r in reports for l2, h2, k in r["buckets"] if (l2, h2) == (lo, hi)]
        out[f"spec_decode/k_bucket_{lo}_{hi}"] = sum(ks) / len(ks)
    for key in ("predicted_tokens_per_s", "realised_tokens_per_s"):
        if all(key in r for r in reports):
            out[f"spec_decode/{key}"] = float(sum(r[key] for r in reports))
    steps = sum(r.get("steps", 0) for r in reports)
    decode = sum(r.get("timed_steps", 0) for r in reports)
    out["spec_decode/plain_step_fraction"] = sum(r.get("plain_steps", 0) for r in reports) / steps if steps else 0.0
    out["spec_decode/explore_fraction"] = sum(r.get("explore_steps", 0) for r in reports) / decode if decode else 0.0
    out["spec_decode/catch_up_tokens"] = float(sum(r.get("catch_up_tokens", 0) for r in reports))
    return out
