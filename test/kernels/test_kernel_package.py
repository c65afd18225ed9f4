"""sgl_kernel stands alone: its modules import torch and triton, never ``sglang``; every public
kernel module carries a plain-torch reference or says why it has none; and the layout helpers
written from their docstrings agree bit for bit with the engine's fp8 code they restate."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sgl-kernel" / "python" / "sgl_kernel"


def _module_names() -> List[str]:
    """Every module of the package, ``sgl_kernel`` itself first."""
    return ["sgl_kernel"] + sorted(f"sgl_kernel.{p.stem}" for p in PACKAGE.glob("*.py")
                                   if p.stem != "__init__")


def test_no_module_imports_sglang_in_its_source():
    """No ``import sglang`` / ``from sglang`` anywhere in a module, function bodies included:
    a lazy import inside a reference function would pass the sys.modules check below."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names
                          if name == "sglang" or name.startswith("sglang.")]
    assert not offenders, offenders


# Run in a fresh interpreter: the test process has sglang loaded already. Each module is
# imported in turn and the sglang modules present after it are recorded.
_PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    found[name] = sorted(m for m in sys.modules if m == "sglang" or m.startswith("sglang."))
print(json.dumps(found))
"""


def test_importing_every_module_loads_no_sglang_module():
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    # Only the kernel package on the path: sglang stays importable only if installed, and then
    # the check still sees it in sys.modules.
    env["PYTHONPATH"] = str(PACKAGE.parent)
    names = _module_names()
    proc = subprocess.run([sys.executable, "-c", _PROBE, *names], capture_output=True,
                          text=True, env=env, cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(found) == sorted(names)
    assert not any(found.values()), {name: mods for name, mods in found.items() if mods}


def _is_triton_jit(decorator: ast.expr) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)`` (compiled and interpreted alike)."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" \
        and isinstance(target.value, ast.Name) and target.value.id == "triton"


def _kernel_modules() -> List[str]:
    """Public modules that define a Triton function (kernels or device helpers), read from
    their source: under the interpreter ``triton.jit`` returns another type."""
    out = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list))
               for node in tree.body):
            out.append(f"sgl_kernel.{path.stem}")
    return out


def test_every_kernel_module_has_a_reference_or_a_reason():
    """A public kernel module exports a torch reference (a function named ``*_reference`` or
    ``*_ref`` in ``__all__``, defined there) or a ``REFERENCE_NOTE`` saying where its reference
    lives or why it has none."""
    import importlib

    modules = _kernel_modules()
    assert "sgl_kernel.small_m_gemm" in modules and "sgl_kernel.mla_decode" in modules
    missing = []
    for name in modules:
        mod = importlib.import_module(name)
        public = getattr(mod, "__all__", [])
        refs = [n for n in public if n.endswith(("_reference", "_ref"))
                and callable(getattr(mod, n, None))
                and getattr(getattr(mod, n), "__module__", None) == name]
        note = getattr(mod, "REFERENCE_NOTE", None)
        if not refs and not (isinstance(note, str) and note.strip() and "REFERENCE_NOTE" in public):
            missing.append(name)
    assert not missing, f"kernel modules without a torch reference or REFERENCE_NOTE: {missing}"


@pytest.mark.parametrize("shape,split", [((200, 300), None), ((3, 200, 384), 72),
                                         ((128, 256), None), ((2, 96, 130), 40)])
def test_block_fp8_layout_matches_the_engine_quantiser(shape, split):
    """sgl_kernel.fp8_blocks restates the checkpoint layout in plain torch; the engine's
    quantiser (fp8_utils) must give the same bits, or kernels and engine would read different
    weights. An all-zero block takes scale 1 in both."""
    from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize, block_quantize
    from sglang.srt.layers.quantization.fp8_utils import (block_index, dequantize_indexed,
                                                          quantize_block_fp8)

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(*shape, generator=gen) * 3
    w[..., :QBLOCK, :QBLOCK] = 0.0  # one all-zero block
    n = shape[-2]
    pieces = [n] if split is None else [split, n - split]
    q, scale = block_quantize(w, split)
    parts = [quantize_block_fp8(p, (QBLOCK, QBLOCK)) for p in torch.split(w, pieces, dim=-2)]
    assert torch.equal(q.view(torch.uint8), torch.cat([p for p, _ in parts], -2).view(torch.uint8))
    assert torch.equal(scale, torch.cat([s for _, s in parts], -2))
    rows = block_index(pieces, QBLOCK)
    cols = torch.arange(shape[-1]) // QBLOCK
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        want = dequantize_indexed(q, scale, rows, cols, dtype)
        assert torch.equal(block_dequantize(q, scale, dtype, split=split), want)
        assert torch.equal(block_dequantize(q, scale, dtype, rows=rows), want)


def test_gated_norm_reference_matches_the_engine_norm():
    """small_m_gemm's plain-torch gated-norm prologue against the engine's GatedRMSNorm math
    (layernorm.gated_rms_norm_heads, the runtime's path above the small-M rows)."""
    from sgl_kernel.small_m_gemm import GatedNormPrologue, gated_norm_reference
    from sglang.srt.layers.layernorm import gated_rms_norm_heads

    gen = torch.Generator().manual_seed(3)
    for dtype, act in ((torch.float32, "sigmoid"), (torch.float16, "swish"),
                       (torch.bfloat16, "silu")):
        x, gate = (torch.randn(5, 256, generator=gen).to(dtype) for _ in "xg")
        pro = GatedNormPrologue(gate, torch.rand(64, generator=gen).to(dtype), 1e-6, 64, act)
        assert torch.equal(gated_norm_reference(x, pro), gated_rms_norm_heads(x, pro))


def test_plain_torch_references_match_the_engine_forms():
    """The references rewritten from their docstrings (MoE combine, grouped-GEMV SwiGLU, KDA
    step and gate) agree with the engine's torch code they used to import."""
    from sgl_kernel.grouped_gemv import _silu_and_mul
    from sgl_kernel.kda_recurrent import _kda_gate, kda_recurrent_reference
    from sgl_kernel.moe_combine import moe_combine_reference
    from sglang.srt.layers.activation import silu_and_mul
    from sglang.srt.layers.attention.kda_ops import kda_gate, kda_step
    from sglang.srt.layers.moe.fused_moe_native import combine_expert_outputs

    gen = torch.Generator().manual_seed(5)
    y, w, sh = torch.randn(12, 40, generator=gen).half(), torch.rand(4, 3, generator=gen), \
        torch.randn(4, 40, generator=gen).half()
    for shared in (None, sh):
        want = combine_expert_outputs(y, w, shared)
        assert torch.equal(moe_combine_reference(y, w, shared), want)
    x = torch.randn(6, 32, generator=gen).half()
    for limit in (0.0, 0.7):
        assert torch.equal(_silu_and_mul(x, limit), silu_and_mul(x, limit))
    f = torch.randn(5, 2, 8, generator=gen)
    a_log, dt_bias = torch.randn(2, generator=gen), torch.randn(16, generator=gen)
    for lower in (None, -5.0):
        assert torch.equal(_kda_gate(f, a_log, dt_bias, lower), kda_gate(f, a_log, dt_bias, lower))
    b, n, h, k, v = 2, 3, 2, 8, 4
    q, kk = (torch.nn.functional.normalize(torch.randn(b, n, h, k, generator=gen), dim=-1)
             for _ in "qk")
    vv, g = torch.randn(b, n, h, v, generator=gen), -torch.rand(b, n, h, k, generator=gen)
    beta = torch.rand(b, n, h, generator=gen)
    pool, slots = torch.randn(3, h, k, v, generator=gen), torch.tensor([2, 0])
    got_pool, out = pool.clone(), torch.empty(b, n, h, v)
    kda_recurrent_reference(q, kk, vv, g, beta, 0.5, got_pool, slots, out)
    state = pool[slots]
    for i in range(n):
        o, state = kda_step(q[:, i], kk[:, i], vv[:, i], g[:, i], beta[:, i], 0.5, state)
        assert torch.equal(out[:, i], o)
    assert torch.equal(got_pool[slots], state)
