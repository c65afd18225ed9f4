"""sgl_kernel.kda_conv (KDA short conv + head split + window write, decode and verify) against
kda_ops.causal_conv1d_update / causal_conv1d_chain and the backend's head split. Without CUDA
the kernel runs in Triton's CPU interpreter (fp32)."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, needs_triton

from sglang.srt.layers.attention.kda_ops import causal_conv1d_chain, causal_conv1d_update, l2norm

pytestmark = needs_triton
H, D, KW, S = 2, 24, 4, 6  # D = 24: a masked tail in the 32-wide block


def _inputs(b=3, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(b, n, 3 * H * D, generator=g).to(DEVICE)
    weight = (0.5 * torch.randn(3 * H * D, KW, generator=g)).to(DEVICE)
    pool = torch.randn(S, 3 * H * D, KW - 1, generator=g).to(DEVICE)
    # A column of a host-built [B, 3] table, as the scheduler passes slots: strided.
    slots = torch.tensor([[9, 4, 9], [9, 1, 9], [9, 0, 9]], device=DEVICE)[:b, 1]
    return mixed, weight, pool, slots


def _split(y):
    """The backend's head split: [T, 3HD] -> L2-normed q, k and v, fp32 [T, H, D]."""
    qc, kc, vc = y.float().view(y.shape[0], 3, H, D).unbind(1)
    return l2norm(qc), l2norm(kc), vc


def test_decode_matches_the_one_step_update():
    from sgl_kernel.kda_conv import kda_conv_qkv

    mixed, weight, pool, slots = _inputs(n=1)
    p = pool.clone()
    got = kda_conv_qkv(mixed, weight, p, slots, H, D)
    y, window = causal_conv1d_update(mixed[:, 0], weight, pool[slots])
    for a, b in zip(got, _split(y)):
        assert a.shape == (3, 1, H, D) and a.is_contiguous()
        torch.testing.assert_close(a[:, 0], b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p[slots], window)  # the pool slot holds the new window
    others = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(p[others], pool[others])


# rows: the default / one block per program (the GPU's) / 6 blocks over 2 programs, masked.
@pytest.mark.parametrize("rows", [None, pytest.param(1, marks=pytest.mark.slow), 4])
def test_verify_matches_the_chain_and_stages_windows(rows):
    from sgl_kernel.kda_conv import kda_conv_qkv

    mixed, weight, pool, slots = _inputs(n=3)
    p, staged = pool.clone(), torch.zeros(S, 4, 3 * H * D, KW - 1, device=DEVICE)
    got = kda_conv_qkv(mixed, weight, p, slots, H, D, staged=staged, rows=rows)
    y, windows = causal_conv1d_chain(mixed, weight, pool[slots])
    for a, b in zip(got, _split(y.reshape(9, -1))):
        torch.testing.assert_close(a, b.view(3, 3, H, D), rtol=1e-5, atol=1e-6)
    assert torch.equal(p, pool)  # verify only reads the persistent windows
    torch.testing.assert_close(staged[slots, :3], windows)


@pytest.mark.parametrize("rows", [None, pytest.param(1, marks=pytest.mark.slow)])
def test_chain_equals_step_by_step_bit_for_bit(rows):
    """Verify position i == the decode of token i from the window decode left: the property
    NEXTN losslessness rests on."""
    from sgl_kernel.kda_conv import kda_conv_qkv

    mixed, weight, pool, slots = _inputs(n=3, seed=1)
    staged = torch.zeros(S, 3, 3 * H * D, KW - 1, device=DEVICE)
    chain = kda_conv_qkv(mixed, weight, pool.clone(), slots, H, D, staged=staged, rows=rows)
    p = pool.clone()
    for i in range(3):
        step = kda_conv_qkv(mixed[:, i:i + 1].contiguous(), weight, p, slots, H, D, rows=rows)
        for a, b in zip(step, chain):
            assert torch.equal(a[:, 0], b[:, i])
        assert torch.equal(p[slots], staged[slots, i])


def test_bad_inputs_are_rejected():
    from sgl_kernel.kda_conv import kda_conv_qkv

    mixed, weight, pool, slots = _inputs()
    with pytest.raises(ValueError, match="mixed"):
        kda_conv_qkv(mixed[:, :, :-1], weight, pool, slots, H, D)
    with pytest.raises(ValueError, match="conv_weight"):
        kda_conv_qkv(mixed, weight[:-1], pool, slots, H, D)
    with pytest.raises(ValueError, match="conv_pool"):
        kda_conv_qkv(mixed, weight, pool[:, :, :2], slots, H, D)
    with pytest.raises(ValueError, match="slots"):
        kda_conv_qkv(mixed, weight, pool, slots[:2], H, D)
    with pytest.raises(ValueError, match="staged"):
        kda_conv_qkv(mixed, weight, pool, slots, H, D, staged=pool.unsqueeze(1))


def test_pdl_switch_leaves_results_unchanged():
    """With set_pdl(True) decode still matches the one-step update (under the interpreter the
    switch stays off: the PDL code path is inert there)."""
    from sgl_kernel import pdl
    from sgl_kernel.kda_conv import kda_conv_qkv

    mixed, weight, pool, slots = _inputs(n=1, seed=2)
    p = pool.clone()
    try:
        pdl.set_pdl(True)
        got = kda_conv_qkv(mixed, weight, p, slots, H, D)
    finally:
        pdl.set_pdl(False)
    y, window = causal_conv1d_update(mixed[:, 0], weight, pool[slots])
    for a, b in zip(got, _split(y)):
        torch.testing.assert_close(a[:, 0], b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p[slots], window)


@pytest.mark.gpu
def test_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: a decode (pool updated in place) then a verify chain staging windows
    from the updated pool, launched with PDL inside a CUDA graph, give the same bits as
    without."""
    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.kda_conv import kda_conv_qkv

    skip_without_pdl()
    mixed1, weight, pool0, slots = (t.bfloat16() if t.is_floating_point() else t
                                    for t in _inputs(n=1, seed=3))
    mixed3 = _inputs(n=3, seed=4)[0].bfloat16()
    pool = torch.empty_like(pool0)
    staged = torch.zeros(S, 3, 3 * H * D, KW - 1, dtype=torch.bfloat16, device=DEVICE)

    def step():
        pool.copy_(pool0)
        decode = kda_conv_qkv(mixed1, weight, pool, slots, H, D)
        verify = kda_conv_qkv(mixed3, weight, pool, slots, H, D, staged=staged)
        return (*decode, *verify, pool, staged)

    assert_bitwise_equal(outputs_without_and_with_pdl(step))
