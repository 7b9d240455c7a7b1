"""What a run reports: vLLM's spec-decode counters (their names, defined once) and the ``spec_decode/*``
metrics derived from them, the metrics logger (wandb, ``metrics.jsonl``, phase timers), and the console.

Importing this package imports none of vLLM, Ray or wandb.
"""

from rl_specdec.metrics.counters import (
    aggregate_spec_decode_counters,
    counters_from_histogram,
    counters_from_requests,
    counters_from_snapshot,
)
from rl_specdec.metrics.spec_decode import compute_spec_decode_metrics

__all__ = [
    "aggregate_spec_decode_counters",
    "compute_spec_decode_metrics",
    "counters_from_histogram",
    "counters_from_requests",
    "counters_from_snapshot",
]
