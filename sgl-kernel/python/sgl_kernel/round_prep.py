"""The index chain at the start of a decode / verify round, in one launch.

Every round begins by reading, for each request ``b`` in pool slot ``s = slots[b]``, its
committed length ``prefix = seq_lens[s]`` (and for plain decode its next input token
``tokens[s]``) from the per-slot relay, then recording the round's KV slots in the
request->token map::

    req_to_token[s, prefix + j] = loc[b, j]      for j < N

In torch that is a gather per field, an ``arange``, an add, an expand, a cast and an
``index_put`` -- five to seven graph nodes, each paying a launch's fixed cost to move a few
dozen bytes (the A/B: docs/performance.md, "Seams between replays"). Every request
writes the same number ``N`` of entries, so no prefix sum over rows is needed: each program
computes its own offsets. Reference: :func:`assign_round_cache_locs_ref` (the torch ops the
round workers use without this kernel). Decode-sized launches use PDL (:mod:`sgl_kernel.pdl`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl

__all__ = ["assign_round_cache_locs", "assign_round_cache_locs_ref"]


@triton.jit
def _assign_kernel(req_to_token_ptr, seq_lens_ptr, tokens_ptr, slots_ptr, loc_ptr, prefix_out_ptr,
                   tokens_out_ptr, s_r2t, N, HAS_TOKENS: tl.constexpr, USE_PDL: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # The relay (lengths, tokens) and the round's slots and locations are all written before
    # this kernel, and the map may still be read by the previous step's kernels.
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    prefix = tl.load(seq_lens_ptr + slot).to(tl.int64)
    tl.store(prefix_out_ptr + b, prefix)
    if HAS_TOKENS:
        tl.store(tokens_out_ptr + b, tl.load(tokens_ptr + slot))
    j = tl.arange(0, BLOCK_N)
    mask = j < N
    loc = tl.load(loc_ptr + b * N + j, mask=mask, other=0)
    tl.store(req_to_token_ptr + slot * s_r2t + prefix + j,
             loc.to(req_to_token_ptr.dtype.element_ty), mask=mask)


def _check(req_to_token: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
           loc: torch.Tensor, tokens: Optional[torch.Tensor]) -> None:
    b = slots.shape[0]
    if slots.dim() != 1 or loc.dim() != 2 or loc.shape[0] != b:
        raise ValueError(f"assign_round_cache_locs: slots must be [B] and loc [B, N], got "
                         f"{tuple(slots.shape)} and {tuple(loc.shape)}")
    if req_to_token.dim() != 2 or seq_lens.dim() != 1:
        raise ValueError(f"assign_round_cache_locs: req_to_token must be [slots, context] and "
                         f"seq_lens [slots], got {tuple(req_to_token.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    if tokens is not None and tokens.shape != seq_lens.shape:
        raise ValueError(f"assign_round_cache_locs: tokens {tuple(tokens.shape)} must match "
                         f"seq_lens {tuple(seq_lens.shape)}")


def assign_round_cache_locs_ref(req_to_token: torch.Tensor, seq_lens: torch.Tensor,
                                slots: torch.Tensor, loc: torch.Tensor,
                                tokens: Optional[torch.Tensor] = None
                                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The torch reference: ``(prefix [B] int64, tokens[slots] or None)``, and the map written.
    Positions ``prefix + j`` must be inside the map (the scheduler's admission guarantees it)."""
    _check(req_to_token, seq_lens, slots, loc, tokens)
    prefix = seq_lens[slots].to(torch.int64)
    cols = prefix.unsqueeze(1) + torch.arange(loc.shape[1], device=loc.device)
    rows = slots.to(torch.int64).unsqueeze(1).expand_as(cols)
    req_to_token[rows, cols] = loc.to(req_to_token.dtype)
    return prefix, None if tokens is None else tokens[slots]


def assign_round_cache_locs(req_to_token: torch.Tensor, seq_lens: torch.Tensor,
                            slots: torch.Tensor, loc: torch.Tensor,
                            tokens: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`assign_round_cache_locs_ref` in one kernel launch (one program per request).
    ``slots`` and ``loc`` must be contiguous (they are the round's static inputs)."""
    _check(req_to_token, seq_lens, slots, loc, tokens)
    if req_to_token.stride(1) != 1 or not (slots.is_contiguous() and loc.is_contiguous()):
        raise ValueError("assign_round_cache_locs: req_to_token rows, slots and loc must be "
                         "contiguous")
    b, n = loc.shape
    prefix = torch.empty(b, dtype=torch.int64, device=slots.device)
    tokens_out = None if tokens is None else torch.empty(b, dtype=tokens.dtype, device=slots.device)
    if b:
        pdl_on = pdl.use_pdl(b)
        _assign_kernel[(b,)](req_to_token, seq_lens, tokens if tokens is not None else seq_lens,
                             slots, loc, prefix, tokens_out if tokens_out is not None else prefix,
                             req_to_token.stride(0), n, HAS_TOKENS=tokens is not None,
                             USE_PDL=pdl_on, BLOCK_N=triton.next_power_of_2(max(n, 1)),
                             **pdl.launch_options(pdl_on))
    return prefix, tokens_out
