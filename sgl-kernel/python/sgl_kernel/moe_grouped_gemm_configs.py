"""Launch configurations of the grouped MoE GEMM (:mod:`sgl_kernel.moe_grouped_gemm`): the
per-GPU tile table and how a launch picks its entry.

The table (``configs/moe_grouped_gemm.json``, written by
``benchmark/kernels/tune_moe_grouped_gemm.py``) holds, per GPU name and weight
(:func:`config_key`: experts, rows, columns, dtype), the swept tiles of each pair-count bucket
(the sweep times powers of two). :func:`launch_config` takes the CUDA device's entry (or that of
another GPU of the same model, :func:`table_device`) and the bucket nearest the batch's pairs
on a log scale; without an entry, :func:`fallback_config`. :func:`select_config` and
:func:`config_change_points` make the same choice without a GPU, so that the prefill warm-up
(``sglang.srt.model_executor.prefill_warmup``) can plan which tiles, hence which compiles, a
batch size causes. Kept apart from the kernel: the choice of tiles is table policy that the
tuning script and the warm-up read without launching anything.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import triton

from sgl_kernel._triton_mode import INTERPRETED, LaunchConfig
from sgl_kernel.fp8_blocks import QBLOCK
from sgl_kernel.moe_align import max_padded_pairs

__all__ = ["launch_config", "fallback_config", "config_key", "config_fields",
           "load_config_table", "table_device", "table_entry", "nearest_bucket", "select_config",
           "config_change_points", "launch_int_args", "CONFIG_PATH", "DEFAULT_CONFIG"]

logger = logging.getLogger(__name__)
CONFIG_PATH = os.path.join(os.path.dirname(__file__), "configs", "moe_grouped_gemm.json")

# Without a table entry for the device and shape: 64-row blocks (a prefill chunk's experts hold
# tens of rows each), 128 output columns, BLOCK_K 64 (128 in fp8: one scale block per step),
# per-block product scaling in fp8 until a sweep has timed the pre-scaled tiles; see
# fallback_config for the row block of smaller batches.
DEFAULT_CONFIG = LaunchConfig(block_n=128, block_k=64, num_warps=4, num_stages=3, block_m=64,
                              group_m=1)
_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
# Stored for fp8 entries only (a bf16 launch ignores it); a missing key reads as False, so the
# tables written before the field existed keep their meaning.
_FP8_FIELDS = ("fp8_prescale",)
# Stored for SwiGLU (up-projection) entries only, on the same terms.
_SWIGLU_FIELDS = ("swiglu_interleave",)


def fallback_config(num_experts: int, pairs: int, fp8: bool) -> LaunchConfig:
    """:data:`DEFAULT_CONFIG` (BLOCK_K 128 in fp8) with a row block no taller than the mean
    group needs (16..64 rows): at a few pairs per expert a 64-row block would be mostly
    padding, multiplied all the same."""
    per_expert = triton.next_power_of_2(max(-(-pairs // max(num_experts, 1)), 1))
    return DEFAULT_CONFIG._replace(block_m=min(max(per_expert, 16), DEFAULT_CONFIG.block_m),
                                   block_k=QBLOCK if fp8 else DEFAULT_CONFIG.block_k)


def config_key(num_experts: int, n: int, k: int, fp8: bool, act_fp8: bool = False) -> str:
    """The table's key of a weight ``[E, N, K]`` in bf16 or block fp8, the latter on activations
    in the model dtype (``dtype=fp8``) or quantised to fp8 (``act_fp8``: ``dtype=w8a8``)."""
    if act_fp8 and not fp8:
        raise ValueError("moe_grouped_gemm: fp8 activations need block-fp8 weights")
    return f"E={num_experts},N={n},K={k},dtype={'w8a8' if act_fp8 else 'fp8' if fp8 else 'bf16'}"


@functools.lru_cache(maxsize=8)
def load_config_table(path: str = CONFIG_PATH) -> Dict[str, dict]:
    """``{device name: {config_key: {pairs bucket (str): config fields}}}`` from ``path``
    (keys starting with ``_`` are notes); an absent file is an empty table."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        table = json.load(f)
    return {dev: shapes for dev, shapes in table.items()
            if not dev.startswith("_") and isinstance(shapes, dict)}


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _from_fields(fields: dict) -> LaunchConfig:
    return LaunchConfig(block_n=int(fields["block_n"]), block_k=int(fields["block_k"]),
                        num_warps=int(fields["num_warps"]), num_stages=int(fields["num_stages"]),
                        block_m=int(fields["block_m"]), group_m=int(fields.get("group_m", 1)),
                        fp8_prescale=bool(fields.get("fp8_prescale", False)),
                        swiglu_interleave=bool(fields.get("swiglu_interleave", False)),
                        weight_tma=bool(fields.get("weight_tma", False)))


def config_fields(cfg: LaunchConfig, fp8: bool = False, swiglu: bool = False) -> dict:
    """The table's record of ``cfg``; for an fp8 weight (``fp8``) also its inner-loop scheme
    ``fp8_prescale`` (bf16 records leave it out: the kernel ignores it there), for a SwiGLU
    up-projection (``swiglu``) also its tile layout ``swiglu_interleave``."""
    names = _FIELDS + (_FP8_FIELDS if fp8 else ()) + (_SWIGLU_FIELDS if swiglu else ())
    names += ("weight_tma",) if cfg.weight_tma else ()  # absent reads as pointer loads
    return {name: getattr(cfg, name) for name in names}


def launch_config(num_experts: int, n: int, k: int, pairs: int, fp8: bool = False,
                  device: Optional[torch.device] = None, swiglu: bool = False,
                  table_path: str = CONFIG_PATH, act_fp8: bool = False) -> LaunchConfig:
    """Tiles of :func:`sgl_kernel.moe_grouped_gemm.moe_grouped_gemm` for a weight ``[E, N, K]`` (N counts the gate and up
    rows of a SwiGLU weight) and ``pairs`` (token, expert) pairs.

    From the table at ``table_path`` under the CUDA device's name and :func:`config_key` (with
    ``act_fp8``: the w8a8 entry, fp8 activations with their group scales): the
    entry of the pair bucket nearest ``pairs`` on a log scale (the sweep times powers of two;
    an entry without ``fp8_prescale`` takes per-block product scaling).
    Without an entry, :func:`fallback_config`; under Triton's CPU interpreter,
    whose cost is per program and per op, 16-row blocks and whole-width column / K tiles (at most
    128 wide)."""
    out_cols = n // 2 if swiglu else n
    if INTERPRETED or device is None or torch.device(device).type != "cuda":
        return LaunchConfig(block_n=min(triton.next_power_of_2(max(out_cols, 16)), 128),
                            block_k=min(triton.next_power_of_2(max(k, 16)), 128),
                            block_m=16, group_m=1)
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    buckets = table_entry(num_experts, n, k, fp8, _device_name(index), table_path, act_fp8)
    return select_config(buckets, num_experts, pairs, fp8)


def _gpu_model(device_name: str) -> Optional[Tuple[str, str]]:
    """(vendor, model) of a GPU name: its first word and its first word with a digit
    (``NVIDIA H100 PCIe`` -> ``("NVIDIA", "H100")``, ``NVIDIA GeForce RTX 4090`` ->
    ``("NVIDIA", "4090")``); None when no word has a digit."""
    words = device_name.split()
    model = next((w for w in words[1:] if any(c.isdigit() for c in w)), None)
    return (words[0], model) if model else None


def table_device(device_names: Iterable[str], device_name: str) -> Optional[str]:
    """Which of the table's ``device_names`` holds the tiles for the GPU called
    ``device_name``: that name itself, else one of the same model (:func:`_gpu_model`; e.g.
    ``NVIDIA H100 PCIe`` takes ``NVIDIA H100 80GB HBM3``: the same SM and shared memory, so
    the same tiles fit), else None. Of several such names, the first in order."""
    names = list(device_names)
    if device_name in names:
        return device_name
    model = _gpu_model(device_name)
    same = [name for name in names if model is not None and _gpu_model(name) == model]
    return same[0] if same else None


@functools.lru_cache(maxsize=16)
def _note_table_device(device_name: str, chosen: Optional[str], table_path: str) -> None:
    """Say once per GPU name when its tiles are not its own (the lru_cache makes it once)."""
    if chosen == device_name:
        return
    how = (f"using those of {chosen!r}" if chosen else
           "using the fallback tiles, which may be several times slower at prefill sizes")
    logger.warning("moe_grouped_gemm: no tiles for %r in %s; %s. "
                   "benchmark/kernels/tune_moe_grouped_gemm.py sweeps and writes them.",
                   device_name, table_path, how)


def table_entry(num_experts: int, n: int, k: int, fp8: bool, device_name: str,
                table_path: str = CONFIG_PATH, act_fp8: bool = False
                ) -> Optional[Dict[str, dict]]:
    """The table's ``{pairs bucket (str): config fields}`` for a weight ``[E, N, K]`` (on fp8
    activations: ``act_fp8``) on the GPU called ``device_name`` (``torch.cuda.get_device_name``;
    a GPU absent from the table takes the entries of its model's, :func:`table_device`, with
    one warning), None without an entry."""
    table = load_config_table(table_path)
    chosen = table_device(table, device_name)
    _note_table_device(device_name, chosen, table_path)
    return table.get(chosen or "", {}).get(config_key(num_experts, n, k, fp8, act_fp8)) or None


def nearest_bucket(buckets: Iterable[str], pairs: int) -> str:
    """The bucket (a table key: a pair count as a string) nearest ``pairs`` on a log scale; a
    tie goes to the first of ``buckets`` in their order (the table's)."""
    return min(buckets, key=lambda b: abs(math.log(max(int(b), 1)) - math.log(max(pairs, 1))))


def select_config(buckets: Optional[Mapping[str, dict]], num_experts: int, pairs: int,
                  fp8: bool) -> LaunchConfig:
    """What :func:`launch_config` returns on a CUDA device whose table entry is ``buckets``
    (:func:`table_entry`; None or empty: :func:`fallback_config`) for ``pairs`` pairs. Needs no
    GPU, so a plan of the compiles a batch size causes can be made anywhere."""
    if buckets:
        return _from_fields(buckets[nearest_bucket(buckets, pairs)])
    return fallback_config(num_experts, pairs, fp8)


def _config_rank(buckets: Optional[Mapping[str, dict]], num_experts: int, pairs: int,
                 fp8: bool) -> int:
    """A number that never decreases with ``pairs`` and changes wherever
    :func:`select_config`'s choice may: the chosen bucket (each bucket wins one contiguous
    range of pair counts on the log scale, the ranges in the buckets' order) or, without a
    table entry, the fallback's row block (a power of two growing with the pairs)."""
    if buckets:
        return int(nearest_bucket(buckets, pairs))
    return fallback_config(num_experts, pairs, fp8).block_m


def config_change_points(buckets: Optional[Mapping[str, dict]], num_experts: int, fp8: bool,
                         lo_pairs: int, hi_pairs: int) -> List[int]:
    """The pair counts ``p`` in ``(lo_pairs, hi_pairs]`` where :func:`select_config` picks a
    different config than for ``p - 1`` (sorted): between two of them every batch launches
    the same tiles. Buckets with equal fields are one config (no change point between them).
    Found by bisection of :func:`_config_rank`, a few dozen evaluations per change."""
    def rank(p: int) -> int:
        return _config_rank(buckets, num_experts, p, fp8)

    points: List[int] = []

    def split(lo: int, hi: int) -> None:  # every rank change in (lo, hi]; rank is monotone
        if hi <= lo or rank(lo) == rank(hi):
            return
        if hi == lo + 1:
            points.append(hi)
            return
        mid = (lo + hi) // 2
        split(lo, mid)
        split(mid, hi)

    split(max(lo_pairs, 1), hi_pairs)
    return [p for p in points if select_config(buckets, num_experts, p, fp8)
            != select_config(buckets, num_experts, p - 1, fp8)]


def launch_int_args(num_pairs: int, num_experts: int, block_m: int) -> Tuple[int, int]:
    """The integer arguments of a :func:`sgl_kernel.moe_grouped_gemm.moe_grouped_gemm` launch that follow the batch:
    ``(num_pairs, max_blocks)`` (the others follow the weight). Triton compiles one variant of
    the kernel per class of each (equal to 1, divisible by 16, other), so these say which
    variant a batch of ``num_pairs`` pairs needs."""
    return num_pairs, max_padded_pairs(num_pairs, num_experts, block_m) // block_m
