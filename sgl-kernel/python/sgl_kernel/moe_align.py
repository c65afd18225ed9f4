"""The expert sort of the grouped MoE GEMM (:mod:`sgl_kernel.moe_grouped_gemm`): the pairs of a
batch's routes sorted by expert, each expert's group padded to the GEMM's row block
(:class:`MoEAlignment`), in two forms.

:func:`moe_align` is the torch form and the reference (28 torch ops, among them counts,
cumsums, a stable argsort that CUDA runs as a multi-pass radix sort, gathers, a scatter, a
searchsorted). :func:`moe_align_triton` returns exactly the same :class:`MoEAlignment` in three
Triton launches, bit for bit, stable order within an expert included: the pairs
``p = t * k + slot`` are cut into chunks of ``CHUNK`` consecutive pair ids, and the work follows
the one data dependency there is (a pair's destination needs every earlier chunk's counts):

1. ``_chunk_counts`` (one program per chunk): the chunk's per-expert counts
   (``tl.histogram``) into a scratch row; the programs also fill the outputs with their
   defaults (sentinel pair id ``P``, block expert -1), so no ``torch.full`` launch is needed.
2. ``_expert_offsets`` (one program): per-expert totals, padded sizes, their ``tl.cumsum``
   (each expert's padded start), ``num_blocks``; then per chunk, in chunk order, the offset
   that turns "position in the chunk sorted by (expert, pair id)" into the destination row
   (written over the chunk's counts); and the block -> expert table: each non-empty expert
   marks its first block, a running maximum over the blocks spreads the marks.
3. ``_chunk_scatter`` (one program per chunk): the chunk's keys ``expert * CHUNK + i`` sorted
   (``tl.sort``: unique keys, so the order within an expert is pair order, i.e. stable), each
   sorted pair stored at its chunk offset plus its sorted position.

No host read, and every size follows from ``T * k``, ``num_experts`` and ``block_m``: CUDA-graph
capturable. Imports torch and triton only (with this package's own modules).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_kernel._triton_mode import compiler_options

__all__ = ["MoEAlignment", "moe_align", "max_padded_pairs", "moe_align_triton", "align_chunk",
           "REFERENCE_NOTE"]

REFERENCE_NOTE = ("sgl_kernel.moe_align.moe_align (torch ops) is the reference: "
                  "moe_align_triton returns the same MoEAlignment, bit for bit")


class MoEAlignment(NamedTuple):
    """The expert-sorted pair list of one batch's routes (all on the routes' device).

    ``sorted_pairs [max_padded]`` int32: pair ids grouped by expert (stable within an expert),
    each group padded to a multiple of ``block_m`` with the sentinel ``num_pairs``;
    ``block_expert [max_padded // block_m]`` int32: the expert of every ``block_m``-row block
    (-1 past the used blocks); ``num_blocks [1]`` int32: how many blocks are used;
    ``num_tokens``: the routes' rows ``T`` (a shared expert routed once per token, the last
    expert id, holds the last ``ceil(T / block_m)`` blocks in use)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int
    num_pairs: int
    num_experts: int
    num_tokens: int = 0


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded list in the worst case: at most ``min(E, P)`` groups are non-empty,
    each padded by at most ``block_m - 1``; the total is a multiple of ``block_m``."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs ``p = t * k + slot`` of ``topk_ids [T, k]`` by expert and pad each expert's
    group to a multiple of ``block_m`` (see :class:`MoEAlignment`).

    Torch ops only and no value read on the host (counts by ``scatter_add_``, not
    ``bincount``, whose CUDA form reads the maximum on the host): capturable in a CUDA graph.
    Output sizes depend on ``T * k``, ``num_experts`` and ``block_m`` only."""
    if topk_ids.dim() != 2 or block_m < 1 or num_experts < 1:
        raise ValueError(f"moe_align: expected topk_ids [T, k], num_experts >= 1, block_m >= 1; "
                         f"got {tuple(topk_ids.shape)}, {num_experts}, {block_m}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    p = flat.numel()
    padded_len = max_padded_pairs(p, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts  # first sorted position of each expert
    order = torch.argsort(flat, stable=True)  # pair ids in expert order
    expert_of = flat[order]
    # Sorted position i of expert e moves to e's padded group at the same offset i - start[e].
    dest = (padded_end - padded)[expert_of] + torch.arange(p, device=dev) - start[expert_of]
    sorted_pairs = torch.full((padded_len,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    # A block's expert: the first whose padded group ends after the block's first row.
    first_row = torch.arange(0, padded_len, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    return MoEAlignment(sorted_pairs, block_expert, num_blocks, block_m, p, num_experts,
                        topk_ids.shape[0])


# Pair ids per chunk at most: a chunk is sorted in registers by one program (bitonic, so a
# power of two); 1024 keeps the sort cheap while a Ling prefill (8192 tokens x top-8) needs
# only 64 programs per parallel launch and 64 rows in the single program's loop.
MAX_CHUNK = 1024
# Blocks per step of the single program's block-table sweep.
BLOCK_TILE = 1024


def align_chunk(num_pairs: int) -> int:
    """Pair ids per chunk for ``num_pairs`` pairs: the next power of two, 16 to
    :data:`MAX_CHUNK` (a small batch does not sort 1024 mostly masked keys)."""
    return min(MAX_CHUNK, max(16, triton.next_power_of_2(num_pairs)))


@triton.jit
def _chunk_counts(ids_ptr, counts_ptr, pairs_ptr, bexp_ptr, num_pairs, num_experts,
                  padded_len, num_block_slots, fill_per_prog, bfill_per_prog,
                  CHUNK: tl.constexpr, E_BINS: tl.constexpr, FILL: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    # Pairs past the end land in bin num_experts (E_BINS > num_experts), never read.
    hist = tl.histogram(tl.where(mask, ids, num_experts), E_BINS)
    tl.store(counts_ptr + c * E_BINS + tl.arange(0, E_BINS), hist)
    # The outputs' defaults, a slice per program: rows the scatter leaves alone are padding
    # (sentinel P) and blocks the table sweep leaves alone are unused (-1).
    for start in range(0, fill_per_prog, FILL):
        rows = c * fill_per_prog + start + tl.arange(0, FILL)
        row_ok = (rows < padded_len) & (start + tl.arange(0, FILL) < fill_per_prog)
        tl.store(pairs_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs, mask=row_ok)
    for start in range(0, bfill_per_prog, FILL):
        blk = c * bfill_per_prog + start + tl.arange(0, FILL)
        blk_ok = (blk < num_block_slots) & (start + tl.arange(0, FILL) < bfill_per_prog)
        tl.store(bexp_ptr + blk, tl.full([FILL], -1, tl.int32), mask=blk_ok)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _expert_offsets(counts_ptr, bexp_ptr, nblk_ptr, num_chunks, num_experts, num_block_slots,
                    block_m, E_BINS: tl.constexpr, BLOCK_TILE: tl.constexpr):
    experts = tl.arange(0, E_BINS)
    real = experts < num_experts  # the spare bins (past-the-end pairs, pow-2 padding) drop out
    totals = tl.zeros([E_BINS], dtype=tl.int32)
    for c in range(0, num_chunks):
        totals += tl.load(counts_ptr + c * E_BINS + experts)
    totals = tl.where(real, totals, 0)
    padded = (totals + block_m - 1) // block_m * block_m
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    used_blocks = tl.sum(padded, 0) // block_m
    tl.store(nblk_ptr, used_blocks)
    # Chunk c's sorted position j (expert e) goes to padded_start[e] + (e's pairs in earlier
    # chunks) + (j - e's first position in the chunk's sorted keys); the last term's offset is
    # the chunk's pairs of lower experts. One value per (chunk, expert), over its counts row: the
    # cumsum exchanges values between threads, so every read of the row precedes any write.
    before = tl.zeros([E_BINS], dtype=tl.int32)
    for c in range(0, num_chunks):
        hist = tl.where(real, tl.load(counts_ptr + c * E_BINS + experts), 0)
        lower = tl.cumsum(hist, 0) - hist
        tl.store(counts_ptr + c * E_BINS + experts, padded_start + before - lower)
        before += hist
    # Block table: a non-empty expert's first block gets its id (distinct blocks, since
    # non-empty groups have distinct starts); then the running maximum over blocks gives every
    # used block the expert whose group holds it (ids rise with the start). Blocks past
    # used_blocks keep the -1 of _chunk_counts.
    tl.store(bexp_ptr + padded_start // block_m, experts, mask=real & (padded > 0))
    tl.debug_barrier()  # the marks, stored by other threads, before any thread reads them
    carry = tl.full([], -1, tl.int32)
    for start in range(0, num_block_slots, BLOCK_TILE):
        blk = start + tl.arange(0, BLOCK_TILE)
        in_use = blk < used_blocks
        marks = tl.load(bexp_ptr + blk, mask=in_use, other=-1)
        run = tl.maximum(tl.associative_scan(marks, 0, _max_combine), carry)
        tl.store(bexp_ptr + blk, run, mask=in_use)
        carry = tl.max(run, 0)


@triton.jit
def _chunk_scatter(ids_ptr, offsets_ptr, pairs_ptr, num_pairs, num_experts,
                   CHUNK: tl.constexpr, E_BINS: tl.constexpr):
    c = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    offs = c * CHUNK + local
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    # Unique keys: expert-major, then pair order (the stable order); past-the-end pairs sort
    # last under the key of expert num_experts.
    keys = tl.where(mask, ids, num_experts) * CHUNK + local
    keys = tl.sort(keys, 0)
    expert = keys // CHUNK
    pair = c * CHUNK + keys % CHUNK
    ok = expert < num_experts
    base = tl.load(offsets_ptr + c * E_BINS + expert, mask=ok, other=0)
    tl.store(pairs_ptr + base + local, pair, mask=ok)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """:func:`moe_align` in three Triton launches (the module
    docstring): the same :class:`MoEAlignment`, bit for bit. ``topk_ids [T, k]`` holds expert
    ids in ``[0, num_experts)`` (int32 or int64); any device Triton runs on (CUDA, or the CPU
    under ``TRITON_INTERPRET=1``). No host read; sizes depend on ``T * k``, ``num_experts`` and
    ``block_m`` only."""
    if topk_ids.dim() != 2 or block_m < 1 or num_experts < 1:
        raise ValueError(f"moe_align_triton: expected topk_ids [T, k], num_experts >= 1, "
                         f"block_m >= 1; got {tuple(topk_ids.shape)}, {num_experts}, {block_m}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():  # reshape of a non-contiguous view copies; a view is kept
        flat = flat.contiguous()
    p = flat.numel()
    padded_len = max_padded_pairs(p, num_experts, block_m)
    block_slots = padded_len // block_m
    sorted_pairs = torch.empty(padded_len, dtype=torch.int32, device=dev)
    block_expert = torch.empty(block_slots, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    if p == 0:  # nothing to sort: no rows, no blocks (the reference's answer, without launches)
        num_blocks.zero_()
        return MoEAlignment(sorted_pairs, block_expert, num_blocks, block_m, p, num_experts,
                            topk_ids.shape[0])
    chunk = align_chunk(p)
    num_chunks = triton.cdiv(p, chunk)
    # One spare bin at least (past-the-end pairs), a power of two for tl.arange.
    e_bins = triton.next_power_of_2(num_experts + 1)
    # Per (chunk, expert): counts, then (rewritten by _expert_offsets) destination offsets.
    scratch = torch.empty((num_chunks, e_bins), dtype=torch.int32, device=dev)
    fill = 256
    fill_per_prog = triton.cdiv(padded_len, num_chunks)
    bfill_per_prog = triton.cdiv(block_slots, num_chunks)
    _chunk_counts[(num_chunks,)](flat, scratch, sorted_pairs, block_expert, p, num_experts,
                                 padded_len, block_slots, fill_per_prog, bfill_per_prog,
                                 CHUNK=chunk, E_BINS=e_bins, FILL=fill)
    _expert_offsets[(1,)](scratch, block_expert, num_blocks, num_chunks, num_experts,
                          block_slots, block_m, E_BINS=e_bins, BLOCK_TILE=BLOCK_TILE,
                          **compiler_options(8, None))
    _chunk_scatter[(num_chunks,)](flat, scratch, sorted_pairs, p, num_experts,
                                  CHUNK=chunk, E_BINS=e_bins, **compiler_options(8, None))
    return MoEAlignment(sorted_pairs, block_expert, num_blocks, block_m, p, num_experts,
                            topk_ids.shape[0])
