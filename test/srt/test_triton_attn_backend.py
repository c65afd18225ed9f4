"""TritonMLABackend equals TorchNativeMLABackend over real pools: DECODE, TARGET_VERIFY and the
chain DRAFT_EXTEND on the Triton kernel, the rest on the torch path. Without CUDA the kernel runs
in Triton's CPU interpreter (test/conftest.py sets TRITON_INTERPRET=1), fp32 pools."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeMLABackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import (
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.rounds.chain import assign_chain_req_to_token, build_verify_forward_batch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1 set before triton is imported (test/conftest.py)")

H, R, DR = 4, 32, 16  # heads, kv_lora_rank (value dim), rope dim
DK = R + DR
LAYER = 3
TOL = 1e-5


def _triton_backend():
    from sglang.srt.layers.attention.triton_backend import TritonMLABackend

    return TritonMLABackend()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the backend's calls of the Triton kernel (so a torch fallback cannot pass for it)."""
    import sglang.srt.layers.attention.triton_backend as mod

    class Calls(list):
        """Positions shape of each call; ``scratch``: the scratch tensor each call was given."""

    calls = Calls()
    calls.scratch = []
    real = mod.mla_decode_fwd

    def counting(*args, **kwargs):
        calls.append(args[4].shape)  # positions [B, N]
        calls.scratch.append(kwargs.get("scratch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "mla_decode_fwd", counting)
    return calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


class Pools:
    """Requests with random cached prefixes in real pools (slot 0 / request row 0: padding)."""

    def __init__(self, prefixes, cap=64, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.layer = RadixAttention(LAYER, H, R, DR, scaling=1.0 / math.sqrt(24.0))
        self.req_pool = ReqToTokenPool(len(prefixes) + 1, cap, DEVICE)
        self.alloc = TokenToKVPoolAllocator(len(prefixes) * cap, DEVICE)
        self.kv_pool = MLATokenToKVPool(len(prefixes) * cap, [LAYER], R, DR, torch.float32, DEVICE)
        self.slots = self.req_pool.alloc(len(prefixes))
        self.prefixes = list(prefixes)
        for slot, p in zip(self.slots, prefixes):
            loc = self.alloc.alloc(p)
            self.req_pool.write(slot, 0, loc)
            self.kv_pool.set_kv_buffer(LAYER, loc, self.randn(p, DK))

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(DEVICE)

    def run(self, backend, fb, q, k, save=True):
        """One layer call on a copy of the KV pool; the output and the layer's buffer after."""
        fb = copy.copy(fb)
        fb.token_to_kv_pool = copy.deepcopy(self.kv_pool)
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        out = self.layer(q, k, fb, save_kv_cache=save)
        return out, fb.token_to_kv_pool.get_kv_buffer(LAYER)

    def decode_batch(self, pad: int = 0, **kw) -> ForwardBatch:
        """One new token per request (seq_len = prefix + 1), then ``pad`` padding rows."""
        b = len(self.slots)
        loc = torch.cat([self.alloc.alloc(b), torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
        for i, slot in enumerate(self.slots):
            self.req_pool.write(slot, self.prefixes[i], loc[i:i + 1])
        seq_lens = torch.tensor(self.prefixes + [0] * pad, device=DEVICE) + 1
        rpi = torch.tensor(self.slots + [0] * pad, device=DEVICE)
        return ForwardBatch.for_decode(torch.zeros(b + pad, dtype=torch.int64, device=DEVICE), rpi,
                                       seq_lens, loc, req_to_token_pool=self.req_pool,
                                       token_to_kv_pool=self.kv_pool, **kw)

    def verify_batch(self, n: int, pad: int = 0, **kw) -> ForwardBatch:
        """A chain of ``n`` tokens per request after its prefix, then ``pad`` padding requests."""
        b = len(self.slots)
        loc = torch.cat([self.alloc.alloc(b * n).view(b, n),
                         torch.zeros(pad, n, dtype=torch.int64, device=DEVICE)])
        rpi = torch.tensor(self.slots + [0] * pad, device=DEVICE)
        prefix = torch.tensor(self.prefixes + [0] * pad, device=DEVICE)
        assign_chain_req_to_token(self.req_pool.req_to_token, rpi, prefix, loc)
        return build_verify_forward_batch(torch.zeros(b + pad, n, dtype=torch.int64, device=DEVICE),
                                          rpi, prefix, loc, req_to_token_pool=self.req_pool,
                                          token_to_kv_pool=self.kv_pool, **kw)


def test_decode_equals_torch_native(kernel_calls):
    """Prefixes 0, 16 and 39 (a length crossing the interpreter's 16-key splits) and a padding
    row; the Triton result ignores ``seq_lens_upper_bound`` (here far too small for the torch
    gather, which gets the right one)."""
    pools = Pools([0, 16, 39])
    fb = pools.decode_batch(pad=1)
    q, k = pools.randn(4, H, DK), pools.randn(4, DK)
    ref, ref_buf = pools.run(TorchNativeMLABackend(), fb, q, k)
    wrong_bound = copy.copy(fb)
    wrong_bound.seq_lens_upper_bound = 2
    out, buf = pools.run(_triton_backend(), wrong_bound, q, k)
    assert out.shape == (4, H, R) and kernel_calls == [(4, 1)]
    assert _rel(out, ref) < TOL
    assert torch.equal(buf, ref_buf)  # the same rows written at out_cache_loc


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND])
def test_chain_equals_torch_native(mode, kernel_calls):
    """N = 3 per request (12 query rows: a partial 16-row block), chains straddling a split
    boundary, and a padding request. The padding request's three tokens all write slot 0, so
    only the torch path (which attends to each token's own k) gives it per-token keys: it is
    excluded from the comparison."""
    pools = Pools([1, 14, 37], seed=1)
    fb = pools.verify_batch(3, pad=1)
    fb.forward_mode = mode
    q, k = pools.randn(12, H, DK), pools.randn(12, DK)
    ref, ref_buf = pools.run(TorchNativeMLABackend(), fb, q, k)
    out, buf = pools.run(_triton_backend(), fb, q, k)
    assert kernel_calls == [(4, 3)]
    assert _rel(out[:9], ref[:9]) < TOL
    assert torch.equal(buf[1:], ref_buf[1:])


def test_without_saving_kv_cache_takes_the_torch_path(kernel_calls):
    """save_kv_cache=False: the new token is attended to, the cache is left alone."""
    pools = Pools([5, 20], seed=2)
    fb = pools.decode_batch()
    q, k = pools.randn(2, H, DK), pools.randn(2, DK)
    ref, _ = pools.run(TorchNativeMLABackend(), fb, q, k, save=False)
    out, buf = pools.run(_triton_backend(), fb, q, k, save=False)
    assert _rel(out, ref) < TOL and not kernel_calls
    assert torch.equal(buf, pools.kv_pool.get_kv_buffer(LAYER))


def test_prefill_extend_equals_torch_native(kernel_calls):
    pools = Pools([3], seed=3)
    slot = pools.slots[0]
    loc = pools.alloc.alloc(4)
    pools.req_pool.write(slot, 3, loc)
    fb = ForwardBatch.for_extend(torch.zeros(4, dtype=torch.int64, device=DEVICE), [slot], [3],
                                 [4], loc, req_to_token_pool=pools.req_pool,
                                 token_to_kv_pool=pools.kv_pool)
    q, k = pools.randn(4, H, DK), pools.randn(4, DK)
    ref, _ = pools.run(TorchNativeMLABackend(), fb, q, k)
    out, _ = pools.run(_triton_backend(), fb, q, k)
    assert _rel(out, ref) < TOL and not kernel_calls


def test_cuda_graph_state_keeps_one_scratch(kernel_calls):
    """After init_cuda_graph_state every kernel call reuses one preallocated split scratch, for
    decode and verify batches of different lengths; the capture hook checks the batch fits."""
    backend = _triton_backend()
    assert backend.supports_cuda_graph and backend.width_independent
    assert not TorchNativeMLABackend.width_independent  # graphs keyed by a width bucket
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=8)
    for prefixes, n in (([2, 9], 1), ([30, 44], 1), ([7, 25], 3)):
        pools = Pools(prefixes, seed=sum(prefixes))
        fb = pools.decode_batch() if n == 1 else pools.verify_batch(n)
        q, k = pools.randn(2 * n, H, DK), pools.randn(2 * n, DK)
        ref, _ = pools.run(TorchNativeMLABackend(), fb, q, k)
        out, _ = pools.run(backend, fb, q, k)
        assert _rel(out, ref) < TOL
    assert len(kernel_calls) == 3 and all(t is backend._scratch for t in kernel_calls.scratch)
    rpi, lens = torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(2, 8, rpi[:2], lens[:2],
                                                     ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="does not fit"):
        backend.init_forward_metadata_capture_cuda_graph(4, 12, rpi, lens,
                                                         ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="captures"):
        backend.init_forward_metadata_capture_cuda_graph(1, 1, rpi[:1], lens[:1],
                                                         ForwardMode.EXTEND)
