"""Optional KDA prefill through fla-core's ``chunk_kda`` (imported lazily; CUDA only).

The package imports without fla: :func:`is_available` says whether the kernel can run here.
Convention shared with the torch path (``kda_ops``): the caller passes q and k already
L2-normalised (``use_qk_l2norm_in_kernel=False``), the precomputed natural-log decay ``g`` and the
post-sigmoid ``beta``; the state layout is FLA's default ``[N, H, K, V]`` fp32.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["is_available", "chunk_kda_varlen", "contiguous_by_words", "FlaVarlen", "fla_varlen",
           "fla_varlen_captured"]


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


@dataclass(frozen=True)
class FlaVarlen:
    """The varlen arguments of one extend batch, built once per forward and passed to every KDA
    layer of it.

    fla builds its chunk index from ``cu_seqlens`` behind a cache keyed by the *identity* of the
    tensors it is given, and each build ends in a blocking host-to-device copy (a stream sync).
    Fresh tensors per layer meant two syncs per KDA layer, each draining the GPU queue before the
    host could launch more; the same objects for every layer make it one build per forward.
    """

    lens: Tuple[int, ...]  # tokens per sequence (all > 0)
    cu_seqlens: torch.Tensor  # int64 [N + 1] on the device
    cu_seqlens_cpu: Optional[torch.Tensor]  # the same values on the host (None: captured)
    slots: torch.Tensor  # int64 [N] state-pool slots on the device
    host_slots: Tuple[int, ...]  # the same slots on the host (empty: captured)
    # Built for a captured graph (fla_varlen_captured): nothing read from or copied to the
    # host, fla builds its chunk index on the device, the sequences start from the zero state.
    captured: bool = False


def fla_varlen(lens: Sequence[int], slots: Sequence[int], device: torch.device) -> FlaVarlen:
    """:class:`FlaVarlen` for sequences of ``lens`` tokens in state slots ``slots``. On CUDA the
    host copies are pinned, so their uploads are asynchronous (no stream sync)."""
    if len(lens) != len(slots):
        raise ValueError(f"fla_varlen: {len(lens)} lengths for {len(slots)} slots")
    pin = torch.device(device).type == "cuda"
    host = torch.tensor([0, *lens, *slots], dtype=torch.int64, pin_memory=pin)
    n = len(lens)
    cu_cpu = host[:n + 1].cumsum(0)
    both = host.to(device, non_blocking=True)
    return FlaVarlen(tuple(int(x) for x in lens), both[:n + 1].cumsum(0), cu_cpu, both[n + 1:],
                     tuple(int(x) for x in slots))


def fla_varlen_captured(num_tokens: int, slot: torch.Tensor) -> FlaVarlen:
    """One fresh sequence of ``num_tokens`` rows whose state goes to pool slot ``slot`` (int64
    ``[1]`` on the device), for a forward that a CUDA graph captures. A capture forbids host
    copies, and fla's identity-keyed chunk-index cache would hand the graph a tensor that a
    later eviction frees; so ``cu_seqlens`` is made by a device kernel and ``chunk_kda`` builds
    its chunk index on the device at every replay (its ``use_graph`` mode)."""
    cu = torch.arange(0, num_tokens + 1, max(num_tokens, 1), dtype=torch.int64,
                      device=slot.device)
    return FlaVarlen((num_tokens,), cu, None, slot, (), captured=True)


def contiguous_by_words(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, the same bytes, moved as 8-byte words where ``t``'s layout allows.

    fla makes every input contiguous, and the gate's raw projection is a column block of the
    fused q|k|v|b|f|g output: a strided 2-byte copy, which torch runs element by element (a
    quarter of an 8-byte element's work per thread step; docs/performance.md, "Where an
    8192-token prefill copies"). Viewed as int64 (the last dim contiguous, its bytes, the other
    strides and the offset multiples of 8, as torch's view checks) the copy moves a quarter of
    the elements; anything else takes ``contiguous()`` itself."""
    if t.is_contiguous():
        return t
    if t.element_size() >= 8:  # already words
        return t.contiguous()
    try:
        words = t.view(torch.int64)
    except RuntimeError:  # a layout the int64 view refuses
        return t.contiguous()
    return words.contiguous().view(t.dtype)


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
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    l2norm_in_kernel: bool = False,
    gate_params: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[float]]] = None,
    captured: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA over a flattened batch of ``N`` sequences with fla's chunked kernel.

    ``q, k [T, H, K]`` (L2-normalised), ``v [T, H, V]``, ``g [T, H, K]`` natural-log decay,
    ``beta [T, H]``, ``initial_state [N, H, K, V]`` fp32, ``seq_lens`` host lengths (sum ``T``);
    ``cu_seqlens`` (int64 ``[N+1]`` on q's device) and its host copy ``cu_seqlens_cpu`` may be
    passed (from :class:`FlaVarlen`, the same objects for every layer of a forward) to skip
    building them and let fla reuse its chunk index.
    With ``l2norm_in_kernel`` q and k come as they are and fla normalises them; with
    ``gate_params = (A_log [H], dt_bias [H * K], lower_bound)`` ``g`` is the raw gate projection
    and ``beta`` the raw beta logits, and fla forms the decay (``kda_ops.kda_gate``'s two forms:
    the safe gate with ``lower_bound``, else the softplus form) and the sigmoid in its kernels,
    with no fp32 copies of them in memory. ``captured``: ``cu_seqlens`` (given, without a host
    copy) is all fla gets, and it builds its chunk index on the device (fla's ``use_graph``), so
    that a CUDA graph can capture the call. Returns ``(o [T, H, V] in q's dtype, final_state
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
    graph_kw = {}
    if captured:
        if cu_seqlens is None or cu_seqlens_cpu is not None:
            raise ValueError("chunk_kda_varlen: a captured call takes cu_seqlens on the device "
                             "and no host copy")
        graph_kw = dict(use_graph=True, max_num_seqs=n)
    elif (cu_seqlens is None) != (cu_seqlens_cpu is None):
        raise ValueError("chunk_kda_varlen: pass cu_seqlens and cu_seqlens_cpu together")
    if cu_seqlens is None:
        varlen = fla_varlen(seq_lens, range(n), q.device)
        cu_seqlens, cu_seqlens_cpu = varlen.cu_seqlens, varlen.cu_seqlens_cpu
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
        contiguous_by_words(g).unsqueeze(0), contiguous_by_words(beta).unsqueeze(0),
        scale=scale,
        initial_state=initial_state.contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm_in_kernel,
        **gate_kw,
        **graph_kw,
        cu_seqlens=cu_seqlens,
        # The host copy lets fla build its chunk index without reading cu_seqlens back.
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return o.squeeze(0).to(q.dtype), final_state.float()
