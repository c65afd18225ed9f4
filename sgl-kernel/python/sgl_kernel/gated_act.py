"""Gated activations in one launch: the dense MLP's SwiGLU and MLA's sigmoid head gate.

* :func:`silu_and_mul`: ``x = [gate | up]`` (``[T, 2I]``) -> ``silu(gate) * up`` (``[T, I]``),
  with Ling's clamp when ``limit > 0``: ``min(silu(gate), limit) * clamp(up, -limit, limit)``.
* :func:`sigmoid_head_gate`: ``o [T, h, v]`` scaled per (token, head) by ``sigmoid(g [T, h])``.

Both compute in fp32 and round once to the input's dtype, as their torch forms
(``sglang.srt.layers.activation``) do; those forms are five to seven element-wise launches
each (two upcasts, the activation, the clamps, the product, the downcast) and write fp32
intermediates. ``silu(x)`` is ``x * sigmoid(x)``, the form of the grouped MoE kernels'
SwiGLU epilogue (``moe_grouped_gemm``, ``grouped_gemv``). Rows are independent, so a token's
result does not depend on the rows beside it (the batch-invariant decode path may use both).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import INTERPRETED

__all__ = ["silu_and_mul", "silu_and_mul_reference", "sigmoid_head_gate",
           "sigmoid_head_gate_reference"]

# Elements a program covers along a row (fixed per kernel: nothing to choose between launches).
_BLOCK = 1024
_GATE_ELEMENTS = 4096


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_inter, stride_x, stride_o, limit,
                         HAS_LIMIT: tl.constexpr, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    row = x_ptr + t * stride_x
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + n_inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = gate * tl.sigmoid(gate)
    if HAS_LIMIT:
        act = tl.minimum(act, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(out_ptr + t * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, limit: float = 0.0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T, 2I]`` (gate columns, then up columns; rows may be strided, the last dim must be
    contiguous) -> ``[T, I]`` in x's dtype; ``limit > 0`` clamps as the module docstring says."""
    if x.dim() != 2 or x.shape[1] % 2 or (x.shape[1] and x.stride(1) != 1):
        raise ValueError(f"silu_and_mul: x must be [T, 2I] with a contiguous last dim, "
                         f"got {tuple(x.shape)} (strides {tuple(x.stride())})")
    if limit < 0:
        raise ValueError(f"silu_and_mul: limit must be >= 0, got {limit}")
    t, n_inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(t, n_inter, dtype=x.dtype, device=x.device)
    if t == 0 or n_inter == 0:
        return out
    block = triton.next_power_of_2(n_inter) if INTERPRETED else _BLOCK
    pdl_on = pdl.use_pdl(t)
    _silu_and_mul_kernel[(t, triton.cdiv(n_inter, block))](
        x, out, n_inter, x.stride(0), out.stride(0), float(limit), HAS_LIMIT=limit > 0,
        USE_PDL=pdl_on, BLOCK=block, **pdl.launch_options(pdl_on))
    return out


def silu_and_mul_reference(x: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """Plain-torch :func:`silu_and_mul` in the kernel's form (``gate * sigmoid(gate)`` in fp32,
    the clamps, one rounding)."""
    n_inter = x.shape[-1] // 2
    gate, up = x[..., :n_inter].float(), x[..., n_inter:].float()
    act = gate * torch.sigmoid(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (act * up).to(x.dtype)


@triton.jit
def _sigmoid_head_gate_kernel(o_ptr, g_ptr, out_ptr, n_heads, v_dim, stride_ot, stride_oh,
                              stride_gt, stride_ut, stride_uh, USE_PDL: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_V)
    head_mask = heads < n_heads
    mask = head_mask[:, None] & (cols[None, :] < v_dim)
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    g = tl.load(g_ptr + t * stride_gt + heads, mask=head_mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    y = o * tl.sigmoid(g)[:, None]
    tl.store(out_ptr + t * stride_ut + heads[:, None] * stride_uh + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_head_gate(o: torch.Tensor, g: torch.Tensor,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``o [T, h, v]`` (any token and head strides, contiguous last dim) times
    ``sigmoid(g [T, h])`` broadcast over ``v``: a new contiguous ``[T, h, v]`` in o's dtype."""
    if o.dim() != 3 or (o.shape[2] and o.stride(2) != 1):
        raise ValueError(f"sigmoid_head_gate: o must be [T, h, v] with a contiguous last dim, "
                         f"got {tuple(o.shape)} (strides {tuple(o.stride())})")
    t, h, v = o.shape
    if g.dim() != 2 or tuple(g.shape) != (t, h) or (h and g.stride(1) != 1):
        raise ValueError(f"sigmoid_head_gate: g must be [{t}, {h}] with a contiguous last dim, "
                         f"got {tuple(g.shape)}")
    if out is None:
        out = torch.empty(t, h, v, dtype=o.dtype, device=o.device)
    if out.numel() == 0:
        return out
    block_v = triton.next_power_of_2(v)
    block_h = triton.next_power_of_2(h) if INTERPRETED else max(
        1, min(triton.next_power_of_2(h), _GATE_ELEMENTS // block_v))
    pdl_on = pdl.use_pdl(t)
    _sigmoid_head_gate_kernel[(t, triton.cdiv(h, block_h))](
        o, g, out, h, v, o.stride(0), o.stride(1), g.stride(0), out.stride(0), out.stride(1),
        USE_PDL=pdl_on, BLOCK_H=block_h, BLOCK_V=block_v, **pdl.launch_options(pdl_on))
    return out


def sigmoid_head_gate_reference(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Plain-torch :func:`sigmoid_head_gate`: fp32 product, one rounding to o's dtype."""
    return (o.float() * torch.sigmoid(g.float()).unsqueeze(-1)).to(o.dtype)
