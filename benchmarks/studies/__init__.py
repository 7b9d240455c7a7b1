"""The one-off studies behind docs' experiments, each run as python -m benchmarks.studies.<name>."""
