"""The MoE router after its logits GEMM, in one kernel: sigmoid scores, bias-corrected
group-limited top-k selection, unbiased weights (renormalised, scaled).

Per token (one program, all ``E`` experts in registers), the rule of docs/model.md §5.1 as
:func:`sglang.srt.layers.moe.topk.select_experts` computes it::

    p = sigmoid(logits);  s = p + bias
    group score = best s + second-best s of each of the G groups (the best alone when a group
    has one expert); the topk_group best stay
    ids = the k best s among the experts of the kept groups (best first)
    w = p[ids], / (sum + 1e-20) if renormalize, * routed_scaling_factor

The torch version is about twenty kernels per MoE layer (sigmoid, add, two topk, zeros,
scatter, expand, masked fill, gather, sum, div, mul, ...); Ling-3.0-flash has 41 MoE layers.
Selections are made by repeated argmax (the first index wins a tie; ``torch.topk`` leaves ties
unspecified). ``E`` and ``E / G`` must be powers of two (Flash: 512 experts, 8 groups).
Decode-sized launches use PDL (:mod:`sgl_kernel.pdl`): the bias is read before the wait.

One warp per program (:data:`NUM_WARPS`): a token's work is ~25 reductions over 512 values
(group scores, the group picks, k argmaxes), each on the critical path of the decode step; in
one warp a reduction is register shuffles, across four it also needs shared memory and block
barriers (timed in ``benchmark/kernels/tune_moe_router.py``). Every reduction picks or adds the
same values either way (the selections are argmaxes, first index on ties; each weight is one
``p``), except the renormalising sum of the ``k`` weights, whose order may differ.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import compiler_options

__all__ = ["moe_router_topk", "router_kernel_supports", "NUM_WARPS", "REFERENCE_NOTE"]

NUM_WARPS = 1  # warps per token's program (module docstring)
REFERENCE_NOTE = ("reference: sglang.srt.layers.moe.topk.select_experts (the rule of "
                  "docs/model.md §5.1), compared in test/kernels/test_moe_router.py")


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, s_logits, s_bias, scale,
                   E: tl.constexpr, G: tl.constexpr, PG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   GROUPED: tl.constexpr, RENORM: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E)
    # The bias is a parameter (read in place, never copied on the host, so no kernel of the step
    # writes it): with PDL its load overlaps the logits GEMM's tail. The logits come after.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs * s_bias).to(tl.float32)
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    p = tl.sigmoid(tl.load(logits_ptr + row * s_logits + offs).to(tl.float32))
    s = p
    if HAS_BIAS:
        s = p + bias
    neg = float("-inf")
    if GROUPED:
        cols = tl.arange(0, PG)
        s2 = tl.reshape(s, [G, PG])
        gscore = tl.max(s2, axis=1)
        if PG > 1:  # a group's score is its best two (its only one when it has one expert)
            first = tl.argmax(s2, axis=1)
            gscore += tl.max(tl.where(cols[None, :] == first[:, None], neg, s2), axis=1)
        gidx = tl.arange(0, G)
        keep = gidx < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=0)
            keep = keep | (gidx == g)
            gscore = tl.where(gidx == g, neg, gscore)
        keep_e = tl.reshape(tl.broadcast_to(keep[:, None], [G, PG]), [E])
        s = tl.where(keep_e, s, neg)
    kidx = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(K):
        j = tl.argmax(s, axis=0)
        w = tl.where(kidx == i, tl.sum(tl.where(offs == j, p, 0.0), axis=0), w)
        ids = tl.where(kidx == i, j.to(tl.int64), ids)
        s = tl.where(offs == j, neg, s)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scale
    kmask = kidx < K
    tl.store(w_ptr + row * K + kidx, w, mask=kmask)
    tl.store(ids_ptr + row * K + kidx, ids, mask=kmask)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def router_kernel_supports(num_experts: int, num_expert_group: int) -> bool:
    """Whether the kernel's power-of-two register layout fits this router."""
    return _pow2(num_experts) and _pow2(num_expert_group) and num_expert_group <= num_experts


def moe_router_topk(router_logits: torch.Tensor, top_k: int,
                    expert_bias: Optional[torch.Tensor] = None, num_expert_group: int = 1,
                    topk_group: int = 1, renormalize: bool = True,
                    routed_scaling_factor: float = 1.0, num_warps: int = NUM_WARPS
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k] fp32, topk_ids [T, k] int64)`` from ``router_logits [T, E]``;
    the arguments are :func:`~sglang.srt.layers.moe.topk.select_experts`'s (``num_warps``:
    the launch's, for the benchmark)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not router_kernel_supports(e, num_expert_group):
        raise ValueError(f"moe_router_topk: {e} experts in {num_expert_group} groups (both must "
                         f"be powers of two)")
    if not 1 <= topk_group <= num_expert_group or not 1 <= top_k <= e:
        raise ValueError(f"moe_router_topk: bad topk_group {topk_group} / top_k {top_k} for "
                         f"{num_expert_group} groups of {e} experts")
    if expert_bias is not None and (tuple(expert_bias.shape) != (e,)
                                    or not expert_bias.is_floating_point()):
        raise ValueError(f"moe_router_topk: expert_bias must be a float [{e}], got "
                         f"{tuple(expert_bias.shape)} {expert_bias.dtype}")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        # The bias goes in as it is (any float dtype and stride; the kernel widens it to fp32 as
        # ``.float()`` would): a host-side copy would be a kernel writing it within the step.
        bias = expert_bias if expert_bias is not None else logits
        pdl_on = pdl.use_pdl(t)
        _router_kernel[(t,)](
            logits, bias, weights, ids, logits.stride(0),
            bias.stride(0) if expert_bias is not None else 0, float(routed_scaling_factor),
            E=e, G=num_expert_group, PG=e // num_expert_group, TOPK_GROUP=topk_group, K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), HAS_BIAS=expert_bias is not None,
            GROUPED=num_expert_group > 1 and topk_group < num_expert_group,
            RENORM=renormalize, USE_PDL=pdl_on, **compiler_options(num_warps, None),
            **pdl.launch_options(pdl_on))
    return weights, ids
