"""``python -m sglang.bench_serving`` (SGLang's name): runs :mod:`sglang.benchmark.serving`."""
import sys

from sglang.benchmark.serving import build_parser, main, run_benchmark

__all__ = ["build_parser", "main", "run_benchmark"]

if __name__ == "__main__":
    sys.exit(main())
