"""python -m benchmarks exactness: every sampled token's log-prob against the trainer's while k changes."""
