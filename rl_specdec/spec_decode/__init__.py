"""Speculative-decoding counters (vLLM's names, defined once), the metrics derived from them, and run-time k's."""

from rl_specdec.spec_decode.counters import (
    aggregate_spec_decode_counters,
    counters_from_histogram,
    counters_from_requests,
    counters_from_snapshot,
)
from rl_specdec.spec_decode.control import control_metrics
from rl_specdec.spec_decode.metrics import compute_spec_decode_metrics

__all__ = [
    "aggregate_spec_decode_counters",
    "compute_spec_decode_metrics",
    "control_metrics",
    "counters_from_histogram",
    "counters_from_requests",
    "counters_from_snapshot",
]
