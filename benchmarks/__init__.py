"""The benchmarks: ``python -m benchmarks --help`` (benchmarks/__main__.py, benchmarks/README.md)."""
