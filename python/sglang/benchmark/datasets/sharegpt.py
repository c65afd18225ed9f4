"""The ``sharegpt`` dataset (upstream SGLang's sampling) from a local ShareGPT JSON file.

The file is a list of conversations, each ``{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`` (``"conversation"`` is accepted as the key too, as
upstream). Upstream downloads the file when no path is given; this build never downloads, so a
missing or unreadable path is an error.
"""
from __future__ import annotations

import json
import os
import random
from typing import List, Optional, Tuple

from sglang.benchmark.datasets.common import DatasetRow


def load_sharegpt_pairs(dataset_path: Optional[str], dataset_name: str) -> List[Tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns, in file order.

    ``dataset_name`` only words the error raised when ``dataset_path`` is missing or not a
    readable ShareGPT JSON list.
    """
    if not dataset_path:
        raise ValueError(
            f"--dataset-name {dataset_name} needs --dataset-path to a local ShareGPT JSON file "
            "(this build never downloads)")
    if not os.path.isfile(dataset_path):
        raise ValueError(f"--dataset-path {dataset_path!r} is not a file")
    try:
        with open(dataset_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {dataset_path!r} is not readable JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {dataset_path!r}: expected a JSON list of conversations")
    pairs: List[Tuple[str, str]] = []
    for item in data:
        turns = item.get("conversations", item.get("conversation", [])) if isinstance(
            item, dict) else []
        # Upstream keeps only the first two turns, whoever speaks them (in ShareGPT the first
        # is the human's and the second the model's reply).
        if len(turns) >= 2:
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    if not pairs:
        raise ValueError(f"--dataset-path {dataset_path!r} has no conversation with two turns")
    return pairs


def sample_sharegpt_requests(
    dataset_path: Optional[str],
    num_requests: int,
    tokenizer,
    fixed_output_len: Optional[int] = None,
    context_len: Optional[int] = None,
) -> List[DatasetRow]:
    """Upstream's ShareGPT sampling: shuffle the (prompt, reply) pairs with Python's ``random``
    (seeded by ``--seed``), take them in order, and keep a pair unless the prompt or the output
    has fewer than 2 tokens or, with ``context_len``, prompt + output exceed it.

    The output length is the reply's token count, or ``fixed_output_len``
    (``--sharegpt-output-len``) when given. Returns at most ``num_requests`` rows (fewer when the
    file runs out, as upstream).
    """
    if fixed_output_len is not None and fixed_output_len < 4:
        raise ValueError(f"--sharegpt-output-len must be >= 4, got {fixed_output_len}")
    pairs = load_sharegpt_pairs(dataset_path, "sharegpt")
    random.shuffle(pairs)
    rows: List[DatasetRow] = []
    for prompt, completion in pairs:
        if len(rows) == num_requests:
            break
        # Counted with the tokenizer's special tokens, as the server will see the prompt.
        prompt_len = len(tokenizer.encode(prompt))
        if fixed_output_len is None:
            output_len = len(tokenizer.encode(completion))
        else:
            output_len = fixed_output_len
        if prompt_len < 2 or output_len < 2:
            continue  # too short to time anything
        if context_len and prompt_len + output_len > context_len:
            continue  # would not fit the model's context
        rows.append(DatasetRow(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    if not rows:
        raise ValueError(
            f"no ShareGPT pair of {dataset_path!r} passed the length filters "
            "(prompt and output >= 2 tokens, within --sharegpt-context-len)")
    return rows
