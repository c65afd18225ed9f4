"""The ``random`` and ``random-ids`` datasets, as upstream SGLang's bench_serving builds them.

Lengths: every request draws its input and output length uniformly from
``[max(int(len * --random-range-ratio), 1), len]`` (:func:`compute_random_lens`).

- ``random`` (upstream's meaning): the first turns of a ShareGPT file (``--dataset-path``) are
  shuffled; each request takes the next one, tokenizes it, repeats its ids until the drawn input
  length and truncates there, and decodes the ids back to text. The drawn input length is first
  reduced by the tokenizer's special-token count, because the server adds those (e.g. BOS) when
  it re-tokenizes; that reduced length is the recorded ``prompt_len``. Re-tokenizing decoded
  text can merge or split tokens, so the server's count may differ slightly (as upstream).
  Upstream downloads ShareGPT when no path is given; this build never downloads and instead
  draws the ids uniformly from the tokenizer's ordinary (non-special) vocabulary.
- ``random-ids``: token-id prompts ``(offset_i + i + j) mod vocab`` sent as ids.
"""
from __future__ import annotations

import random  # the standard library's (absolute import), for upstream's shuffle
from typing import List, Optional

import numpy as np

from sglang.benchmark.datasets.common import DatasetRow, compute_random_lens
from sglang.benchmark.datasets.sharegpt import load_sharegpt_pairs


def _vocab_size(tokenizer) -> int:
    return int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))


def _text_input_lens(tokenizer, input_len: int, range_ratio: float, num: int) -> np.ndarray:
    """Drawn input lengths minus the special tokens the server will add (at least 1 token, so
    no prompt is empty; upstream allows 0)."""
    lens = compute_random_lens(input_len, range_ratio, num)
    n_special = 0
    if hasattr(tokenizer, "num_special_tokens_to_add"):
        n_special = int(tokenizer.num_special_tokens_to_add())
    return np.maximum(lens - n_special, 1)


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


def sample_random_requests(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    dataset_path: Optional[str] = None,
) -> List[DatasetRow]:
    """``random``: ShareGPT first turns repeated/truncated to the drawn lengths, as text.

    Without ``dataset_path``, the ids come from the ordinary vocabulary instead (see the module
    docstring). Python's ``random`` (shuffle) and NumPy (lengths, vocabulary draws) are the
    sources of randomness, both seeded by ``--seed``.
    """
    in_lens = _text_input_lens(tokenizer, input_len, range_ratio, num_prompts)
    out_lens = compute_random_lens(output_len, range_ratio, num_prompts)
    if not dataset_path:
        return _vocab_text_rows(tokenizer, in_lens, out_lens)
    prompts = [prompt for prompt, _ in load_sharegpt_pairs(dataset_path, "random")]
    random.shuffle(prompts)
    rows: List[DatasetRow] = []
    for prompt in prompts:
        i = len(rows)
        if i == num_prompts:
            break
        ids = tokenizer.encode(prompt)
        if not ids:
            continue  # an empty first turn cannot be repeated to any length
        target = int(in_lens[i])
        repeats = -(-target // len(ids))  # ceil: enough copies to reach the target
        text = tokenizer.decode((list(ids) * repeats)[:target])
        rows.append(DatasetRow(prompt=text, prompt_len=target, output_len=int(out_lens[i])))
    if len(rows) < num_prompts:
        # Upstream returns fewer rows silently; say so, since the totals shrink with them.
        print(f"random: {dataset_path!r} has {len(rows)} usable prompts for {num_prompts} "
              "requested; running with fewer")
    if not rows:
        raise ValueError(f"--dataset-path {dataset_path!r} has no non-empty first turn")
    return rows


def _vocab_text_rows(tokenizer, in_lens: np.ndarray, out_lens: np.ndarray) -> List[DatasetRow]:
    """Text decoded from uniform draws of the ordinary (non-special) vocabulary."""
    vocab = _vocab_size(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    pool = np.array([t for t in range(vocab) if t not in special], dtype=np.int64)
    if pool.size == 0:
        raise ValueError("the tokenizer has no ordinary tokens to build random prompts from")
    rows = []
    for n, out_len in zip(in_lens, out_lens):
        ids = pool[np.random.randint(0, pool.size, size=int(n))].tolist()
        rows.append(DatasetRow(prompt=tokenizer.decode(ids), prompt_len=int(n),
                               output_len=int(out_len)))
    return rows


def sample_random_text_requests(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> List[DatasetRow]:
    """``random`` without a ShareGPT file: text decoded from random ordinary-vocabulary ids."""
    return sample_random_requests(tokenizer, num_prompts, input_len, output_len, range_ratio)
