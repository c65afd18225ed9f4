"""RMSNorm in one kernel per call: optionally fused with the residual add before it and with an
activated gate after it (the KDA output norm).

Per row::

    h = x + residual                      (rounded to x's dtype, as the unfused add is)
    y = h * rsqrt(mean(h^2) + eps) * w     (fp32)
    y = y * act(gate)                      (act = sigmoid or silu, fp32; optional)

The torch-native norm is six or seven kernels (cast, square, mean, add, rsqrt, two or three
multiplies, cast), and a decode step of Ling-3.0-flash runs over a hundred norms: in a
launch-bound batch-1 step each saved launch counts. Up to :data:`TILE_MIN_ROWS` rows each row
is one program, so a row rounds the same whatever the batch (a NEXTN verify row and the decode
of the same token agree). Decode-sized launches use PDL (:mod:`sgl_kernel.pdl`): the weight is
read before the wait. A prefill's narrow rows (KDA's output norm: 128 channels per head, so a
T-token prefill has 32 T rows; MLA's 512-wide latent norm) would make that one tiny program
per row, so launches of more rows than :data:`TILE_MIN_ROWS` with rows of at most
``_TILE_ELEMS // 2`` elements take several rows per program (:func:`tile_rows`), the same
arithmetic on a 2-D tile. References: :func:`sglang.srt.layers.layernorm.rms_norm` and
``GatedRMSNorm``.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl

__all__ = ["rmsnorm", "tile_rows", "GATE_ACTIVATIONS", "REFERENCE_NOTE", "TILE_MIN_ROWS"]

REFERENCE_NOTE = ("reference: sglang.srt.layers.layernorm.rms_norm / gated_rms_norm (the "
                  "engine's torch norms), compared in test/kernels/test_rmsnorm.py")

GATE_ACTIVATIONS = {None: 0, "sigmoid": 1, "swish": 2, "silu": 2}

# Launches of more rows than this may put several rows in a program (a prefill: a decode or
# verify launch, at most 64 tokens x 32 heads of KDA's output norm, stays one row per program).
TILE_MIN_ROWS = 4096
_TILE_ELEMS = 2048  # elements of a multi-row program's tile (rows x the power-of-2 row block)


@triton.jit
def _times_gate(y, g, GATE: tl.constexpr):
    """``y * act(g)`` (fp32): ``GATE`` 1 sigmoid, 2 swish (SiLU)."""
    if GATE == 1:
        return y * tl.sigmoid(g)
    return y * (g * tl.sigmoid(g))


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, gate_ptr, w_ptr, out_ptr, res_out_ptr, D,
                    s_x, s_res, s_gate, s_w, s_out, s_res_out, g_inner, s_gate_in, eps,
                    HAS_RES: tl.constexpr, GATE: tl.constexpr, USE_PDL: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    # The weight is a parameter no kernel of the step writes: with PDL its load overlaps the
    # previous kernel's tail. x, residual and gate are activations: read only after the wait.
    w = tl.load(w_ptr + offs * s_w, mask=mask, other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * s_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_res_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    y = y * w
    if GATE != 0:
        # Gate row ``row`` is row ``row % g_inner`` of block ``row // g_inner``: the heads of
        # a token inside a wider fused projection output, read where they lie.
        g_row = (row // g_inner) * s_gate + (row % g_inner) * s_gate_in
        g = tl.load(gate_ptr + g_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = _times_gate(y, g, GATE)
    tl.store(out_ptr + row * s_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_tile_kernel(x_ptr, res_ptr, gate_ptr, w_ptr, out_ptr, res_out_ptr, D,
                         s_x, s_res, s_gate, s_w, s_out, s_res_out, g_inner, s_gate_in, eps, R,
                         HAS_RES: tl.constexpr, GATE: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    """``_rmsnorm_kernel`` on ``ROWS`` rows per program (prefill-sized launches, no PDL)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < D
    mask = (rows < R)[:, None] & col_ok[None, :]
    w = tl.load(w_ptr + offs * s_w, mask=col_ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * s_x + offs[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * s_res + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * s_res_out + offs[None, :], x, mask=mask)
    h = x.to(tl.float32)
    y = h * tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)[:, None]
    y = y * w[None, :]
    if GATE != 0:
        g_row = (rows // g_inner) * s_gate + (rows % g_inner) * s_gate_in
        g = tl.load(gate_ptr + g_row[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        y = _times_gate(y, g, GATE)
    tl.store(out_ptr + rows[:, None] * s_out + offs[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def tile_rows(rows: int, d: int) -> int:
    """Rows per program of a launch over ``rows`` rows of ``d`` elements: 1 up to
    :data:`TILE_MIN_ROWS` rows (batch-invariant decode and verify) and for rows wider than
    half a tile, else as many as fill a tile of ``_TILE_ELEMS`` elements."""
    if rows <= TILE_MIN_ROWS:
        return 1
    return max(1, _TILE_ELEMS // triton.next_power_of_2(d))


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as ``[rows, d]`` with a unit last stride (a copy only when it has to be)."""
    t = t.reshape(-1, d)
    return t if t.stride(1) == 1 else t.contiguous()


def _gate_rows(t: torch.Tensor, d: int) -> Tuple[torch.Tensor, int, int, int]:
    """``(tensor, inner rows, outer stride, inner stride)`` addressing the rows of ``t``
    (``[..., d]``) as blocks of its second-to-last dim, so that a ``[T, H, d]`` view of a column
    slice of a wider tensor (KDA's output gate inside the fused projection) is read in place,
    where flattening it to ``[T * H, d]`` would copy it."""
    if t.dim() >= 3 and t.stride(-1) == 1:
        blocks = t.reshape(-1, t.shape[-2], d)  # a view when the leading dims merge
        return blocks, blocks.shape[1], blocks.stride(0), blocks.stride(1)
    rows = _rows(t, d)
    return rows, 1, rows.stride(0), 0


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
            activation: Optional[str] = None
            ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm over the last dim (``weight [D]``) in one launch.

    With ``residual`` (``x``'s shape and dtype) returns ``(norm(x + residual), x + residual)``;
    with ``gate`` (``x``'s shape) and ``activation`` (``sigmoid`` or ``swish``/``silu``) the
    output is multiplied by ``act(gate)``. Outputs are new tensors in ``x``'s dtype and shape.
    """
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rmsnorm: weight must be [{d}], got {tuple(weight.shape)}")
    if activation not in GATE_ACTIVATIONS or (gate is None) != (activation is None):
        raise ValueError(f"rmsnorm: give gate and activation together (activation in "
                         f"{[a for a in GATE_ACTIVATIONS if a]}), got activation={activation!r}")
    for name, t in (("residual", residual), ("gate", gate)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"rmsnorm: {name} must have x's shape {tuple(x.shape)}, got "
                             f"{tuple(t.shape)}")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"rmsnorm: residual dtype {residual.dtype} != x dtype {x.dtype}")
    x2 = _rows(x, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = _rows(residual, d) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    gate2, g_inner, s_gate, s_gate_in = (_gate_rows(gate, d) if gate is not None
                                         else (x2, 1, x2.stride(0), 0))
    rows = x2.shape[0]
    per_program = tile_rows(rows, d)
    args = (x2, res2, gate2, weight, out, res_out, d, x2.stride(0), res2.stride(0), s_gate,
            weight.stride(0), out.stride(0), res_out.stride(0), g_inner, s_gate_in, float(eps))
    consts = dict(HAS_RES=residual is not None, GATE=GATE_ACTIVATIONS[activation],
                  BLOCK=triton.next_power_of_2(d))
    if rows and per_program > 1:
        _rmsnorm_tile_kernel[(triton.cdiv(rows, per_program),)](*args, rows, ROWS=per_program,
                                                                **consts)
    elif rows:
        pdl_on = pdl.use_pdl(rows)
        _rmsnorm_kernel[(rows,)](*args, USE_PDL=pdl_on, **consts, **pdl.launch_options(pdl_on))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)
