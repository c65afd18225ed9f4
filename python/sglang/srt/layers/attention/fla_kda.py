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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA over a flattened batch of ``N`` sequences with fla's chunked kernel.

    ``q, k [T, H, K]`` (L2-normalised), ``v [T, H, V]``, ``g [T, H, K]`` natural-log decay,
    ``beta [T, H]``, ``initial_state [N, H, K, V]`` fp32, ``seq_lens`` host lengths (sum ``T``);
    ``cu_seqlens`` (int64 ``[N+1]`` on q's device) may be passed to skip building it.
    Returns ``(o [T, H, V] in q's dtype, final_state [N, H, K, V] fp32)``.
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
    o, final_state = chunk_kda(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0),
        beta.float().unsqueeze(0),
        scale=scale,
        initial_state=initial_state.contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu_seqlens,
        # The host copy lets fla build its chunk index without reading cu_seqlens back.
        cu_seqlens_cpu=cu_cpu,
    )
    return o.squeeze(0).to(q.dtype), final_state.float()
