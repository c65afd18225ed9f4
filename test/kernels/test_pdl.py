"""sgl_kernel.pdl and SGLANG_ENABLE_PDL: the switch never turns on under the interpreter (its
gdc calls would raise there), the launch keyword follows it and the row gate, and the flag's
values resolve per device (compute capability 9.0 or newer); the small-M GEMM's weight prefetch
before the wait (compiled for sm_90 on any machine). The small-M GEMM's default per device and
weights is test/srt/test_kernel_choices.py's."""
from __future__ import annotations

import pytest

from kernel_test_utils import ON_CUDA, needs_triton

pytestmark = needs_triton


def test_switch_and_row_gate():
    from sgl_kernel import pdl

    try:
        on = pdl.set_pdl(True)
        assert on == pdl.pdl_enabled() == (ON_CUDA and not pdl.INTERPRETED)
        assert pdl.use_pdl(1) == on and not pdl.use_pdl(pdl.PDL_MAX_ROWS + 1)
        assert pdl.launch_options(True) == {"launch_pdl": True}
        assert pdl.launch_options(False) == {}
    finally:
        pdl.set_pdl(False)
    assert not pdl.use_pdl(1)


def test_weight_prefetch_follows_pdl_and_its_switch():
    from sgl_kernel import pdl

    try:
        on = pdl.set_pdl(True)
        assert pdl.weight_prefetch(1) == on and not pdl.weight_prefetch(pdl.PDL_MAX_ROWS + 1)
        assert not pdl.set_weight_prefetch(False) and not pdl.weight_prefetch(1)
    finally:
        pdl.set_pdl(False)
        pdl.set_weight_prefetch(True)
    assert not pdl.weight_prefetch(1)


# Compiled for sm_90 by Triton's CUDA backend (no GPU needed) in a process without the
# interpreter: the prefetch is inline PTX the interpreter cannot run.
_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sgl_kernel.small_m_gemm as S

lines = int(sys.argv[1])
fixed = dict(HAS_BIAS=False, HAS_SCALE=True, ROW_MAP=False, QB=128, NORM_D=0, GATE_ACT=1,
             USE_PDL=True, PREFETCH_LINES=lines, LINE=128, SPLIT=1, SWAP_AB=False, BLOCK_M=16,
             BLOCK_N=32, BLOCK_K=128, DOT_PRECISION="tf32")
ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", b_ptr="*bf16", out_ptr="*bf16", s_ptr="*fp32",
            srow_ptr="*i32", z_ptr="*bf16", nw_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
sig = {n: ptrs.get(n, "constexpr" if n in fixed else "fp32" if n == "eps" else "i32")
       for n in S._small_m_gemm_kernel.arg_names}
src = ASTSource(S._small_m_gemm_kernel, sig, constexprs=fixed)
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


@pytest.mark.parametrize("lines", [4, 0])
def test_small_m_gemm_prefetches_weights_before_the_wait(lines):
    """With PDL the small-M GEMM's first weight lines are prefetched to L2 before
    ``griddepcontrol.wait`` (one per thread here: 32 rows x 4 lines, 4 warps); without, none."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(lines)], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("no ptxas for Triton's CUDA backend")
    assert out.returncode == 0, out.stderr[-3000:]
    ptx = out.stdout
    wait = ptx.index("griddepcontrol.wait")
    if lines:
        assert ptx.count("prefetch.global.L2") == 1 and ptx.index("prefetch.global.L2") < wait
    else:
        assert "prefetch" not in ptx


def test_flag_resolution():
    from sglang.srt.configs.engine_defaults import resolve_pdl_flag

    assert resolve_pdl_flag("auto", "cuda", (9, 0)) and not resolve_pdl_flag("auto", "cuda", (8, 0))
    assert not resolve_pdl_flag("auto", "cpu") and not resolve_pdl_flag("0", "cuda", (9, 0))
    assert resolve_pdl_flag("1", "cuda", (10, 0))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        resolve_pdl_flag("1", "cuda", (8, 6))
    with pytest.raises(ValueError, match="SGLANG_ENABLE_PDL='sometimes'"):
        resolve_pdl_flag("sometimes", "cuda", (9, 0))



@pytest.mark.gpu
def test_kernels_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: the MoE chain (up, down, combine) and a small-M GEMM launched with PDL
    inside one CUDA graph give the same bits as without."""
    import torch

    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.grouped_gemv import grouped_gemv
    from sgl_kernel.moe_combine import moe_combine
    from sgl_kernel.small_m_gemm import small_m_gemm

    skip_without_pdl()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 16, 256, 128, 4
    x = torch.randn(2, h, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / 16).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / 11).bfloat16()
    wd = (torch.randn(h, h, device="cuda", generator=gen) / 16).bfloat16()
    ids = torch.randint(0, e, (2 * k,), device="cuda", generator=gen)
    weights = torch.rand(2, k, device="cuda", generator=gen)

    def chain():
        act = grouped_gemv(x, w13, ids, rows_per_x=k, swiglu_limit=0.0, extra_w=w13[0])
        y = grouped_gemv(act[:2 * k], w2, ids, extra_w=w2[0], extra_x=act[2 * k:])
        return small_m_gemm(moe_combine(y, weights, y[2 * k:]), wd)

    assert_bitwise_equal(outputs_without_and_with_pdl(lambda: [chain()]))
