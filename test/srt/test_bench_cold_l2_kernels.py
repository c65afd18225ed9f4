"""benchmark/kernels/bench_cold_l2_kernels.py still runs: the CPU smoke run (tiny shapes in
Triton's interpreter, fp32) as a script in a subprocess writes one JSON line per table row,
for every kernel it covers, each kernel checked against its reference; ``--kernels`` selects a
subset."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sglang.test.script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark" / "kernels" / "bench_cold_l2_kernels.py"
FIELDS = {"kernel", "case", "rows", "device", "gpu", "dtype", "tiny", "iters", "kernel_us",
          "reference_us", "speedup", "bytes", "kernel_gbps", "max_rel_err", "reference"}


def _load() -> ModuleType:
    return load_script(SCRIPT)


def _lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # every kernel case in Triton's interpreter
def test_cpu_smoke_run_writes_a_checked_row_per_case(tmp_path):
    """``--device cpu --tiny`` as a script: every kernel of the script has rows at its decode
    and/or prefill sizes, each a JSON line with every field, timings positive and the kernel
    within fp32 rounding of its reference (the tiny inputs run the same code as the GPU's)."""
    out = tmp_path / "rows.jsonl"
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                            os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _lines(out)
    assert f"wrote {len(rows)} rows to {out}" in proc.stdout
    bench = _load()
    assert {r["kernel"] for r in rows} == set(bench.KERNELS)
    for r in rows:
        assert set(r) == FIELDS, r
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["tiny"] is True, r
        assert r["kernel_us"] > 0 and r["reference_us"] > 0 and r["bytes"] > 0, r
        assert r["max_rel_err"] < 1e-5, r  # fp32: summation order only, or bit-equal
        # one printed table row per JSON line
        assert f"| {r['kernel']} | {r['case']} | {r['rows']} |" in proc.stdout, r
    by_kernel = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], set()).add(r["rows"])
    # decode sizes (tiny: 1 and 3 tokens) for the per-token kernels, prefill (8) where relevant
    for name in ("mla_rope", "moe_combine", "moe_router", "rmsnorm"):
        assert by_kernel[name] == {1, 3, 8}, (name, by_kernel[name])
    for name in ("kda_conv", "kda_recurrent", "round_prep"):  # decode and verify only
        assert by_kernel[name] == {1, 3}, (name, by_kernel[name])
    assert by_kernel["kda_prefill_conv"] == by_kernel["moe_grouped_gemm"] == {8}


def test_kernels_flag_selects_a_subset_and_refuses_cpu_at_model_shapes(tmp_path):
    """In-process (this process already runs Triton's interpreter without CUDA): ``--kernels``
    writes only the chosen kernels' rows; the CPU without ``--tiny`` is refused."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the in-process run needs Triton's interpreter (test/conftest.py, no CUDA)")
    bench = _load()
    out = tmp_path / "subset.jsonl"
    rows = bench.main(["--device", "cpu", "--tiny", "--kernels", "round_prep", "moe_combine",
                       "--decode-rows", "2", "--prefill-rows", "5", "--out", str(out)])
    assert _lines(out) == rows
    assert sorted({(r["kernel"], r["rows"]) for r in rows}) == [
        ("moe_combine", 2), ("moe_combine", 5), ("round_prep", 1), ("round_prep", 2),
        ("round_prep", 3)]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--out", str(out)])
