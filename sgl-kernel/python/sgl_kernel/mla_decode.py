"""MLA decode / chain-verify attention over the latent KV cache, lengths read on the device.

Absorbed MLA is multi-query attention: every head's query ``q [Dk]``
(``Dk = v_dim + rope_dim``, ``W_UK^T q_nope`` ‖ roped ``q_rope``) scores the shared cache row
``[c ‖ k_rope]`` of each key and reads the latent ``c = row[:v_dim]`` as its value. Layout::

    q            [B, N * H, Dk]   row n * H + h = query token n, head h of request b (token-major)
    kv_buffer    [slots, Dk]      one latent row per KV slot (MLATokenToKVPool, one layer)
    req_to_token [reqs, cap]      KV slot of token j of the request in that row (ReqToTokenPool)
    positions    [B, N]           absolute position of each query token (int64, on the device)
    out          [B, N * H, v_dim]

Key ``j`` of request ``b`` is ``kv_buffer[req_to_token[req_pool_indices[b], j]]``; query token
``n`` sees keys ``0 .. positions[b, n]`` (inclusive; its own row must already be in the cache).
This is :func:`sglang.srt.layers.attention.mla_ops.mla_decode_attention` over the padded gather
that ``TorchNativeMLABackend`` builds, without the gather.

Why this shape of kernel:

* **No lengths on the host.** The grid is ``(B, cdiv(N * H, BLOCK_H), num_splits)`` and
  ``num_splits`` comes from shapes only (:func:`mla_decode_num_splits`: the cache capacity
  ``req_to_token.shape[1]``, the batch shape and the SM count), so one CUDA graph per
  batch size replays for every sequence length. The loop bounds are loaded from ``positions``.
* **Flash-decoding split-K.** At batch 1 the ``H`` heads of one token are a handful of programs;
  splitting the keys over ``num_splits`` programs lets the whole GPU stream the cache. Each
  request's split length is computed on the device from its own length
  (``max(SPLIT_MIN, cdiv(len, num_splits))`` rounded up to ``BLOCK_N``), so a short sequence
  uses few splits and a long one all of them. A split past the end writes nothing; the merge
  kernel reads, per query row, only the splits that hold a key the row can see, and combines
  them by log-sum-exp.
* **Batch invariance on request** (``split_len``, :func:`mla_decode_batch_invariant_split`):
  the adaptive split length depends on the request's longest query, so the same query token's
  keys are grouped differently in a 1-token decode and in an ``N``-token verify, and its output
  rounds differently. With a fixed split length every query row sees the same key groups in
  the same order whatever shares the launch: keys a row cannot see contribute exact zeros to
  its online softmax and splits past its length are never merged, so its result is
  bit-identical at any ``N`` and batch size (``--enable-deterministic-inference``). The length
  comes from a span the caller fixes (the context length), not from the capacity: a
  speculative runner's request map is wider than a plain one's by its round's position
  headroom, and a split length taken from the capacity grouped a token's keys differently in
  the two (the H100 probe's one differing prompt: docs/performance.md).
* **One program, all its rows, one read of each key.** A program holds ``BLOCK_H`` query rows
  (heads, possibly of several chain tokens; 16, 32 or 64 by the rows per request:
  :func:`_rows_per_program`) and scores them against a ``BLOCK_N`` block of cache
  rows with two ``tl.dot``s (the latent part, padded to a power of two, and the rope part), then
  reuses the same latent block as the value. Scores, softmax and accumulators are fp32; the
  probabilities enter the value product in the input dtype, as in the reference.

Launch sizes are fixed per cache row width ``Dk`` (:func:`_config`), never chosen from the
lengths. Decode-sized launches of both kernels use PDL (:mod:`sgl_kernel.pdl`): each waits
before its first read, since every input is written earlier in the step. Under Triton's CPU
interpreter (``TRITON_INTERPRET=1``) fp32 and fp16 work; bf16 does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import INTERPRETED, sm_count

__all__ = ["mla_decode_fwd", "mla_decode_num_splits", "mla_decode_batch_invariant_split",
           "mla_decode_scratch_numel", "MAX_SPLITS", "REFERENCE_NOTE"]

REFERENCE_NOTE = ("reference: sglang.srt.layers.attention.mla_ops.mla_decode_attention over the "
                  "padded cache gather (module docstring), compared in "
                  "test/kernels/test_mla_decode.py")

MAX_SPLITS = 64  # upper bound of num_splits (bounds the scratch and the merge's loop)
_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": a fully masked block never produces NaN


@dataclass(frozen=True)
class _Config:
    """Fixed launch sizes of one cache row width.

    Not a :class:`sgl_kernel._triton_mode.LaunchConfig`: these launches tile query rows x keys
    with no K tile (a whole latent row is one tile, sized from ``v_dim`` at launch) and carry
    attention's split policy (``split_min``) and the merge kernel's width (``block_s``), which
    no GEMM has; folding them in would add two attention-only fields to every kernel's config.
    """

    block_h: int  # query rows per program (>= 16: the M of tl.dot)
    block_n: int  # cache rows per inner step
    split_min: int  # fewest keys per split (a multiple of block_n)
    block_s: int  # splits merged per step of the merge kernel
    merge_block_v: int  # value channels per merge program (a request row's V split over programs)
    num_warps: int
    num_stages: int


def _config(dk: int) -> _Config:
    """Launch sizes for a ``Dk``-wide cache row; independent of the lengths (and of ``H``: the
    rows are tiled over all ``N * H`` query rows of a request).

    On the GPU a ``[32, 512]`` bf16 latent block is 32 KB of shared memory per stage; wider rows
    take 16-row blocks. With 8 warps the split kernel compiles for sm_90 at Dk = 576 to 196
    registers without spills (4 warps spill), so one program fills an SM's register file: the
    split count aims at one program per SM (:func:`mla_decode_num_splits`). The interpreter's
    cost is per program and per op, so it gets small splits (tests cross split boundaries at
    short lengths) and the same 16-row tiles.

    The merge reads every split's partial row (``num_splits x v_dim`` fp32 per query row): one
    program per row and all 512 channels left 32 programs for a batch-1 decode's 4 MB of
    partials, so its V is split over programs of ``merge_block_v`` channels (each merges its
    channels of every split exactly as the whole row would: the same values).
    """
    if INTERPRETED:
        return _Config(block_h=16, block_n=16, split_min=16, block_s=4, merge_block_v=16,
                       num_warps=4, num_stages=1)
    block_n = 32 if dk <= 640 else 16
    return _Config(block_h=16, block_n=block_n, split_min=64, block_s=16, merge_block_v=64,
                   num_warps=8, num_stages=2)


def _rows_per_program(cfg: _Config, rows: int, batch_invariant: bool = False) -> int:
    """Query rows per split program for ``rows = N * H`` rows per request: ``cfg.block_h`` (16)
    up to one token's 32 heads, 32 up to 256 rows and 64 above. Each program reads its keys
    once for all its rows, so at 16 rows a 4-token verify read the cache eight times over; the
    sweep (``bench_mla_decode.py --block-h``, H100, 8192 keys, docs/performance.md) put 16 first
    at one token (26.8 against 31.3 µs), 32 at 4 and 8 tokens (49.7 / 82.9 against 62.4 / 113.9)
    and 64 at 16 (137.8 against 208.9). ``batch_invariant`` (fixed split boundaries) and the
    interpreter keep ``cfg.block_h``: a row's tile height then never depends on its launch."""
    if batch_invariant or INTERPRETED or rows <= 32:
        return cfg.block_h
    return 32 if rows <= 256 else 64


def mla_decode_num_splits(batch: int, rows: int, capacity: int, dk: int,
                          device: torch.device | str = "cuda") -> int:
    """Key splits per request: a function of shapes only (never of the sequence lengths).

    ``min(MAX_SPLITS, cdiv(capacity, SPLIT_MIN), target_programs // (batch * row_blocks))``,
    at least 1, where ``rows = N * H`` query rows per request, ``row_blocks = cdiv(rows,
    BLOCK_H)`` and ``target_programs`` is the SM count (8 under the interpreter): the grid is
    one wave at most (equal splits would leave a second wave mostly idle), short caches get
    fewer splits, and larger batches need fewer.
    """
    cfg = _config(dk)
    row_blocks = triton.cdiv(max(rows, 1), _rows_per_program(cfg, rows))
    by_capacity = triton.cdiv(max(capacity, 1), cfg.split_min)
    # One program per SM fills the device in one wave (sm_count: 8 under the interpreter).
    by_occupancy = sm_count(device) // (max(batch, 1) * row_blocks)
    return max(1, min(MAX_SPLITS, by_capacity, by_occupancy))


def mla_decode_batch_invariant_split(capacity: int, dk: int, span: Optional[int] = None) -> tuple:
    """``(num_splits, split_len)`` with split boundaries fixed by ``span`` alone (default: the
    capacity): the shortest split (a multiple of ``BLOCK_N``, at least ``SPLIT_MIN``) for which
    ``MAX_SPLITS - 1`` splits cover ``span`` keys, so short sequences still spread over several
    programs, and as many splits as cover ``capacity``. Pass both to :func:`mla_decode_fwd` for
    results that do not depend on the batch shape; runners whose capacities differ (a
    speculative one's is ``span`` plus its position headroom) split alike when they pass the
    same ``span``. The spare split covers a capacity up to ``span + split_len``;
    ``ValueError`` beyond it."""
    cfg = _config(dk)
    span = capacity if span is None else span
    per_split = triton.cdiv(max(span, 1), MAX_SPLITS - 1)
    split_len = max(cfg.split_min, triton.cdiv(per_split, cfg.block_n) * cfg.block_n)
    num_splits = triton.cdiv(max(capacity, 1), split_len)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"mla_decode_batch_invariant_split: a capacity of {capacity} keys needs "
                         f"{num_splits} splits of {split_len} (from a span of {span}); at most "
                         f"{MAX_SPLITS}")
    return num_splits, split_len


def mla_decode_scratch_numel(batch: int, rows: int, num_splits: int, v_dim: int) -> int:
    """fp32 elements of the split scratch: a ``v_dim`` partial output and a log-sum-exp per
    (request, query row, split)."""
    return batch * rows * num_splits * (v_dim + 1)


@triton.jit
def _split_len(pos_ptr, b, s_pb, s_pn, N, cap, num_splits,
               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr,
               FIXED_SPLIT: tl.constexpr):
    """Keys per split of request ``b`` (the same in both kernels): ``FIXED_SPLIT`` when it is
    set (batch-invariant boundaries), else from its longest query's visible length, clamped to
    the cache capacity. Both branches return int32: the compiler refuses a function whose
    returns differ in type, and int64 positions would make the computed one int64."""
    if FIXED_SPLIT > 0:
        return tl.full((), FIXED_SPLIT, tl.int32)
    toks = tl.arange(0, BLOCK_T)
    pos = tl.load(pos_ptr + b * s_pb + toks * s_pn, mask=toks < N, other=-1)
    length = tl.minimum(tl.maximum(tl.max(pos, 0) + 1, 0), cap)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, SPLIT_MIN).to(tl.int32)


@triton.jit
def _mla_split_kernel(q_ptr, kv_ptr, r2t_ptr, rpi_ptr, pos_ptr, part_ptr, lse_ptr,
                      N, H, R, cap, num_splits, qk_scale,
                      s_qb, s_qr, s_kv, s_r2t, s_pb, s_pn,
                      V: tl.constexpr, DR: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_T: tl.constexpr, SPLIT_MIN: tl.constexpr, FIXED_SPLIT: tl.constexpr,
                      PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(2)
    # Positions, queries, the cache and the request map are all written earlier in the step.
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    chunk = _split_len(pos_ptr, b, s_pb, s_pn, N, cap, num_splits, BLOCK_T, BLOCK_N, SPLIT_MIN,
                       FIXED_SPLIT)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < R
    # Visible keys of each row: 0 .. positions[b, token] (padding rows of the block see none).
    pos = tl.load(pos_ptr + b * s_pb + (rows // H) * s_pn, mask=row_ok, other=-1)
    limit = tl.minimum(tl.maximum(pos + 1, 0), cap)
    start = split * chunk
    end = tl.minimum(start + chunk, tl.max(limit, 0))
    live = row_ok & (limit > start)  # rows that see a key of this split (the merge reads those)

    offs_v = tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    q_rows = q_ptr + b.to(tl.int64) * s_qb + rows[:, None] * s_qr
    q_c = tl.load(q_rows + offs_v[None, :], mask=live[:, None] & mask_v[None, :], other=0.0)
    if DR > 0:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < DR
        q_r = tl.load(q_rows + V + offs_r[None, :], mask=live[:, None] & mask_r[None, :], other=0.0)
    tok_slots = r2t_ptr + tl.load(rpi_ptr + b).to(tl.int64) * s_r2t

    m = tl.full([BLOCK_H], _NEG, dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    # Runtime bounds: an empty split (start >= end) runs no iteration.
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_split = offs_n < end
        slot = tl.load(tok_slots + offs_n, mask=in_split, other=0).to(tl.int64)
        kv_rows = kv_ptr + slot[:, None] * s_kv
        c = tl.load(kv_rows + offs_v[None, :], mask=in_split[:, None] & mask_v[None, :],
                    other=0.0).to(q_c.dtype)
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        if DR > 0:
            k_r = tl.load(kv_rows + V + offs_r[None, :], mask=in_split[:, None] & mask_r[None, :],
                          other=0.0).to(q_r.dtype)
            s += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        visible = in_split[None, :] & (offs_n[None, :] < limit[:, None])
        s = tl.where(visible, s * qk_scale, _NEG)  # log2 domain: exp2 below
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m = m_new
    # A live row saw key ``start`` in its first block, so its m is a real score and l_sum >= 1.
    # Rows that are not live are never read by the merge and are not written.
    l_safe = tl.where(live, l_sum, 1.0)
    out_rows = (b * R + rows).to(tl.int64) * num_splits + split
    tl.store(part_ptr + out_rows[:, None] * V + offs_v[None, :], acc / l_safe[:, None],
             mask=live[:, None] & mask_v[None, :])
    tl.store(lse_ptr + out_rows, m + tl.log2(l_safe), mask=live)


@triton.jit
def _mla_merge_kernel(part_ptr, lse_ptr, pos_ptr, out_ptr, N, H, R, cap, num_splits,
                      s_pb, s_pn, s_ob, s_or,
                      V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_T: tl.constexpr, SPLIT_MIN: tl.constexpr, FIXED_SPLIT: tl.constexpr,
                      BLOCK_S: tl.constexpr, MERGE_V: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    r = tl.program_id(1)
    v0 = tl.program_id(2) * MERGE_V  # this program's value channels: v0 .. v0 + MERGE_V - 1
    # The partials come from the split kernel just before; positions from earlier still.
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    chunk = _split_len(pos_ptr, b, s_pb, s_pn, N, cap, num_splits, BLOCK_T, BLOCK_N, SPLIT_MIN,
                       FIXED_SPLIT)
    limit = tl.minimum(tl.maximum(tl.load(pos_ptr + b * s_pb + (r // H) * s_pn) + 1, 0), cap)
    count = tl.cdiv(limit, chunk)  # splits holding at least one key this row sees
    base = (b * R + r).to(tl.int64) * num_splits
    offs_v = v0 + tl.arange(0, MERGE_V)
    mask_v = offs_v < V
    m = _NEG
    den = 0.0
    acc = tl.zeros([MERGE_V], dtype=tl.float32)
    for s0 in range(0, count, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        ok = ss < count
        lse = tl.load(lse_ptr + base + ss, mask=ok, other=_NEG)
        m_new = tl.maximum(m, tl.max(lse, 0))
        w = tl.where(ok, tl.exp2(lse - m_new), 0.0)
        part = tl.load(part_ptr + (base + ss)[:, None] * V + offs_v[None, :],
                       mask=ok[:, None] & mask_v[None, :], other=0.0)
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    o = acc / tl.where(den > 0, den, 1.0)  # a row that sees no key (position < 0) gets zeros
    tl.store(out_ptr + b.to(tl.int64) * s_ob + r * s_or + offs_v, o.to(out_ptr.dtype.element_ty),
             mask=mask_v)


def _check_inputs(q, kv_buffer, req_to_token, req_pool_indices, positions, v_dim):
    if q.dim() != 3 or kv_buffer.dim() != 2 or kv_buffer.shape[1] != q.shape[2]:
        raise ValueError(f"mla_decode_fwd: expected q [B, N*H, Dk] and kv_buffer [slots, Dk], got "
                         f"{tuple(q.shape)} and {tuple(kv_buffer.shape)}")
    b, rows, dk = q.shape
    if positions.dim() != 2 or positions.shape[0] != b or positions.shape[1] < 1 \
            or rows % positions.shape[1]:
        raise ValueError(f"mla_decode_fwd: positions must be [B={b}, N] with N dividing the "
                         f"{rows} query rows, got {tuple(positions.shape)}")
    if req_to_token.dim() != 2 or tuple(req_pool_indices.shape) != (b,):
        raise ValueError(f"mla_decode_fwd: expected req_to_token [reqs, cap] and req_pool_indices "
                         f"[{b}], got {tuple(req_to_token.shape)} and "
                         f"{tuple(req_pool_indices.shape)}")
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("positions", positions)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"mla_decode_fwd: {name} must be an integer tensor, got {t.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) \
            or not kv_buffer.is_floating_point():
        raise ValueError(f"mla_decode_fwd: q must be fp32/fp16/bf16 and kv_buffer floating, got "
                         f"{q.dtype} and {kv_buffer.dtype}")
    if INTERPRETED and torch.bfloat16 in (q.dtype, kv_buffer.dtype):
        raise ValueError("mla_decode_fwd: Triton's interpreter does not support bf16; "
                         "use fp32 or fp16 with TRITON_INTERPRET=1")
    if not 0 < v_dim <= dk:
        raise ValueError(f"mla_decode_fwd: v_dim {v_dim} must be in 1..{dk}")
    if q.stride(2) != 1 or kv_buffer.stride(1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("mla_decode_fwd: the last dim of q, kv_buffer and req_to_token must be "
                         "contiguous")
    for name, t in (("kv_buffer", kv_buffer), ("req_to_token", req_to_token),
                    ("req_pool_indices", req_pool_indices), ("positions", positions)):
        if t.device != q.device:
            raise ValueError(f"mla_decode_fwd: {name} is on {t.device}, q on {q.device}")


def mla_decode_fwd(q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor,
                   req_pool_indices: torch.Tensor, positions: torch.Tensor, v_dim: int,
                   scale: float, num_splits: Optional[int] = None,
                   out: Optional[torch.Tensor] = None,
                   scratch: Optional[torch.Tensor] = None,
                   split_len: Optional[int] = None) -> torch.Tensor:
    """Attention of ``N`` query tokens per request over that request's latent cache rows.

    See the module docstring for the layout. ``positions [B, N]`` (integer, device) gives each
    query token's absolute position; it sees keys ``0 .. positions[b, n]`` (clamped to the
    capacity ``req_to_token.shape[1]``; a negative position sees nothing and yields zeros).
    ``num_splits`` defaults to :func:`mla_decode_num_splits` (shapes only). ``out`` (``[B, N*H,
    v_dim]`` in q's dtype) and ``scratch`` (fp32, contiguous, at least
    :func:`mla_decode_scratch_numel` elements) may be preallocated so that a CUDA graph reuses
    them; the launches read no device value on the host. ``split_len`` (with ``num_splits``,
    both from :func:`mla_decode_batch_invariant_split`) fixes the split boundaries so that a
    query row's result does not depend on the other rows or requests of the launch. Returns
    ``out``.
    """
    _check_inputs(q, kv_buffer, req_to_token, req_pool_indices, positions, v_dim)
    b, rows, dk = q.shape
    n = positions.shape[1]
    cap = req_to_token.shape[1]
    if split_len is not None and num_splits is None:
        raise ValueError("mla_decode_fwd: split_len needs num_splits (both from "
                         "mla_decode_batch_invariant_split)")
    if num_splits is None:
        num_splits = mla_decode_num_splits(b, rows, cap, dk, q.device)
    elif not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"mla_decode_fwd: num_splits must be an int in 1..{MAX_SPLITS}, "
                         f"got {num_splits!r}")
    if split_len is not None and (not isinstance(split_len, int) or split_len < 1
                                  or num_splits * split_len < cap):
        raise ValueError(f"mla_decode_fwd: {num_splits} splits of split_len {split_len!r} must "
                         f"cover the capacity {cap}")
    if out is None:
        out = torch.empty(b, rows, v_dim, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (b, rows, v_dim) or out.dtype != q.dtype or out.stride(2) != 1 \
            or out.device != q.device:
        raise ValueError(f"mla_decode_fwd: out must be [{b}, {rows}, {v_dim}] {q.dtype} on "
                         f"{q.device} with a contiguous last dim, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    need = mla_decode_scratch_numel(b, rows, num_splits, v_dim)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=q.device)
    elif scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < need \
            or scratch.device != q.device:
        raise ValueError(f"mla_decode_fwd: scratch must be a contiguous fp32 tensor on {q.device} "
                         f"with at least {need} elements, got {scratch.dtype} "
                         f"{tuple(scratch.shape)} on {scratch.device}")
    if b == 0:
        return out
    flat = scratch.view(-1)
    part = flat[:b * rows * num_splits * v_dim]
    lse = flat[b * rows * num_splits * v_dim:need]
    cfg = _config(dk)
    rope = dk - v_dim
    # fp32 inputs: exact products (tl.dot would use tf32 on the GPU); 16-bit inputs ignore it.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    req_pool_indices = req_pool_indices.contiguous()  # indexed densely by request
    common = dict(BLOCK_V=max(16, triton.next_power_of_2(v_dim)), BLOCK_N=cfg.block_n,
                  BLOCK_T=triton.next_power_of_2(n), SPLIT_MIN=cfg.split_min,
                  FIXED_SPLIT=split_len or 0)
    launch = {} if INTERPRETED else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block_h = _rows_per_program(cfg, rows, batch_invariant=split_len is not None)
    grid = (b, triton.cdiv(rows, block_h), num_splits)
    pdl_on = pdl.use_pdl(b * n)  # the query tokens; the same for both launches
    _mla_split_kernel[grid](
        q, kv_buffer, req_to_token, req_pool_indices, positions, part, lse,
        n, rows // n, rows, cap, num_splits, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), kv_buffer.stride(0), req_to_token.stride(0),
        positions.stride(0), positions.stride(1),
        V=v_dim, DR=rope, BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h,
        PRECISION=precision, USE_PDL=pdl_on, **common, **launch, **pdl.launch_options(pdl_on))
    merge_v = min(cfg.merge_block_v, common["BLOCK_V"])
    _mla_merge_kernel[(b, rows, triton.cdiv(v_dim, merge_v))](
        part, lse, positions, out, n, rows // n, rows, cap, num_splits,
        positions.stride(0), positions.stride(1), out.stride(0), out.stride(1),
        V=v_dim, BLOCK_S=cfg.block_s, MERGE_V=merge_v, USE_PDL=pdl_on, **common,
        **({} if INTERPRETED else dict(num_warps=4)), **pdl.launch_options(pdl_on))
    return out
