"""The prefill Triton kernels compile for sm_90 (the H200) on a machine without a GPU.

The CPU interpreter runs a kernel's Python, not Triton's compiler: code it accepts can still fail
to compile (a variable given another type inside a runtime ``if``, a dtype a ``tl.dot`` does not
take, a shape the layout passes reject), and the interpreter cannot run bf16 at all. So each
kernel is compiled here, in a subprocess without ``TRITON_INTERPRET``, by Triton's CUDA backend
to PTX and through ``ptxas`` for ``GPUTarget("cuda", 90, 32)``, with the argument types and
constexprs of its real launches:

* ``moe_grouped_gemm._moe_grouped_gemm_kernel``: bf16 experts with the SwiGLU epilogue (both
  tile layouts), block-fp8 experts with both fp8 inner loops (per-block product scaling,
  pre-scaled tiles) and on fp8 activations (w8a8), up-projection (SwiGLU, both layouts) and
  down-projection, the up-projection quantising its output and both with the shared expert as
  pairs; the w8a8 ones at the table's 65536-pair tile spill no register; and the w8a8 tiles
  with their weight through a TMA descriptor (the routed and the shared expert's launch);
* ``fp8_gemm._block_fp8_gemm_kernel`` with both inner loops (plain and swapped tiles), its
  w8a8 variant (``A_SCALE``: e4m3 activations and weight on the fp8 wgmma, plain and swapped)
  and its one-pass ``_dequantize_kernel``;
* ``fp8_act_quant._per_token_group_quant_kernel``: bf16 activations to e4m3 and fp32 group
  scales (the hardware cast's rounding, not the interpreter's fp32 rounding);
* ``kda_prefill_conv._kda_prefill_conv_kernel``: bf16 x and taps, fp32 window pool, K = 4,
  plain and with the heads' L2 norm (one or two heads per block);
* ``rmsnorm._rmsnorm_kernel`` (residual norm with PDL, KDA's gated norm) and
  ``_rmsnorm_tile_kernel`` (a prefill's narrow rows, several per program), and
  ``mla_rope._mla_rope_kernel`` (absorbed and normal form), which the prefill now runs too.

Skipped where the backend finds no ``ptxas``. Marked slow: each subprocess imports torch and
triton and compiles a few kernels (tens of seconds on 2 cores).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# Shared by every case's script: one kernel compiled with its arguments typed as
# ``ptrs`` / ``scalars`` (``i32`` when not named) and the given constexprs, to PTX and cubin.
_PRELUDE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


# aligned: the integer arguments a real launch passes as multiples of 16 (pointers always are).
# Triton specialises such arguments (tt.divisibility) and vectorises the loads they address;
# compiled without it, a tile's addresses are per element and its register count says nothing
# about the launched kernel.
def build(name, kernel, ptrs, constexprs, scalars=None, aligned=(), **options):
    scalars = scalars or {}
    sig = {arg: "constexpr" if arg in constexprs else ptrs.get(arg, scalars.get(arg, "i32"))
           for arg in kernel.arg_names}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in (*ptrs, *aligned) if a not in constexprs}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert out.asm["cubin"], name
    ptx = out.asm["ptx"]
    # ".e4m3.e4m3": the fp8 tensor-core instruction, not operands converted to 16 bits first
    kind = ("wgmma e4m3" if ".e4m3.e4m3" in ptx else "wgmma") if "wgmma" in ptx else "no wgmma"
    print(f"compiled {name}: {kind}", flush=True)
    return out


def spill_bytes(out):  # bytes of spill stores a thread, as ptxas reports them
    import os, re, subprocess, tempfile
    import triton.backends.nvidia as nv

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(out.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                            os.path.join(d, "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
"""

_MOE = _PRELUDE + r"""
from sgl_kernel.moe_grouped_gemm import _moe_grouped_gemm_kernel as kernel

import triton.language as tl

base = dict(QB=128, DOT_PREC=None, BLOCK_M=64, BLOCK_N=128, GROUP_M=8, A_SCALE=False,
            INTERLEAVE=False, ACT_DT=tl.bfloat16, QUANT_OUT=False, FMAX=448.0,
            ROUND_E4M3=False, HAS_SHARED=False, W_TMA=False, PART=0, w_desc=None)
ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*fp32", xs_ptr="*fp32", out_ptr="*bf16",
            os_ptr="*fp32", ws_ptr="*bf16", ss_ptr="*fp32", pairs_ptr="*i32", bexp_ptr="*i32",
            nblk_ptr="*i32")
floats = {"limit": "fp32", "shared_limit": "fp32"}
# Multiples of 16 at Ling-3.0-flash's shapes (N, K, their strides, a prefill's pair count).
aligned = ("N", "K", "num_pairs", "stride_x", "stride_we", "stride_wn", "stride_o", "up_row")
fp8 = {**ptrs, "w_ptr": "*fp8e4nv", "ws_ptr": "*fp8e4nv"}
opts = dict(num_warps=4, num_stages=3)
for il in (False, True):
    build(f"bf16 up+SwiGLU{' interleaved' if il else ''}", kernel, ptrs, dict(
          base, SWIGLU=True, INTERLEAVE=il, HAS_LIMIT=True, HAS_SCALE=False, PRESCALE=False,
          BLOCK_K=64), floats, aligned, **opts)
for prescale in (False, True):
    scheme = "pre-scaled" if prescale else "per-block"
    build(f"fp8 {scheme} up+SwiGLU", kernel, fp8, dict(base, SWIGLU=True, HAS_LIMIT=True,
          HAS_SCALE=True, PRESCALE=prescale, BLOCK_K=128), floats, aligned, **opts)
    build(f"fp8 {scheme} down", kernel, fp8, dict(base, SWIGLU=False, HAS_LIMIT=False,
          HAS_SCALE=True, PRESCALE=prescale, BLOCK_K=128), floats, aligned, **opts)
# w8a8: e4m3 activations with their group scales, the dot on two e4m3 operands; at the
# table's 65536-pair tile (64 x 128 x 128, 8 warps) in both SwiGLU layouts, which spill nothing.
w8a8 = {**fp8, "x_ptr": "*fp8e4nv"}
# The up-projection also with its output quantised in the epilogue (e4m3 rows + group scales)
# and with the shared expert as pairs (the prefill's default: both).
w8a8_q = {**w8a8, "out_ptr": "*fp8e4nv"}
for swiglu, il, quant, shared in ((True, False, False, False), (True, True, False, False),
                                  (False, False, False, False), (True, False, True, True),
                                  (False, False, False, True)):
    name = (f"w8a8 {'up+SwiGLU' if swiglu else 'down'}{' interleaved' if il else ''}"
            f"{' quantised out' if quant else ''}{' with the shared expert' if shared else ''}")
    out = build(name, kernel, w8a8_q if quant else w8a8, dict(
                base, SWIGLU=swiglu, INTERLEAVE=il, HAS_LIMIT=swiglu, HAS_SCALE=True,
                PRESCALE=False, A_SCALE=True, BLOCK_K=128, QUANT_OUT=quant, HAS_SHARED=shared),
                floats, aligned, num_warps=8, num_stages=3)
    assert spill_bytes(out) == 0, name
# The H100 table's 73728-pair tiles: weight tiles through a TMA descriptor, the routed
# experts' launch (PART 1) and the shared expert's (PART 2), the up-projection's 256 columns
# quantised in the epilogue (two groups).
tma = dict(base, W_TMA=True, HAS_SCALE=True, PRESCALE=False, A_SCALE=True, BLOCK_K=128)
for swiglu, part in ((True, 1), (True, 2), (False, 1)):
    block_n, warps, stages = (256, 8, 3) if swiglu else (128, 4, 4)
    desc = {"w_desc": f"tensordesc<fp8e4nv[1, {block_n}, 128]>"}
    consts = {k: v for k, v in dict(tma, SWIGLU=swiglu, HAS_LIMIT=swiglu, QUANT_OUT=swiglu,
                                    PART=part, BLOCK_N=block_n).items() if k != "w_desc"}
    name = f"w8a8 TMA {'up+SwiGLU quantised out' if swiglu else 'down'} part {part}"
    out = build(name, kernel, {**(w8a8_q if swiglu else w8a8), **desc}, consts, floats,
                aligned, num_warps=warps, num_stages=stages)
"""

_FP8_GEMM = _PRELUDE + r"""
from sgl_kernel.fp8_gemm import _block_fp8_gemm_kernel as kernel, _dequantize_kernel

ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", srow_ptr="*i64", xs_ptr="*fp32",
            b_ptr="*bf16", out_ptr="*bf16")
# The launch's bf16 shape: a bias, a fused weight's row map, a ragged last K step.
base = dict(HAS_BIAS=True, ROW_MAP=True, EVEN_K=False, QB=128, BLOCK_M=128, BLOCK_N=128,
            BLOCK_K=128, GROUP_M=8, A_SCALE=False, DOT_PRECISION="tf32")
for prescale in (False, True):
    for swap in (False, True):
        build(f"{'pre-scaled' if prescale else 'per-block'}{' swap_ab' if swap else ''}",
              kernel, ptrs, dict(base, SWAP_AB=swap, PRESCALE=prescale), num_warps=8,
              num_stages=3)
# w8a8: e4m3 activations with fp32 group scales, both operands e4m3 into the fp8 wgmma, bf16
# out (per-block product scaling only: pre-scaled tiles are refused for fp8 activations).
w8a8 = {**ptrs, "x_ptr": "*fp8e4nv"}
for swap in (False, True):
    build(f"w8a8{' swap_ab' if swap else ''}", kernel, w8a8,
          dict(base, SWAP_AB=swap, PRESCALE=False, A_SCALE=True), num_warps=8, num_stages=3)
build("dequantize", _dequantize_kernel, dict(w_ptr="*fp8e4nv", s_ptr="*fp32",
      srow_ptr="*i64", out_ptr="*bf16"), dict(ROW_MAP=True, QB=128, BLOCK_N=32, BLOCK_K=256),
      num_warps=4)
"""

_FP8_ACT_QUANT = _PRELUDE + r"""
from sgl_kernel.fp8_act_quant import _per_token_group_quant_kernel as kernel

# The launch's types: bf16 x, e4m3 q, fp32 scales; compiled, the hardware cast rounds.
build("per-token-group quant", kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
      dict(FMAX=448.0, GROUP=128, BLOCK_M=16, ROUND_IN_FP32=False), num_warps=4)
"""

_KDA_CONV = _PRELUDE + r"""
from sgl_kernel.kda_prefill_conv import _kda_prefill_conv_kernel as kernel

from sgl_kernel.kda_prefill_conv import _BLOCK_T, _BLOCK_C, _NORM_WARPS, _NUM_WARPS

# The default tiles: plain (the v plane), each 128-wide head L2-normalised in its own block
# (the q and k planes), and two heads per block (the reshaped reduction).
for norm_d, block_c, warps in ((0, _BLOCK_C, _NUM_WARPS), (128, 128, _NORM_WARPS),
                               (128, 256, _NUM_WARPS)):
    out = build(f"kda prefill conv, norm {norm_d}, {block_c} channels", kernel,
                dict(x_ptr="*bf16", w_ptr="*bf16", win_ptr="*fp32", y_ptr="*bf16"),
                dict(KW=4, BLOCK_T=_BLOCK_T, BLOCK_C=block_c, BLOCK_W=4, PRECISE_EXP=True,
                     NORM_D=norm_d), {"eps": "fp32"}, num_warps=warps, enable_fp_fusion=False)
    # No tile spills (the window's loads in every tile once spilled 1.5 KB a thread).
    assert spill_bytes(out) == 0, (norm_d, block_c)
"""

_RMSNORM = _PRELUDE + r"""
from sgl_kernel.rmsnorm import _rmsnorm_kernel as kernel

# The residual norm (hidden 2560) and KDA's gated output norm (head dim 128, the gate read
# through (token, head) strides), with PDL as decode launches them.
ptrs = {p: "*bf16" for p in ("x_ptr", "res_ptr", "gate_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
build("residual rmsnorm", kernel, ptrs, dict(HAS_RES=True, GATE=0, USE_PDL=True, BLOCK=4096),
      {"eps": "fp32"}, num_warps=4)
build("gated rmsnorm", kernel, ptrs, dict(HAS_RES=False, GATE=1, USE_PDL=False, BLOCK=128),
      {"eps": "fp32"}, num_warps=4)
# A prefill's narrow rows: 16 rows of KDA's gated norm (128) and 4 of MLA's latent norm (512)
# per program.
from sgl_kernel.rmsnorm import _rmsnorm_tile_kernel as tile

build("gated rmsnorm, 16 rows", tile, ptrs, dict(HAS_RES=False, GATE=1, ROWS=16, BLOCK=128),
      {"eps": "fp32"}, num_warps=4)
build("latent rmsnorm, 4 rows", tile, ptrs, dict(HAS_RES=False, GATE=0, ROWS=4, BLOCK=512),
      {"eps": "fp32"}, num_warps=4)
"""

_MLA_ROPE = _PRELUDE + r"""
from sgl_kernel.mla_rope import _mla_rope_kernel as kernel

# Absorbed form (query latent and key latent both 512 wide) and the prefill's normal form
# (q_nope 128 wide beside the 512-wide latent row).
ptrs = dict(pos_ptr="*i64", cs_ptr="*fp32", ql_ptr="*bf16", qr_ptr="*bf16", lat_ptr="*bf16",
            kr_ptr="*bf16", q_ptr="*bf16", k_ptr="*bf16")
for rq in (512, 128):
    build(f"mla rope {rq}|512", kernel, ptrs, dict(NEOX=False, USE_PDL=False, BLOCK_H=8,
          BLOCK_RQ=rq, BLOCK_RK=512, HALF=32), num_warps=4)
"""

# module -> (script, variants compiled, of which GEMMs: Hopper's wgmma expected in their PTX,
# of which w8a8: the wgmma on e4m3 operands).
CASES = {"moe_grouped_gemm": (_MOE, 14, 14, 8), "fp8_gemm": (_FP8_GEMM, 7, 6, 2),
         "fp8_act_quant": (_FP8_ACT_QUANT, 1, 0, 0), "kda_prefill_conv": (_KDA_CONV, 3, 0, 0),
         "rmsnorm": (_RMSNORM, 4, 0, 0), "mla_rope": (_MLA_ROPE, 2, 0, 0)}


@pytest.mark.parametrize("module", list(CASES))
def test_prefill_kernels_compile_for_sm90(module):
    """Every listed variant of the module's kernels compiles to an sm_90 cubin, and every GEMM
    variant (bf16 and both fp8 inner loops) runs its ``tl.dot`` on wgmma, not the older
    mma.sync path a changed operand layout could fall back to; the w8a8 variants run the e4m3
    wgmma itself."""
    script, variants, gemms, fp8_gemms = CASES[module]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("no ptxas for Triton's CUDA backend")
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("compiled ") == variants, out.stdout
    assert out.stdout.count(": wgmma") == gemms, out.stdout
    assert out.stdout.count(": wgmma e4m3") == fp8_gemms, out.stdout
