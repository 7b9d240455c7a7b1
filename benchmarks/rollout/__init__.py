"""python -m benchmarks rollout and cost-table: generation throughput per method and k, and an engine step's cost."""
