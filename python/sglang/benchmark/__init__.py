"""Serving benchmarks; ``python -m sglang.bench_serving`` runs :mod:`sglang.benchmark.serving`."""
