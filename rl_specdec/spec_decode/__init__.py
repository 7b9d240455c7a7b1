"""Speculative-decoding counters and the metrics derived from them."""

from rl_specdec.spec_decode.metrics import (
    aggregate_spec_decode_counters,
    compute_spec_decode_metrics,
    read_spec_counters,
)

__all__ = ["aggregate_spec_decode_counters", "compute_spec_decode_metrics", "read_spec_counters"]
