"""Plain-PyTorch attention backends over the real pools: the reference every fast path matches.

The backends live in ``torch_native_mla`` and ``torch_native_kda``; this module keeps the import
path SGLang users and the registry use.

* :class:`TorchNativeMLABackend` — MLA over the latent cache of
  :class:`~sglang.srt.mem_cache.memory_pool.MLATokenToKVPool`: absorbed form (multi-query
  attention) for decode and verify, normal form (one fused attention per request) for prefill.
* :class:`TorchNativeKDABackend` — KDA over :class:`~sglang.srt.mem_cache.memory_pool.KDAStatePool`
  (short-conv window + fp32 recurrent state per request slot).

Both run on CPU and on CUDA. Decode, target verify and the chain-shaped draft extend work from
device tensors plus one host integer the engine computes without reading the device
(``ForwardBatch.seq_lens_upper_bound``, the width of the padded cache gather): MLA runs them as
one batched masked attention over each request's first ``bound`` cache rows. KDA target verify
(a fixed-width chain per request) stages per-position states in the pool's speculative scratch
and leaves the persistent state alone (stage, then commit).
"""
from __future__ import annotations

from sglang.srt.layers.attention.torch_native_kda import (  # noqa: F401
    KDA_PREFILL_IMPLS,
    KDA_RECURRENT_IMPLS,
    RECURRENT_MAX_TOKENS,
    TorchNativeKDABackend,
)
from sglang.srt.layers.attention.torch_native_mla import (  # noqa: F401
    MLA_NORMAL_FORM_MIN_TOKENS,
    TorchNativeMLABackend,
)

__all__ = ["TorchNativeMLABackend", "TorchNativeKDABackend", "KDA_PREFILL_IMPLS",
           "KDA_RECURRENT_IMPLS", "MLA_NORMAL_FORM_MIN_TOKENS", "RECURRENT_MAX_TOKENS"]
