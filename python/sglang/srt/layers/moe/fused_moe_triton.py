"""Routed (and shared) experts for a few tokens with Triton grouped mat-vecs
(``--moe-runner-backend triton``).

Same math and roundings as :func:`~sglang.srt.layers.moe.fused_moe_native.fused_moe_gather` (the
reference): ``h13 = W13[e] x`` rounded to the model dtype, the (clamped) SwiGLU of
:func:`~sglang.srt.layers.activation.silu_and_mul` in fp32 (here in the up-projection's
epilogue), ``y = W2[e] act`` rounded, then the fp32 weighted combine with the shared expert's row,
rounded once. The difference is where the weights are read: in place by
:func:`sgl_kernel.grouped_gemv.grouped_gemv`, instead of being gathered into a copy first, with
the shared expert as one more pair per token of the same two launches when its weights have the
routed experts' shape. Three launches for the whole block (up, down, combine); device work only,
no host sync, shapes fixed by ``T``: usable inside the NEXTN round and CUDA graphs.

Above :data:`SMALL_M_MAX_PAIRS` (token, expert) pairs (prefill chunks) every pair re-reading its
expert no longer pays: :func:`fused_moe_grouped` sorts the pairs by expert on the device and runs
two grouped GEMMs (:mod:`sgl_kernel.moe_grouped_gemm`), each expert read once per column tile,
block-fp8 experts read as stored; the same roundings, no host sync, any batch size capturable.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from sglang.srt.layers.moe.fused_moe_native import check_moe_inputs, combine_expert_outputs

__all__ = ["fused_moe_small_m", "fused_moe_grouped", "SharedExpertWeights",
           "SMALL_M_MAX_PAIRS"]

# 128 tokens x top-8: decode and NEXTN verify batches; beyond, per-expert GEMMs win.
SMALL_M_MAX_PAIRS = 1024


class SharedExpertWeights(NamedTuple):
    """The shared expert as extra pairs: ``w13 [2I, H]`` (gate rows then up rows, the routed
    experts' layout), ``w2 [H, I]``, its SwiGLU clamp (0 = none) and, for block-fp8 weights,
    their block scales."""

    w13: torch.Tensor
    w2: torch.Tensor
    limit: float
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None


def fused_moe_small_m(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float = 0.0,
                      shared_weights: Optional[SharedExpertWeights] = None,
                      shared: Optional[torch.Tensor] = None,
                      combine_kernel: bool = True, w13_scale: Optional[torch.Tensor] = None,
                      w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_i w_i * Expert_{id_i}(x) + Shared(x)`` per token ``[T, H]``.

    The shared expert either runs inside the two grouped mat-vecs (``shared_weights``) or was
    computed by the caller (``shared [T, H]``, added in the combine); with neither, routed only.
    ``combine_kernel`` picks the one-launch combine; else its torch reference (same result).
    Block-fp8 experts pass their scales (``w13_scale``, ``w2_scale``; ``sgl_kernel.fp8_blocks``).
    """
    from sgl_kernel.grouped_gemv import grouped_gemv  # Triton: imported on first use
    from sgl_kernel.moe_combine import moe_combine

    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    x = hidden.contiguous()
    sw = shared_weights if shared_weights is not None else SharedExpertWeights(None, None, 0.0)
    # Up-projection with SwiGLU in its epilogue -> [T*k (+ T), I]; then the down-projection.
    act = grouped_gemv(x, w13, ids, rows_per_x=k, swiglu_limit=limit, extra_w=sw.w13,
                       extra_limit=sw.limit, w_scale=w13_scale, extra_w_scale=sw.w13_scale)
    y = grouped_gemv(act[:t * k], w2, ids, extra_w=sw.w2, extra_x=act[t * k:],
                     w_scale=w2_scale, extra_w_scale=sw.w2_scale)
    if shared_weights is not None:
        shared = y[t * k:]
    if combine_kernel:
        return moe_combine(y, topk_weights, shared)
    return combine_expert_outputs(y[:t * k], topk_weights, shared)


def fused_moe_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float = 0.0,
                      shared: Optional[torch.Tensor] = None,
                      w13_scale: Optional[torch.Tensor] = None,
                      w2_scale: Optional[torch.Tensor] = None,
                      combine_kernel: bool = True, align_kernel: bool = False,
                      fp8_activations: bool = False,
                      shared_weights: Optional[SharedExpertWeights] = None) -> torch.Tensor:
    """``sum_i w_i * Expert_{id_i}(x) (+ shared)`` per token ``[T, H]`` for large batches.

    The pairs sorted by expert on the device (:func:`sgl_kernel.moe_align.moe_align`),
    the up-projection as a grouped GEMM with the (clamped) SwiGLU in its epilogue, the
    down-projection as another, both writing pair-major rows, then the fp32 combine with the
    router weights and the shared expert's output ``shared [T, H]`` (the one-launch kernel, or
    with ``combine_kernel=False`` its torch reference): the roundings of
    :func:`~sglang.srt.layers.moe.fused_moe_native.fused_moe_gather`. Block-fp8 experts pass
    their scales and are dequantised tile by tile inside the GEMMs. No host sync.
    ``align_kernel`` (``KernelChoices.moe_align_kernel``) sorts the pairs with
    :func:`sgl_kernel.moe_align.moe_align_triton` (three launches) instead of the torch ops:
    the same alignment bit for bit, so the same output. ``fp8_activations``
    (``KernelChoices.moe_fp8_activations``; block-fp8 experts only, ignored otherwise) quantises
    each GEMM's input per token and 128-column group and runs both GEMMs on the fp8 tensor
    cores (w8a8): the hidden states before the up-projection, the SwiGLU output (rounded to the
    model dtype first, as the weight-only path hands it on) before the down-projection, inside
    the up-projection's epilogue when its tiles are one 128-column group wide (the same values:
    ``moe_grouped_gemm``'s ``quantize_out``).
    ``shared_weights`` (instead of ``shared``): the shared expert as one more expert that every
    token is routed to with weight 1, its rows in the same two launches (no separate MLP), its
    output added in the combine as the routed ones are.
    """
    from sgl_kernel.moe_combine import moe_combine  # Triton: imported on first use
    from sgl_kernel.moe_align import moe_align_triton
    from sgl_kernel.moe_grouped_gemm import (launch_config, moe_align, moe_grouped_gemm,
                                             quantizes_out)

    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    if shared_weights is not None and shared is not None:
        raise ValueError("fused_moe_grouped: give the shared expert's output or its weights")
    e = w13.shape[0]
    ids, up_sh, down_sh = topk_ids, {}, {}
    if shared_weights is not None:  # expert id e: every token's one more pair, weight 1
        ids = torch.cat([topk_ids, topk_ids.new_full((topk_ids.shape[0], 1), e)], dim=1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_ones(
            topk_weights.shape[0], 1)], dim=1)
        up_sh = dict(shared_w=shared_weights.w13, shared_scale=shared_weights.w13_scale,
                     shared_limit=shared_weights.limit)
        down_sh = dict(shared_w=shared_weights.w2, shared_scale=shared_weights.w2_scale)
    t, k = ids.shape
    fp8 = w13_scale is not None
    act_fp8 = fp8 and fp8_activations
    x = hidden.contiguous()
    up_cfg = launch_config(e, w13.shape[1], w13.shape[2], t * k, fp8, x.device, swiglu=True,
                           act_fp8=act_fp8)
    down_cfg = launch_config(e, w2.shape[1], w2.shape[2], t * k, fp8, x.device,
                             act_fp8=act_fp8)
    align = moe_align_triton if align_kernel else moe_align
    n_align = e + (shared_weights is not None)
    up_align = align(ids, n_align, up_cfg.block_m)
    # The two tables may pick different row blocks: each GEMM gets the padding its tiles need.
    down_align = (up_align if down_cfg.block_m == up_cfg.block_m
                  else align(ids, n_align, down_cfg.block_m))
    if act_fp8:
        from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8

        xq, xs = per_token_group_quant_fp8(x)
        if quantizes_out(up_cfg, swiglu=True):  # the SwiGLU output quantised in the epilogue
            aq, as_ = moe_grouped_gemm(xq, w13, up_align, rows_per_x=k, swiglu=True,
                                       swiglu_limit=limit, w_scale=w13_scale, config=up_cfg,
                                       x_scale=xs, out_dtype=x.dtype, quantize_out=True,
                                       **up_sh)
        else:
            act = moe_grouped_gemm(xq, w13, up_align, rows_per_x=k, swiglu=True,
                                   swiglu_limit=limit, w_scale=w13_scale, config=up_cfg,
                                   x_scale=xs, out_dtype=x.dtype, **up_sh)  # [T*k, I]
            aq, as_ = per_token_group_quant_fp8(act)
        y = moe_grouped_gemm(aq, w2, down_align, rows_per_x=1, swiglu=False, w_scale=w2_scale,
                             config=down_cfg, x_scale=as_, out_dtype=x.dtype,
                             **down_sh)  # [T*k, H]
    else:
        act = moe_grouped_gemm(x, w13, up_align, rows_per_x=k, swiglu=True, swiglu_limit=limit,
                               w_scale=w13_scale, config=up_cfg, **up_sh)  # [T*k, I]
        y = moe_grouped_gemm(act, w2, down_align, rows_per_x=1, swiglu=False, w_scale=w2_scale,
                             config=down_cfg, **down_sh)  # [T*k, H]
    if combine_kernel:
        return moe_combine(y, topk_weights, shared)
    return combine_expert_outputs(y, topk_weights, shared)
