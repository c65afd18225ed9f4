"""Synthetic ``random`` / ``random-ids`` datasets (as upstream SGLang's bench_serving builds them).

Unlike upstream, ``random`` does not sample ShareGPT (that would need a download): it draws token
ids from the tokenizer's ordinary (non-special) vocabulary and decodes them to text. The server
re-tokenizes that text, so its prompt length can differ slightly from the recorded target length,
exactly as upstream's text mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Union

import numpy as np


@dataclass
class DatasetRow:
    """One benchmark request: the prompt (text or token ids) and its target lengths."""

    prompt: Union[str, List[int]]
    prompt_len: int
    output_len: int


def compute_random_lens(full_len: int, range_ratio: float, num: int) -> np.ndarray:
    """Uniform integer lengths in ``[max(int(full_len * range_ratio), 1), full_len]``."""
    if full_len < 1:
        raise ValueError(f"length must be >= 1, got {full_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full_len * range_ratio), 1)
    return np.random.randint(low, full_len + 1, size=num)


def _vocab_size(tokenizer) -> int:
    return int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))


def sample_random_ids_requests(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> List[DatasetRow]:
    """Token-id prompts ``(offset_i + i + j) mod vocab``: cheap, deterministic given the seed."""
    vocab = _vocab_size(tokenizer)
    in_lens = compute_random_lens(input_len, range_ratio, num_prompts)
    out_lens = compute_random_lens(output_len, range_ratio, num_prompts)
    offsets = np.random.randint(0, vocab, size=num_prompts)
    rows = []
    for i in range(num_prompts):
        ids = ((offsets[i] + i + np.arange(in_lens[i])) % vocab).tolist()
        rows.append(DatasetRow(prompt=ids, prompt_len=int(in_lens[i]), output_len=int(out_lens[i])))
    return rows


def sample_random_text_requests(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> List[DatasetRow]:
    """Text prompts decoded from random ordinary-vocabulary ids (no dataset download)."""
    vocab = _vocab_size(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    pool = np.array([t for t in range(vocab) if t not in special], dtype=np.int64)
    if pool.size == 0:
        raise ValueError("the tokenizer has no ordinary tokens to build random prompts from")
    # The server adds the tokenizer's special tokens (e.g. BOS); leave room for them as upstream.
    n_special = 0
    if hasattr(tokenizer, "num_special_tokens_to_add"):
        n_special = int(tokenizer.num_special_tokens_to_add())
    in_lens = compute_random_lens(input_len, range_ratio, num_prompts)
    out_lens = compute_random_lens(output_len, range_ratio, num_prompts)
    rows = []
    for i in range(num_prompts):
        n = max(int(in_lens[i]) - n_special, 1)
        ids = pool[np.random.randint(0, pool.size, size=n)].tolist()
        text = tokenizer.decode(ids)
        rows.append(DatasetRow(prompt=text, prompt_len=int(in_lens[i]),
                               output_len=int(out_lens[i])))
    return rows
