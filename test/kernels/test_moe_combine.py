"""sgl_kernel.moe_combine against its torch reference (the torch-native MoE's combine): equal bit
for bit, with and without the shared expert's row, in the interpreter (fp32 / fp16) and on CUDA
(bf16)."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton

pytestmark = needs_triton

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shared", [False, True])
def test_combine_equals_reference_bitwise(dtype, with_shared):
    from sgl_kernel.moe_combine import moe_combine, moe_combine_reference

    gen = torch.Generator().manual_seed(1)
    t, k, h = 3, 5, 70  # h not a power of two: masked tail
    y = torch.randn(t * k + t, h, generator=gen).to(DEVICE, dtype)  # shared rows after
    weights = torch.rand(t, k, generator=gen).to(DEVICE)
    shared = y[t * k:] if with_shared else None
    got = moe_combine(y, weights, shared)
    assert got.dtype == dtype and got.shape == (t, h)
    assert torch.equal(got, moe_combine_reference(y, weights, shared))
    close = (y[:t * k].float().view(t, k, h) * weights.unsqueeze(-1)).sum(1)
    if with_shared:
        close = close + shared.float()
    assert torch.allclose(got.float(), close, rtol=1e-2, atol=1e-2)


def test_combine_rejects_bad_shapes():
    from sgl_kernel.moe_combine import moe_combine

    with pytest.raises(ValueError, match="y must be"):
        moe_combine(torch.randn(5, 8), torch.rand(3, 2))
    with pytest.raises(ValueError, match="shared must be"):
        moe_combine(torch.randn(6, 8), torch.rand(3, 2), torch.randn(2, 8))
