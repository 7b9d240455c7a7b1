"""vLLM's speculative-decoding counters: their names, defined once, and how to read them.

vLLM counts, per engine:

* ``vllm:spec_decode_num_drafts``: speculation rounds (one per request per step with drafts);
* ``vllm:spec_decode_num_draft_tokens``: tokens proposed by the drafter;
* ``vllm:spec_decode_num_accepted_tokens``: proposed tokens the target accepted;
* ``vllm:spec_decode_num_accepted_tokens_per_pos``: accepted tokens by draft
  position (position 1 is the first token after the last verified one).

A counter dict here always uses these names. It comes from one of two sources:

* :func:`counters_from_requests`: the per-request histograms vLLM attaches to
  each finished output (engine argument ``per_request_spec_decode_metrics``).
  Summed over one ``generate`` call's requests, they are exactly that call's
  work, whatever else the engine served meanwhile (HTTP traffic included);
* :func:`counters_from_snapshot`: an engine's cumulative Prometheus counters
  (``LLM.get_metrics()``), for tools that want totals over the engine's life.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SCALARS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)
NAMES = SCALARS + (PER_POS,)


def _add_per_pos(a: list[float], b: Iterable[float]) -> list[float]:
    b = [float(v) for v in b]
    n = max(len(a), len(b))
    a = list(a) + [0.0] * (n - len(a))
    b = b + [0.0] * (n - len(b))
    return [x + y for x, y in zip(a, b)]


def aggregate_spec_decode_counters(counters: Iterable[Mapping[str, Any] | None] | None) -> dict[str, Any]:
    """Sum counter dicts (engines, requests). Empty ones ({} or None) add nothing.

    Returns {} when none of them has spec-decode counters.
    """
    total: dict[str, Any] = {}
    for m in counters or []:
        if not m:
            continue
        for key in SCALARS:
            if key in m:
                total[key] = total.get(key, 0.0) + float(m[key])
        if PER_POS in m:
            total[PER_POS] = _add_per_pos(total.get(PER_POS, []), m[PER_POS])
    return total


def counters_delta(start: Mapping[str, Any] | None, end: Mapping[str, Any] | None) -> dict[str, Any]:
    """The work between two cumulative counter dicts, as one counter dict; a counter that went backwards (an
    engine replaced between them) counts zero. {} when ``end`` has no spec-decode counters."""
    start, out = start or {}, {}
    for key in SCALARS:
        if key in (end or {}):
            out[key] = max(0.0, float(end[key]) - float(start.get(key, 0.0)))
    if PER_POS in (end or {}):
        before = list(start.get(PER_POS, [])) + [0.0] * len(end[PER_POS])
        out[PER_POS] = [max(0.0, float(e) - float(b)) for e, b in zip(end[PER_POS], before)]
    return out


def counters_from_histogram(histogram: list[int], num_draft_tokens: int) -> dict[str, Any]:
    """One request's counters from vLLM's per-request acceptance histogram.

    ``histogram[j]`` is the number of verify steps in which exactly ``j`` drafted
    tokens were accepted, so position ``i`` was accepted in every step with
    ``j >= i``.
    """
    return {
        DRAFTS: float(sum(histogram)),
        DRAFT_TOKENS: float(num_draft_tokens),
        ACCEPTED: float(sum(j * c for j, c in enumerate(histogram))),
        PER_POS: [float(sum(histogram[i:])) for i in range(1, len(histogram))],
    }


def counters_from_requests(request_metrics: Iterable[Any]) -> dict[str, Any]:
    """Summed counters of vLLM ``RequestSpecDecodeMetrics`` objects (None entries are skipped)."""
    return aggregate_spec_decode_counters(
        counters_from_histogram(list(m.histogram), int(m.num_draft_tokens)) for m in request_metrics if m is not None
    )


def counters_from_snapshot(metrics: Iterable[Any]) -> dict[str, Any]:
    """The spec-decode counters of a vLLM metrics snapshot (``LLM.get_metrics()``)."""
    out: dict[str, Any] = {}
    for m in metrics:
        if m.name in SCALARS:
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
        elif m.name == PER_POS:
            out[m.name] = _add_per_pos(out.get(m.name, []), m.values)
    return out
