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


@pytest.mark.parametrize("lower_bound", [-5.0, None])  # the safe gate, Kimi's softplus form
def test_raw_gate_inputs_are_formed_in_the_kernel(lower_bound):
    """``gate_params``: g and beta arrive as the raw f / b projections (fp16 strided views of a
    wider projection output) and the kernel forms them as kda_gate and a sigmoid do."""
    from sgl_kernel.kda_recurrent import kda_recurrent_reference, kda_recurrent_update

    q, k, v, _, _, pool, slots = _inputs()
    b, n, h, dk = q.shape
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(b * n, h * dk + h + 8, generator=gen).to(DEVICE, torch.float16)
    f = fused[:, :h * dk].view(b, n, h, dk)
    braw = fused[:, h * dk:h * dk + h].view(b, n, h)
    params = (torch.randn(h, generator=gen).to(DEVICE), torch.randn(h * dk, generator=gen).to(DEVICE),
              lower_bound)
    results = []
    for fn in (kda_recurrent_update, kda_recurrent_reference):
        p = pool.clone()
        out = torch.empty(*v.shape, device=DEVICE)
        fn(q, k, v, f, braw, 0.3, p, slots, out, gate_params=params)
        results.append((out, p))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_recurrent_update(q, k, v, f, braw, 0.3, pool.clone(), slots, torch.empty_like(v),
                             gate_params=(params[0], params[1][:3], lower_bound))


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


def test_pdl_switch_leaves_results_unchanged():
    """With set_pdl(True) the decode still matches the reference (under the interpreter the
    switch stays off: the PDL code path is inert there)."""
    from sgl_kernel import pdl
    from sgl_kernel.kda_recurrent import kda_recurrent_reference, kda_recurrent_update

    q, k, v, g, beta, pool, slots = _inputs(n=1, seed=2)
    p, p_ref = pool.clone(), pool.clone()
    out, ref = torch.empty_like(v), torch.empty_like(v)
    try:
        pdl.set_pdl(True)
        kda_recurrent_update(q, k, v, g, beta, 0.3, p, slots, out)
    finally:
        pdl.set_pdl(False)
    kda_recurrent_reference(q, k, v, g, beta, 0.3, p_ref, slots, ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p, p_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: a decode (state updated in place) then a verify chain staging states
    from the updated pool, launched with PDL inside a CUDA graph, give the same bits as
    without."""
    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.kda_recurrent import kda_recurrent_update

    skip_without_pdl()
    dims = dict(b=2, h=4, dk=128, dv=128)
    q1, k1, v1, g1, b1, pool0, slots = _inputs(n=1, seed=3, **dims)
    q3, k3, v3, g3, b3 = _inputs(n=3, seed=4, **dims)[:5]
    pool = torch.empty_like(pool0)
    staged = torch.zeros(pool0.shape[0], 3, *pool0.shape[1:], device=DEVICE)
    out1 = torch.empty(*v1.shape, dtype=torch.bfloat16, device=DEVICE)
    out3 = torch.empty(*v3.shape, dtype=torch.bfloat16, device=DEVICE)

    def step():
        pool.copy_(pool0)
        kda_recurrent_update(q1, k1, v1, g1, b1, 0.3, pool, slots, out1)
        kda_recurrent_update(q3, k3, v3, g3, b3, 0.3, pool, slots, out3, staged=staged)
        return out1, out3, pool, staged

    assert_bitwise_equal(outputs_without_and_with_pdl(step))


def _chain_outputs(inputs, block_v, num_warps=None):
    from sgl_kernel.kda_recurrent import kda_recurrent_update

    q, k, v, g, beta, pool, slots = inputs
    staged = torch.zeros(pool.shape[0], q.shape[1], *pool.shape[1:], device=pool.device)
    out = torch.empty_like(v)
    kda_recurrent_update(q, k, v, g, beta, 0.3, pool, slots, out, staged=staged,
                         block_v=block_v, num_warps=num_warps)
    return out, staged


def test_value_tiles_do_not_change_a_bit():
    """The value-dim tile is a launch choice only: a verify chain's outputs and staged states
    are bit-equal whatever ``block_v`` (each value column runs the same arithmetic)."""
    inputs = _inputs(dv=32)
    first_out, first_staged = _chain_outputs(inputs, 32)
    for block_v in (8, 16):
        out, staged = _chain_outputs(inputs, block_v)
        assert torch.equal(out, first_out) and torch.equal(staged, first_staged), block_v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_v", [16, 32, 64, 128])
def test_chain_equals_step_by_step_at_every_value_tile_on_cuda(block_v):
    """At the Flash KDA head (K = V = 128) on the GPU: for each value tile a sweep may pick, a
    verify chain's outputs and staged states equal the same tokens decoded one at a time, bit
    for bit. Across tiles the bits may differ on the GPU (the H200 showed it: the tile changes
    the register layout of the reductions over K), which is why decode and verify must share
    ``launch_config``'s one tile rather than each being tuned on its own."""
    from sgl_kernel.kda_recurrent import NUM_WARPS, kda_recurrent_update

    n = 6
    q, k, v, g, beta, pool, slots = _inputs(b=1, n=n, h=4, dk=128, dv=128)
    chain_out, staged = _chain_outputs((q, k, v, g, beta, pool.clone(), slots), block_v,
                                       NUM_WARPS)
    p = pool.clone()
    for i in range(n):
        step_out = torch.empty_like(v[:, i:i + 1])
        kda_recurrent_update(q[:, i:i + 1].contiguous(), k[:, i:i + 1].contiguous(),
                             v[:, i:i + 1].contiguous(), g[:, i:i + 1].contiguous(),
                             beta[:, i:i + 1].contiguous(), 0.3, p, slots, step_out,
                             block_v=block_v, num_warps=NUM_WARPS)
        assert torch.equal(step_out[:, 0], chain_out[:, i]), (block_v, i)
        assert torch.equal(p[slots], staged[slots, i]), (block_v, i)
