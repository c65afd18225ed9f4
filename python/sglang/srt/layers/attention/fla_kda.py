"""Optional KDA prefill through fla-core's ``chunk_kda`` (imported lazily; CUDA only).

The package imports without fla: :func:`is_available` says whether the kernel can run here.
Convention shared with the torch path (``kda_ops``): the caller passes q and k already
L2-normalised (``use_qk_l2norm_in_kernel=False``), the precomputed natural-log decay ``g`` and the
post-sigmoid ``beta``; the state layout is FLA's default ``[N, H, K, V]`` fp32.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["is_available", "chunk_kda_varlen"]


@functools.lru_cache(maxsize=1)
def is_available() -> bool:
    """True when CUDA is usable and ``fla.ops.kda.chunk_kda`` imports."""
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return False
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception:  # broken / incompatible install: fall back to torch
        return False
    return True


def chunk_kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    seq_lens: Sequence[int],
    cu_seqlens: Optional[torch.Tensor] = None,
    l2norm_in_kernel: bool = False,
    gate_params: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[float]]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA over a flattened batch of ``N`` sequences with fla's chunked kernel.

    ``q, k [T, H, K]`` (L2-normalised), ``v [T, H, V]``, ``g [T, H, K]`` natural-log decay,
    ``beta [T, H]``, ``initial_state [N, H, K, V]`` fp32, ``seq_lens`` host lengths (sum ``T``);
    ``cu_seqlens`` (int64 ``[N+1]`` on q's device) may be passed to skip building it.
    With ``l2norm_in_kernel`` q and k come as they are and fla normalises them; with
    ``gate_params = (A_log [H], dt_bias [H * K], lower_bound)`` ``g`` is the raw gate projection
    and ``beta`` the raw beta logits, and fla forms the decay (``kda_ops.kda_gate``'s two forms:
    the safe gate with ``lower_bound``, else the softplus form) and the sigmoid in its kernels,
    with no fp32 copies of them in memory. Returns ``(o [T, H, V] in q's dtype, final_state
    [N, H, K, V] fp32)``.
    """
    if not is_available():
        raise RuntimeError("fla_kda.chunk_kda_varlen needs CUDA and fla-core (pip install fla-core)")
    from fla.ops.kda import chunk_kda

    n = len(seq_lens)
    if initial_state.shape[0] != n or initial_state.dtype != torch.float32:
        raise ValueError(f"chunk_kda_varlen: initial_state must be fp32 [{n}, H, K, V], got "
                         f"{initial_state.dtype} {tuple(initial_state.shape)}")
    if sum(seq_lens) != q.shape[0]:
        raise ValueError(f"chunk_kda_varlen: seq_lens sum to {sum(seq_lens)} but q has {q.shape[0]} rows")
    cu_cpu = torch.zeros(n + 1, dtype=torch.int64)
    cu_cpu[1:] = torch.tensor(list(seq_lens), dtype=torch.int64).cumsum(0)
    if cu_seqlens is None:
        cu_seqlens = cu_cpu.to(q.device, non_blocking=True)
    gate_kw = {}
    if gate_params is not None:
        a_log, dt_bias, lower_bound = gate_params
        gate_kw = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       A_log=a_log.float(), dt_bias=dt_bias.float(),
                       safe_gate=lower_bound is not None, lower_bound=lower_bound)
    else:
        g, beta = g.float(), beta.float()
    o, final_state = chunk_kda(
        q.contiguous().unsqueeze(0), k.contiguous().unsqueeze(0), v.contiguous().unsqueeze(0),
        g.contiguous().unsqueeze(0), beta.contiguous().unsqueeze(0),
        scale=scale,
        initial_state=initial_state.contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm_in_kernel,
        **gate_kw,
        cu_seqlens=cu_seqlens,
        # The host copy lets fla build its chunk index without reading cu_seqlens back.
        cu_seqlens_cpu=cu_cpu,
    )
    return o.squeeze(0).to(q.dtype), final_state.float()
