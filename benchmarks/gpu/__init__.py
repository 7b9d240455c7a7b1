"""python -m benchmarks gpu-whatif, gpu-torch and gpu-head: speculation on a GPU, predicted and measured."""
