"""sgl_kernel.moe_align: the three-launch expert sort returns exactly the torch reference's
alignment (``moe_align.moe_align``), field by field, and the grouped MoE gives the same
bits with it; ``KernelChoices.moe_align_kernel`` reaches the MoE layers."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from kernel_test_utils import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.fixture(scope="module")
def ma():
    """The kernel module (compiled on CUDA, interpreted on CPU)."""
    import sgl_kernel.moe_align as module

    return module


def _routes(t: int, k: int, e: int, seed: int, hot: Optional[int] = None,
            skip: tuple = (), dtype: torch.dtype = torch.int64,
            device: str = DEVICE) -> torch.Tensor:
    """``[T, k]`` distinct experts per token (as a router picks them), never an expert of
    ``skip``; with ``hot`` every pair goes to that expert (duplicates: the sort must not care)."""
    gen = torch.Generator().manual_seed(seed)
    if hot is not None:
        return torch.full((t, k), hot, dtype=dtype, device=device)
    allowed = torch.tensor([x for x in range(e) if x not in skip])
    scores = torch.rand(t, allowed.numel(), generator=gen)
    return allowed[scores.argsort(-1)[:, :k]].to(device, dtype)


def _assert_same(got, want) -> None:
    """Every field of two MoEAlignments equal: tensors bit for bit (dtype, shape, values)."""
    assert type(got) is type(want)
    for name in want._fields:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, name
            assert torch.equal(a, b), (name, a, b)
        else:
            assert a == b, name


CASES = [
    # (T, k, E, block_m, route kind)
    (40, 3, 6, 16, "skip"),        # experts 1 and 4 get no pair
    (7, 4, 6, 32, "plain"),        # T*k = 28: not a multiple of block_m
    (1, 1, 6, 16, "plain"),
    (0, 2, 5, 16, "plain"),        # no pairs at all
    (30, 2, 200, 64, "plain"),     # E not a power of two, most experts empty
    (50, 4, 8, 128, "hot"),        # every pair on one expert
    (1, 8, 512, 16, "plain"),      # Ling's E / top-k from here
    (3, 8, 512, 128, "int32"),
    (128, 8, 512, 64, "plain"),
    (300, 4, 6, 16, "int32"),      # two chunks of pair ids
    pytest.param(1024, 8, 512, 32, "plain", marks=pytest.mark.slow),  # eight chunks
]


@pytest.mark.parametrize("t,k,e,block_m,kind", CASES)
def test_matches_torch_alignment(ma, t, k, e, block_m, kind):
    from sgl_kernel.moe_align import moe_align

    ids = _routes(t, k, e, seed=t * 7 + e, hot=e // 2 if kind == "hot" else None,
                  skip=(1, 4) if kind == "skip" else (),
                  dtype=torch.int32 if kind == "int32" else torch.int64)
    _assert_same(ma.moe_align_triton(ids, e, block_m), moe_align(ids, e, block_m))


@pytest.mark.parametrize("t,k,e,block_m", [(40, 3, 6, 16), (33, 5, 9, 32), (25, 2, 40, 16)])
def test_many_chunks_and_block_tiles(ma, monkeypatch, t, k, e, block_m):
    """Small chunks and block tiles (module constants read per call) so that a cheap case
    crosses many chunk boundaries (the running per-expert offsets) and block-table tiles (the
    carried running maximum), as a Ling prefill of thousands of tokens does."""
    from sgl_kernel.moe_align import moe_align

    monkeypatch.setattr(ma, "MAX_CHUNK", 16)
    monkeypatch.setattr(ma, "BLOCK_TILE", 4)
    ids = _routes(t, k, e, seed=t + k, skip=(0, e - 1))
    al = ma.moe_align_triton(ids, e, block_m)
    assert ma.align_chunk(t * k) == 16 and int(al.num_blocks) > 4  # 2+ tiles used
    _assert_same(al, moe_align(ids, e, block_m))


def test_rejects_bad_inputs(ma):
    with pytest.raises(ValueError, match="moe_align_triton"):
        ma.moe_align_triton(torch.zeros(4, dtype=torch.int64, device=DEVICE), 4, 16)
    with pytest.raises(ValueError, match="moe_align_triton"):
        ma.moe_align_triton(torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), 4, 0)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_moe_bit_equal_with_the_choice(ma, monkeypatch, fp8):
    """fused_moe_grouped with ``align_kernel`` on and off: the same alignment, so the same GEMM
    launches on the same rows and the same bits; the kernel did run when asked."""
    from sglang.srt.layers.moe.fused_moe_triton import fused_moe_grouped

    gen = torch.Generator().manual_seed(5)
    t, e, h, i, k = 40, 6, 64, 48, 3
    hidden = torch.randn(t, h, generator=gen).to(DEVICE)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(DEVICE)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(DEVICE)
    weights = torch.rand(t, k, generator=gen).softmax(-1).to(DEVICE)
    ids = _routes(t, k, e, seed=9, skip=(2,))
    scales = {}
    if fp8:
        from sgl_kernel.fp8_blocks import block_quantize

        (w13, s13), (w2, s2) = block_quantize(w13, split=i), block_quantize(w2)
        scales = {"w13_scale": s13, "w2_scale": s2}
    calls = []
    real = ma.moe_align_triton
    monkeypatch.setattr(ma, "moe_align_triton", lambda *a: calls.append(a) or real(*a))
    off = fused_moe_grouped(hidden, w13, w2, weights, ids, 0.5, **scales)
    assert not calls
    on = fused_moe_grouped(hidden, w13, w2, weights, ids, 0.5, align_kernel=True, **scales)
    assert calls
    assert torch.equal(on, off)


def test_kernel_choice_reaches_the_moe_layers():
    """``moe_align_kernel`` is on by default with the Triton MoE on CUDA (off on CPU and with the
    torch-native MoE), parsed from the benchmark spelling, and set_moe_runner_backend hands it
    to every FusedMoE, on the Triton backend only."""
    from torch import nn

    from sglang.srt.layers.kernel_choices import KernelChoices, default_kernel_choices
    from sglang.srt.layers.moe.moe_layer import FusedMoE, set_moe_runner_backend

    assert default_kernel_choices("cuda", quantized=True).moe_align_kernel
    assert not default_kernel_choices("cuda", quantized=True,
                                      moe_runner_backend="torch_native").moe_align_kernel
    assert not default_kernel_choices("cpu", quantized=True).moe_align_kernel
    assert KernelChoices.parse("moe_align_kernel=1") == KernelChoices(moe_align_kernel=True)
    model = nn.ModuleList([FusedMoE(4, 32, 16, params_dtype=torch.float32) for _ in range(2)])
    assert not any(m.align_kernel for m in model)
    set_moe_runner_backend(model, "torch_native", torch.device(DEVICE), align_kernel=True)
    assert not any(m.align_kernel for m in model)  # the native MoE never sorts pairs this way
    set_moe_runner_backend(model, "triton", torch.device(DEVICE), align_kernel=True)
    assert all(m.align_kernel for m in model)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_ling_prefill_on_cuda_and_in_a_graph(ma, block_m):
    """8192 tokens x top-8 over 512 experts (64 chunks, the block table over several tiles at
    block_m 16): equal to the reference eagerly, and replayed from a CUDA graph after other
    routes (skewed: one expert on every token) are copied into the captured input."""
    from sgl_kernel.moe_align import moe_align

    t, k, e = 8192, 8, 512
    ids = _routes(t, k, e, seed=1, device="cuda")
    _assert_same(ma.moe_align_triton(ids, e, block_m), moe_align(ids, e, block_m))
    static = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        ma.moe_align_triton(static, e, block_m)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ma.moe_align_triton(static, e, block_m)
    other = _routes(t, k, e, seed=2, skip=tuple(range(100, 300)), device="cuda")
    other[:, 0] = 3
    static.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, moe_align(other, e, block_m))
