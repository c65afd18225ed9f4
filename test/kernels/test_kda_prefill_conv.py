"""sgl_kernel.kda_prefill_conv (KDA short conv + SiLU over one request's prefill, window written
back in place) against kda_ops.causal_conv1d followed by the backend's pool copy. Without CUDA
the kernel runs in Triton's CPU interpreter (fp32 / fp16: the interpreter has no bf16); the
bf16 test at the model's width needs CUDA."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import pytest
import torch

from kernel_test_utils import DEVICE, needs_triton

from sglang.srt.layers.attention.kda_ops import causal_conv1d

pytestmark = needs_triton
KW, S, SLOT = 4, 3, 1  # conv width, pool slots, the request's slot


def _inputs(t: int, c: int, dtype: torch.dtype, pool_dtype: torch.dtype, seed: int = 0,
            device: str = DEVICE) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` as a column block of a wider projection output (strided rows), the conv weight,
    and a pool ``[S, C, K-1]`` whose slot ``SLOT`` is the request's window."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, c + 40, generator=g).to(device=device, dtype=dtype)
    x = wide[:, 24:24 + c]
    weight = (0.5 * torch.randn(c, KW, generator=g)).to(device=device, dtype=dtype)
    pool = torch.randn(S, c, KW - 1, generator=g).to(device=device, dtype=pool_dtype)
    return x, weight, pool


def _reference(x, weight, pool):
    """The backend's torch path: causal_conv1d from the slot, then the pool copy."""
    ref_pool = pool.clone()
    y, window = causal_conv1d(x, weight, ref_pool[SLOT])
    ref_pool[SLOT].copy_(window)
    return y, ref_pool


def _check(x, weight, pool, **tiles):
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    y_ref, pool_ref = _reference(x, weight, pool)
    got_pool = pool.clone()
    y = kda_prefill_conv(x, weight, got_pool[SLOT], **tiles)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    if x.dtype == torch.float32:
        # Pre-activation bit-equal; the CPU reference's vectorised exp may differ in the last bit.
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    else:  # one fp16 rounding at most, and almost always none
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -10, atol=2 ** -14)
        assert (y != y_ref).float().mean().item() < 0.02
    # The window is copies only: exact, and the other slots are untouched.
    assert torch.equal(got_pool, pool_ref)


@pytest.mark.parametrize("t", [1, 2, 3, 5, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_causal_conv1d(t, dtype):
    # C = 80 over 64-wide channel blocks: a masked channel tail.
    x, weight, pool = _inputs(t, 80, dtype, dtype, seed=t)
    _check(x, weight, pool)


@pytest.mark.parametrize("t", [2, 37])
def test_fp32_pre_activation_is_bit_equal(t):
    """The taps are summed in the reference's order (bit-equal fp32 pre-activation); only the
    SiLU's exp differs from torch's CPU kernel, so against the same formula over the
    reference's pre-activation with numpy's exp (the interpreter's) the kernel is exact."""
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    x, weight, pool = _inputs(t, 80, torch.float32, torch.float32, seed=30 + t)
    xs = torch.cat([pool[SLOT].t(), x], dim=0)
    pre = torch.zeros(t, 80, device=DEVICE)
    for i in range(KW):
        pre += xs[i:i + t] * weight[:, i]
    got = kda_prefill_conv(x, weight, pool[SLOT])
    if pre.is_cuda:  # libdevice's expf is CUDA's (both: no fast math); asserted to ~1 ulp here
        torch.testing.assert_close(got, pre / (1.0 + torch.exp(-pre)), rtol=2.5e-7, atol=0.0)
    else:
        a = pre.numpy()
        assert torch.equal(got, torch.from_numpy(a / (np.float32(1.0) + np.exp(-a))))


@pytest.mark.parametrize("t", [1, 2, 5, 37])
def test_small_token_blocks(t):
    """block_t = 3 rounds up to 4 (>= K-1): many token blocks; only block 0 reads the window."""
    x, weight, pool = _inputs(t, 48, torch.float32, torch.float32, seed=10 + t)
    _check(x, weight, pool, block_t=3, block_c=16)


@pytest.mark.parametrize("t", [1, 2, 6])
def test_window_rounds_through_x_dtype(t):
    """An fp32 pool under fp16 inputs: the kept old entries (T < K-1) pass through fp16, as the
    reference's returned window does before the pool copy."""
    x, weight, pool = _inputs(t, 48, torch.float16, torch.float32, seed=20 + t)
    _check(x, weight, pool)


def _heads_l2norm(y: torch.Tensor, d: int) -> torch.Tensor:
    """fla's l2norm per ``d``-wide head of the rounded conv output, in fp32, rounded once."""
    x = y.float().view(y.shape[0], -1, d)
    return (x * (1 / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))).view_as(y).to(y.dtype)


@pytest.mark.parametrize("t", [1, 3, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,block_c", [(16, None), (32, 16)])
def test_heads_l2norm(t, dtype, head_dim, block_c):
    """``l2norm_head_dim``: each head of the output (body and head rows) is the reference
    conv's output normalised by fla's formula; a channel block narrower than a head is widened
    to one. The window is the plain conv's."""
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    x, weight, pool = _inputs(t, 64, dtype, dtype, seed=40 + t)
    y_ref, pool_ref = _reference(x, weight, pool)
    got_pool = pool.clone()
    y = kda_prefill_conv(x, weight, got_pool[SLOT], block_c=block_c, l2norm_head_dim=head_dim)
    want = _heads_l2norm(y_ref, head_dim)
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    else:  # an fp16 rounding of the conv may move the norm by an ulp
        torch.testing.assert_close(y.float(), want.float(), rtol=2 ** -9, atol=2 ** -12)
    norms = y.float().view(t, -1, head_dim).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=2e-3, atol=2e-3)
    assert torch.equal(got_pool, pool_ref)


def test_out_and_empty():
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    x, weight, pool = _inputs(9, 48, torch.float32, torch.float32, seed=3)
    y_ref, pool_ref = _reference(x, weight, pool)
    big = torch.full((12, 48), 7.0, device=DEVICE)
    got = kda_prefill_conv(x, weight, pool[SLOT], out=big[2:11])
    assert got.data_ptr() == big[2].data_ptr()
    torch.testing.assert_close(big[2:11], y_ref, rtol=1e-6, atol=1e-6)
    assert (big[:2] == 7).all() and (big[11:] == 7).all()
    assert torch.equal(pool, pool_ref)
    before = pool.clone()
    assert kda_prefill_conv(x[:0], weight, pool[SLOT]).shape == (0, 48)
    assert torch.equal(pool, before)  # T = 0: nothing launched, window kept


def test_bad_inputs_are_rejected():
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    x, weight, pool = _inputs(4, 48, torch.float32, torch.float32)
    with pytest.raises(ValueError):
        kda_prefill_conv(x.t(), weight, pool[SLOT])  # last dim not contiguous
    with pytest.raises(ValueError):
        kda_prefill_conv(x, weight[:, :3], pool[SLOT])  # window width != K-1
    with pytest.raises(ValueError):
        kda_prefill_conv(x, weight, pool[SLOT], out=torch.empty(4, 48, dtype=torch.float16,
                                                                device=DEVICE))
    for head_dim in (12, 32):  # not a power of two; does not divide 48 channels
        with pytest.raises(ValueError, match="l2norm_head_dim"):
            kda_prefill_conv(x, weight, pool[SLOT], l2norm_head_dim=head_dim)


@pytest.mark.gpu
def test_bf16_model_width_on_cuda():
    """Ling-3.0-flash's width (3 x 32 heads x 128) over an 8 K-token prefill, bf16."""
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    x, weight, pool = _inputs(8192, 12288, torch.bfloat16, torch.bfloat16, device="cuda")
    y_ref, pool_ref = _reference(x, weight, pool)
    got_pool = pool.clone()
    y = kda_prefill_conv(x, weight, got_pool[SLOT])
    # Within one bf16 rounding (same pre-activation; exp may differ in fp32's last bit).
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=1e-6)
    assert (y != y_ref).float().mean().item() < 0.01
    assert torch.equal(got_pool, pool_ref)
    # With the q / k heads' L2 norm as the fla prefill runs it: within a bf16 rounding of the
    # reference conv's output normalised by fla's formula.
    q = x[:, :4096]
    yq = kda_prefill_conv(q, weight[:4096], pool[SLOT][:4096].clone(), l2norm_head_dim=128)
    want = _heads_l2norm(y_ref[:, :4096], 128)
    torch.testing.assert_close(yq.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert (yq != want).float().mean().item() < 0.01


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter-mode choice; CUDA always uses it")
def test_backend_extend_uses_the_kernel_under_the_interpreter(monkeypatch):
    """TorchNativeKDABackend's extend with the Triton decode kernels on (interpreter): one kernel
    call per request with tokens, the same windows as the torch path bit for bit, the same
    outputs within the SiLU's last-bit difference; the torch backend keeps the torch conv."""
    import sgl_kernel.kda_prefill_conv as mod

    from sglang.srt.layers.attention.attention_registry import create_attn_backend
    from sglang.srt.layers.radix_attention import RadixLinearAttention
    from sglang.srt.mem_cache.memory_pool import KDAStatePool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    h, d = 2, 8
    c = h * d
    calls = []
    real = mod.kda_prefill_conv
    monkeypatch.setattr(mod, "kda_prefill_conv",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(3 * c, KW, generator=gen) * 0.5
    lens = [[2, 7], [1, 0, 2, 20]]  # two extends; the second starts from non-zero windows
    data = [torch.randn(sum(n), 3 * c + h + c, generator=gen) for n in lens]
    results = {}
    for decode in ("torch_native", "triton"):
        backend = create_attn_backend("torch_native", linear_attn_decode_backend=decode)
        layer = RadixLinearAttention(layer_id=0, num_heads=h, head_dim=d, conv_kernel=KW)
        layer.conv_weight.data.copy_(weight)
        req_pool = ReqToTokenPool(4, 64, "cpu")
        pool = KDAStatePool(4, [0], h, d, d, KW, torch.float32, "cpu")
        slots = req_pool.alloc(4)
        pool.clear_slots(slots)
        outs, prefix = [], [0, 0, 0, 0]
        calls.clear()
        for step, (n, fused) in enumerate(zip(lens, data)):
            reqs = slots[:len(n)]
            t = sum(n)
            q, k, v, beta, g = torch.split(fused, [c, c, c, h, c], dim=-1)
            fb = ForwardBatch.for_extend(torch.zeros(t, dtype=torch.int64), reqs,
                                         prefix[:len(n)], n, torch.arange(1, t + 1),
                                         req_to_token_pool=req_pool, kda_state_pool=pool)
            fb.attn_backend = backend
            backend.init_forward_metadata(fb)
            outs.append(layer(q, k, v, -torch.sigmoid(g).view(t, h, d), torch.sigmoid(beta), fb))
            prefix = [p + m for p, m in zip(prefix, n)] + prefix[len(n):]
        results[decode] = (torch.cat(outs), pool.get_conv_state(0)[slots].clone(), list(calls))
    out_t, conv_t, calls_t = results["torch_native"]
    out_k, conv_k, calls_k = results["triton"]
    assert calls_t == [] and calls_k == [2, 7, 1, 2, 20]
    assert torch.equal(conv_k, conv_t)
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-5)
