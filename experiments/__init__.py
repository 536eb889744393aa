"""Experiments: the judge (default), generation, benchmarks, conversion, tiny-model training."""
