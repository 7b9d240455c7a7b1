"""Speculative-decoding metrics from vLLM's cumulative counters.

vLLM counts, over an engine's whole life:

* ``vllm:spec_decode_num_drafts``: speculation rounds (one per request per step);
* ``vllm:spec_decode_num_draft_tokens``: tokens proposed by the drafter;
* ``vllm:spec_decode_num_accepted_tokens``: proposed tokens the target accepted;
* ``vllm:spec_decode_num_accepted_tokens_per_pos``: accepted tokens by draft
  position (position 1 is the first token after the last verified one).

A GRPO step reads the counters of every engine before and after generation,
sums each snapshot across engines (:func:`aggregate_spec_decode_counters`) and
takes the difference (:func:`compute_spec_decode_metrics`). Derived values:

* ``acceptance_rate`` = accepted / draft tokens, in [0, 1];
* ``acceptance_length`` = 1 + accepted / drafts: tokens emitted per target
  forward pass (the bonus token counts), in [1, k + 1];
* ``acceptance_rate_pos_{i}`` = accepted at position i / drafts: the chance
  that the first i drafted tokens were all accepted.

An engine that restarted between two snapshots has smaller counters than
before; deltas are clamped at zero so a step never reports negative work.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SCALARS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)


def aggregate_spec_decode_counters(worker_metrics: Iterable[Mapping[str, Any]] | None) -> dict[str, Any]:
    """Sum each engine's counters. Engines without speculation ({} or None) add nothing.

    Returns {} when no engine reports spec-decode counters.
    """
    total: dict[str, Any] = {}
    for m in worker_metrics or []:
        if not m:
            continue
        for key in SCALARS:
            if key in m:
                total[key] = total.get(key, 0.0) + float(m[key])
        if PER_POS in m:
            vals = [float(v) for v in m[PER_POS]]
            prev = total.get(PER_POS, [])
            n = max(len(prev), len(vals))
            prev = prev + [0.0] * (n - len(prev))
            vals = vals + [0.0] * (n - len(vals))
            total[PER_POS] = [a + b for a, b in zip(prev, vals)]
    return total


def _delta(end: float, start: float) -> float:
    d = float(end) - float(start)
    return d if d > 0 and math.isfinite(d) else 0.0


def compute_spec_decode_metrics(start: Mapping[str, Any] | None, end: Mapping[str, Any] | None) -> dict[str, float]:
    """``spec_decode/*`` metrics for the work done between two aggregated snapshots.

    Returns {} when ``end`` has no spec-decode counters (speculation off or a
    backend without ``get_metrics``). Every value is finite.
    """
    if not end or not any(k in end for k in SCALARS):
        return {}
    start = start or {}
    drafts = _delta(end.get(DRAFTS, 0.0), start.get(DRAFTS, 0.0))
    draft_tokens = _delta(end.get(DRAFT_TOKENS, 0.0), start.get(DRAFT_TOKENS, 0.0))
    accepted = _delta(end.get(ACCEPTED, 0.0), start.get(ACCEPTED, 0.0))
    out = {
        "spec_decode/num_drafts": drafts,
        "spec_decode/num_draft_tokens": draft_tokens,
        "spec_decode/num_accepted_tokens": accepted,
        "spec_decode/acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else 0.0,
        "spec_decode/acceptance_length": 1.0 + (accepted / drafts if drafts > 0 else 0.0),
    }
    end_pos = list(end.get(PER_POS, []))
    start_pos = list(start.get(PER_POS, []))
    start_pos += [0.0] * (len(end_pos) - len(start_pos))
    for i, (e, s) in enumerate(zip(end_pos, start_pos), start=1):
        acc_i = _delta(e, s)
        out[f"spec_decode/num_accepted_tokens_pos_{i}"] = acc_i
        out[f"spec_decode/acceptance_rate_pos_{i}"] = acc_i / drafts if drafts > 0 else 0.0
    return out


def read_spec_counters(generation: Any) -> dict[str, Any]:
    """Aggregated counters of a backend, or {} if it cannot report them.

    A backend without ``get_metrics`` never breaks a training step.
    """
    get = getattr(generation, "get_metrics", None)
    if not callable(get):
        return {}
    return aggregate_spec_decode_counters(get())
