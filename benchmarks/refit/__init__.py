"""python -m benchmarks refit: the cost of handing the weights to the engines, whole or bucketed."""
