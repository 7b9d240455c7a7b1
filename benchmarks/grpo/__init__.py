"""python -m benchmarks grpo, staleness and peer: a GRPO step with and without speculation, variants side by side."""
