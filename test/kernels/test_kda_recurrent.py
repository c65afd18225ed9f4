"""sgl_kernel.kda_recurrent (KDA decode / chain-verify recurrence) against its torch reference, and
through the attention backend. Without CUDA the kernel runs in Triton's CPU interpreter (fp32)."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, needs_triton

pytestmark = needs_triton


def _inputs(b=3, n=4, h=2, dk=24, dv=20, slots=6, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def l2(x):
        return x / x.norm(dim=-1, keepdim=True)

    t = dict(device=DEVICE)
    q, k = l2(torch.randn(b, n, h, dk, generator=gen)).to(**t), l2(torch.randn(b, n, h, dk, generator=gen)).to(**t)
    v = torch.randn(b, n, h, dv, generator=gen).to(**t)
    g = (-torch.rand(b, n, h, dk, generator=gen)).to(**t)
    beta = torch.rand(b, n, h, generator=gen).to(**t)
    pool = torch.randn(slots, h, dk, dv, generator=gen).to(**t)
    # A column of a host-built [B, 3] table, as the scheduler's decode batch passes it: strided.
    slots = torch.tensor([[9, 4, 9], [9, 1, 9], [9, 0, 9]], device=DEVICE)[:b, 1]
    return q, k, v, g, beta, pool, slots


@pytest.mark.parametrize("stage,block_v", [  # block_v 8: several value tiles (ragged last)
    (True, 8), (False, None), pytest.param(False, 8, marks=pytest.mark.slow),
    pytest.param(True, None, marks=pytest.mark.slow),
])
def test_matches_reference(stage, block_v):
    from sgl_kernel.kda_recurrent import kda_recurrent_reference, kda_recurrent_update

    q, k, v, g, beta, pool, slots = _inputs()
    results = []
    for fn, kw in ((kda_recurrent_update, dict(block_v=block_v)), (kda_recurrent_reference, {})):
        p = pool.clone()
        staged = torch.zeros(pool.shape[0], 5, *pool.shape[1:], device=DEVICE) if stage else None
        out = torch.empty(*v.shape, dtype=torch.float16, device=DEVICE)
        fn(q, k, v, g, beta, 0.3, p, slots, out, staged=staged, **kw)
        results.append((out, p, staged))
    (o1, p1, s1), (o2, p2, s2) = results
    torch.testing.assert_close(o1, o2, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(p1, p2, atol=1e-5, rtol=1e-5)
    if stage:
        assert torch.equal(p1, pool)  # verify never touches the persistent state
        torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)
        assert s1[[2, 3, 5]].abs().sum() == 0  # slots outside the batch are not written


def test_decode_chain_equals_step_by_step():
    """Staging N positions equals N one-token updates of the same state: bit for bit, the
    property that makes NEXTN verify and plain decode round alike."""
    from sgl_kernel.kda_recurrent import kda_recurrent_update

    q, k, v, g, beta, pool, slots = _inputs(n=3)
    staged = torch.zeros(pool.shape[0], 3, *pool.shape[1:], device=DEVICE)
    chain_out = torch.empty_like(v)
    kda_recurrent_update(q, k, v, g, beta, 0.3, pool.clone(), slots, chain_out, staged=staged)
    p = pool.clone()
    for i in range(3):
        step_out = torch.empty_like(v[:, i:i + 1])
        kda_recurrent_update(q[:, i:i + 1].contiguous(), k[:, i:i + 1].contiguous(),
                             v[:, i:i + 1].contiguous(), g[:, i:i + 1].contiguous(),
                             beta[:, i:i + 1].contiguous(), 0.3, p, slots, step_out)
        assert torch.equal(step_out[:, 0], chain_out[:, i])
        assert torch.equal(p[slots], staged[slots, i])


def test_rejects_bad_inputs():
    from sgl_kernel.kda_recurrent import kda_recurrent_update

    q, k, v, g, beta, pool, slots = _inputs()
    out = torch.empty_like(v)
    with pytest.raises(ValueError, match="share strides"):
        kda_recurrent_update(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, g, beta, 1.0,
                             pool, slots, out)
    with pytest.raises(ValueError, match="state pool"):
        kda_recurrent_update(q, k, v, g, beta, 1.0, pool[:, :1], slots, out)
    with pytest.raises(ValueError, match="fp32"):
        kda_recurrent_update(q.half(), k.half(), v, g.half(), beta, 1.0, pool, slots, out)
