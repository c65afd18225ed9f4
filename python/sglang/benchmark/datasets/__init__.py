"""Benchmark datasets: ``sharegpt`` (a local file), ``random``, ``random-ids``. This build never
downloads anything: a dataset that needs a file takes it from ``--dataset-path``."""
from typing import List, Optional

from sglang.benchmark.datasets.common import DatasetRow, compute_random_lens
from sglang.benchmark.datasets.random import (
    sample_random_ids_requests,
    sample_random_requests,
    sample_random_text_requests,
)
from sglang.benchmark.datasets.sharegpt import load_sharegpt_pairs, sample_sharegpt_requests

DATASET_NAMES = ("sharegpt", "random", "random-ids")


def get_dataset(
    name: str,
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    dataset_path: Optional[str] = None,
    sharegpt_output_len: Optional[int] = None,
    sharegpt_context_len: Optional[int] = None,
) -> List[DatasetRow]:
    """Build the request list of dataset ``name`` (one of :data:`DATASET_NAMES`).

    ``input_len`` / ``output_len`` / ``range_ratio`` are the ``--random-*`` flags (``random``,
    ``random-ids``); ``dataset_path`` is the ShareGPT file (``sharegpt``, and ``random``'s
    prompt source); ``sharegpt_*`` are ``--sharegpt-output-len`` / ``--sharegpt-context-len``.
    """
    if name == "sharegpt":
        return sample_sharegpt_requests(dataset_path, num_prompts, tokenizer,
                                        sharegpt_output_len, sharegpt_context_len)
    if name == "random":
        return sample_random_requests(tokenizer, num_prompts, input_len, output_len,
                                      range_ratio, dataset_path)
    if name == "random-ids":
        return sample_random_ids_requests(tokenizer, num_prompts, input_len, output_len,
                                          range_ratio)
    raise ValueError(
        f"dataset {name!r} is not available: this build ships {', '.join(DATASET_NAMES)} "
        "(nothing is downloaded)"
    )


__all__ = [
    "DATASET_NAMES",
    "DatasetRow",
    "compute_random_lens",
    "get_dataset",
    "load_sharegpt_pairs",
    "sample_random_ids_requests",
    "sample_random_requests",
    "sample_random_text_requests",
    "sample_sharegpt_requests",
]
