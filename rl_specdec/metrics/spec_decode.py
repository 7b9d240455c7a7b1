"""The ``spec_decode/*`` metrics, derived from vLLM's counters.

A generation step's counters (:mod:`rl_specdec.metrics.counters`) are
turned into:

* ``acceptance_rate`` = accepted / draft tokens, in [0, 1];
* ``acceptance_length`` = 1 + accepted / drafts: tokens emitted per target
  forward pass (the bonus token counts), in [1, k + 1];
* ``acceptance_rate_pos_{i}`` = accepted at position i / drafts: the chance
  that the first i drafted tokens were all accepted.

:func:`compute_spec_decode_metrics` takes either one step's counters
(``compute_spec_decode_metrics(None, delta)``) or two cumulative snapshots.
A counter that went backwards (an engine restarted between snapshots) gives a
delta of zero, so a step never reports negative work.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from rl_specdec.metrics.counters import ACCEPTED, DRAFT_TOKENS, DRAFTS, PER_POS, SCALARS


def _delta(end: float, start: float) -> float:
    d = float(end) - float(start)
    return d if d > 0 and math.isfinite(d) else 0.0


def compute_spec_decode_metrics(start: Mapping[str, Any] | None, end: Mapping[str, Any] | None) -> dict[str, float]:
    """``spec_decode/*`` metrics for the work between two counter dicts (``start=None``: ``end`` is a delta).

    Returns {} when ``end`` has no spec-decode counters (speculation off).
    Every value is finite.
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
