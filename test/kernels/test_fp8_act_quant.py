"""sgl_kernel.fp8_act_quant (activations to fp8 per token and 128-column group) against its torch
rule.

Without CUDA the kernel runs in Triton's CPU interpreter (where it rounds to the e4m3 grid in fp32
before its cast: the interpreter's own cast misrounds); compiled or interpreted, the kernel and the
rule agree bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton

pytestmark = needs_triton


@pytest.fixture(scope="module")
def aq():
    import sgl_kernel.fp8_act_quant as module

    return module


def _check_close(q: torch.Tensor, ref_q: torch.Tensor) -> None:
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), \
        float((q.float() - ref_q.float()).abs().max())


@pytest.mark.parametrize("m,k,dtype", [(37, 256, torch.float32), (5, 200, torch.float16),
                                       (130, 128, torch.float32), (1, 64, torch.float16)])
def test_matches_the_rule(aq, m, k, dtype):
    """Scales and values exactly the rule's (amax / 448 per row and 128 columns, a ragged last
    group included, ties and subnormals as torch's cast rounds them)."""
    gen = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 30).to(dtype)
    x[0, :16] = 0  # a group may hold zeros; a whole zero group is below
    if k >= 256:
        x[1, 128:256] = 0
    x = x.to(DEVICE)
    q, s = aq.per_token_group_quant_fp8(x)
    ref_q, ref_s = aq.per_token_group_quant_fp8_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (m, -(-k // 128)) and q.shape == (m, k)
    assert torch.equal(s, ref_s)
    _check_close(q, ref_q)
    if k >= 256:
        assert float(s[1, 1]) == 1.0 and bool((q[1, 128:256].float() == 0).all())
    # Dequantised, within half an e4m3 step (16 at the top binade) of x, in units of scale.
    back = aq.group_dequantize(q, s)
    assert float(((back - x.float()).abs() / s.repeat_interleave(128, -1)[:, :k]).max()) <= 16


def test_rounding_ties_and_subnormals(aq):
    """With scale 1 (amax 448): a carry into the next binade (124.3 -> 128), ties to even
    (124 -> 128, 116 -> 112), e4m3 subnormals (2^-9 steps) and a tie between them."""
    vals = [448.0, 124.3, 124.0, 116.0, -0.0019, 1.5 * 2.0 ** -9, 2.0 ** -10, -2.5 * 2.0 ** -9]
    x = torch.tensor([vals + [0.0] * (128 - len(vals))], device=DEVICE)
    q, s = aq.per_token_group_quant_fp8(x)
    assert float(s) == 1.0
    want = [448.0, 128.0, 128.0, 112.0, -2.0 ** -9, 2.0 ** -8, 0.0, -2.0 ** -8]
    assert q[0, :len(vals)].float().tolist() == want
    _check_close(q, aq.per_token_group_quant_fp8_reference(x)[0])


def test_group_size_and_out_buffers(aq):
    """Another group size; results written into given buffers (as a CUDA graph needs)."""
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = torch.empty(9, 96, dtype=torch.float8_e4m3fn, device=DEVICE)
    out_s = torch.empty(9, 3, dtype=torch.float32, device=DEVICE)
    q, s = aq.per_token_group_quant_fp8(x, 32, out=out, out_scale=out_s)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == out_s.data_ptr()
    ref_q, ref_s = aq.per_token_group_quant_fp8_reference(x, 32)
    assert torch.equal(s, ref_s)
    _check_close(q, ref_q)
    # The scales outer-dim-major (stride (1, M')) and the rows the first 9 of a taller buffer,
    # as the library's block-scaled GEMM takes them: the same values, written in place.
    col = torch.full((3, 16), -1.0, device=DEVICE).t()
    q2, s2 = aq.per_token_group_quant_fp8(x, 32, out=torch.empty_like(out), out_scale=col[:9])
    assert s2.stride() == (1, 16) and torch.equal(s2, ref_s) and torch.equal(q2, q)
    assert bool((col[9:] == -1.0).all())  # rows past the 9 untouched


def test_rejects_bad_inputs(aq):
    with pytest.raises(ValueError, match="contiguous last dim"):
        aq.per_token_group_quant_fp8(torch.randn(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        aq.per_token_group_quant_fp8(torch.zeros(4, 128, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        aq.per_token_group_quant_fp8(torch.randn(4, 128, device=DEVICE), 100)
    with pytest.raises(ValueError, match="out_scale fp32"):
        aq.per_token_group_quant_fp8(torch.randn(4, 128, device=DEVICE),
                                     out_scale=torch.empty(4, 2, device=DEVICE))


@pytest.mark.parametrize("block_m,num_warps", [(16, 4), (32, 2), (128, 8)])
def test_tiles_give_the_same_bits(aq, block_m, num_warps):
    """The tiling knobs (rows per program, warps) change no value: a ragged row count and
    last group, against the rule; a block_m that is not a power of two is refused."""
    x = (torch.randn(45, 200, generator=torch.Generator().manual_seed(7)) * 5).to(DEVICE)
    q, s = aq.per_token_group_quant_fp8(x, block_m=block_m, num_warps=num_warps)
    ref_q, ref_s = aq.per_token_group_quant_fp8_reference(x)
    assert torch.equal(s, ref_s)
    _check_close(q, ref_q)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        aq.per_token_group_quant_fp8(x, block_m=24)


def test_empty(aq):
    q, s = aq.per_token_group_quant_fp8(torch.empty(0, 256, device=DEVICE))
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_bf16_bit_equal_on_cuda(aq):
    """bf16 activations of a prefill's width (2560): bit-equal to the rule on the GPU."""
    x = torch.randn(1000, 2560, device="cuda", dtype=torch.bfloat16) * 3
    ref_q, ref_s = aq.per_token_group_quant_fp8_reference(x)
    for block_m, warps in ((None, 4), (64, 4), (128, 8)):  # the default and larger tiles
        q, s = aq.per_token_group_quant_fp8(x, block_m=block_m, num_warps=warps)
        assert torch.equal(s, ref_s)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
