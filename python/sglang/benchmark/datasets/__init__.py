"""Benchmark datasets. Only synthetic ones ship: nothing is ever downloaded."""
from sglang.benchmark.datasets.random import (
    DatasetRow,
    compute_random_lens,
    sample_random_ids_requests,
    sample_random_text_requests,
)

DATASET_NAMES = ("random", "random-ids")


def get_dataset(
    name: str,
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
):
    """Build the request list of dataset ``name`` (``random`` or ``random-ids``)."""
    if name == "random":
        return sample_random_text_requests(tokenizer, num_prompts, input_len, output_len,
                                           range_ratio)
    if name == "random-ids":
        return sample_random_ids_requests(tokenizer, num_prompts, input_len, output_len,
                                          range_ratio)
    raise ValueError(
        f"dataset {name!r} is not available: this build ships only {', '.join(DATASET_NAMES)} "
        "(they need no download)"
    )


__all__ = [
    "DATASET_NAMES",
    "DatasetRow",
    "compute_random_lens",
    "get_dataset",
    "sample_random_ids_requests",
    "sample_random_text_requests",
]
