"""``--attention-backend`` names and the factory that builds the hybrid MLA + KDA backend."""
from __future__ import annotations

from typing import Optional

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.torch_native_backend import (
    KDA_PREFILL_IMPLS,
    TorchNativeKDABackend,
    TorchNativeMLABackend,
)
from sglang.srt.configs.engine_defaults import ATTENTION_BACKEND_CHOICES, KERNEL_BACKEND_CHOICES

ATTENTION_BACKENDS = ATTENTION_BACKEND_CHOICES


def create_attn_backend(name: str, *, kda_prefill_impl: str = "auto",
                        linear_attn_decode_backend: str = "auto",
                        batch_invariant: bool = False,
                        invariant_span: Optional[int] = None) -> AttentionBackend:
    """Build the attention backend called ``name`` for a hybrid KDA + MLA model.

    * ``"torch_native"``: plain PyTorch for both MLA and KDA, the reference. Here ``"auto"`` means
      the pure torch KDA prefill; pass ``kda_prefill_impl="fla"`` to use fla-core's ``chunk_kda``.
    * ``"triton"``: MLA decode, target verify and draft extend through the Triton kernel of
      :class:`~sglang.srt.layers.attention.triton_backend.TritonMLABackend` (lengths read on the
      device: one CUDA graph per batch size serves every length; prefill stays torch), and with
      ``"auto"`` the KDA prefill through fla-core's ``chunk_kda`` whenever CUDA and fla are
      available (torch otherwise). ``"torch"`` / ``"fla"`` are honoured as given.

    ``linear_attn_decode_backend`` picks the KDA decode / verify recurrence: ``"triton"``
    (``sgl_kernel.kda_recurrent``; CUDA, or Triton's interpreter on CPU) or the torch step
    (``"torch_native"``; the model runner resolves ``"auto"`` by device first, and an unresolved
    ``"auto"`` here means the torch step).

    ``batch_invariant`` (``--enable-deterministic-inference``): the Triton MLA kernel splits
    the keys at fixed boundaries, so a token's attention does not depend on the launch's other
    rows (the torch MLA path is the reference and makes no such promise); ``invariant_span``
    (the runner's context length) sets them, so that a plain and a speculative runner of one
    model, whose request maps differ in width, split alike.
    """
    if linear_attn_decode_backend not in KERNEL_BACKEND_CHOICES:
        raise ValueError(f"linear_attn_decode_backend must be one of {KERNEL_BACKEND_CHOICES}, "
                         f"got {linear_attn_decode_backend!r}")
    recurrent = "triton" if linear_attn_decode_backend == "triton" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choices: {', '.join(ATTENTION_BACKENDS)}")
    if kda_prefill_impl not in KDA_PREFILL_IMPLS:
        raise ValueError(f"kda_prefill_impl must be one of {KDA_PREFILL_IMPLS}, got {kda_prefill_impl!r}")
    if name == "torch_native" and kda_prefill_impl == "auto":
        kda_prefill_impl = "torch"
    kda = TorchNativeKDABackend(kda_prefill_impl=kda_prefill_impl, recurrent_impl=recurrent)
    if name == "triton":
        from sglang.srt.layers.attention.triton_backend import TritonMLABackend  # imports triton

        return HybridLinearAttnBackend(
            TritonMLABackend(batch_invariant=batch_invariant, invariant_span=invariant_span), kda)
    return HybridLinearAttnBackend(TorchNativeMLABackend(), kda)
