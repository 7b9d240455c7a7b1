"""The ``spec_decode/*`` metrics of run-time k: what each engine's controller decided and what it got.

:class:`Tally` counts, inside the engine, what a report says of the steps since the last one;
:func:`control_metrics` turns the reports of one generate call into flat metrics.

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
    """``spec_decode/k_bucket_{lo}_{hi}``, ``…/predicted_tokens_per_s``, ``…/realised_tokens_per_s``, step
    shares and the fewest running requests; {} without reports."""
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
    # the share of the call's engine steps that verified drafts: 0 all through a call that bought nothing
    out["spec_decode/drafted_step_fraction"] = sum(r.get("draft_steps", 0) for r in reports) / steps if steps else 0.0
    fewest = [r["fewest_running"] for r in reports if "fewest_running" in r]
    if fewest:  # the fewest requests any engine's step ran with: where the batch never thinned to
        out["spec_decode/fewest_running_requests"] = float(min(fewest))
    out["spec_decode/explore_fraction"] = sum(r.get("explore_steps", 0) for r in reports) / decode if decode else 0.0
    out["spec_decode/catch_up_tokens"] = float(sum(r.get("catch_up_tokens", 0) for r in reports))
    return out


class Tally:
    """Realised and predicted tokens per second since the last report, over the same steps: those the
    controller predicted (every decode step once its cost model is ready), else every decode step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = self.explored = self.catch_up = 0
        self.all = [0.0, 0.0]  # emitted tokens, seconds: every decode step
        self.pred = [0.0, 0.0, 0.0, 0.0]  # predicted tokens, predicted seconds, emitted tokens, seconds

    def add(self, rec, predicted: tuple[float, float] | None, exploring: bool) -> None:
        self.catch_up += rec.catch_up
        if rec.period_s is None or rec.catch_up:
            return
        self.steps += 1
        self.explored += int(exploring)
        self.all[0] += rec.emitted
        self.all[1] += rec.period_s
        if predicted is not None:
            for i, v in enumerate((predicted[0], predicted[1], rec.emitted, rec.period_s)):
                self.pred[i] += v

    def report(self) -> dict:
        out = {"timed_steps": self.steps, "explore_steps": self.explored, "catch_up_tokens": self.catch_up}
        if self.pred[1] > 0 and self.pred[3] > 0:
            out["predicted_tokens_per_s"] = self.pred[0] / self.pred[1]
            out["realised_tokens_per_s"] = self.pred[2] / self.pred[3]
        elif self.all[1] > 0:
            out["realised_tokens_per_s"] = self.all[0] / self.all[1]
        return out
