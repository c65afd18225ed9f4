"""What every benchmark dataset shares: the row type and upstream's random length draw."""
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
