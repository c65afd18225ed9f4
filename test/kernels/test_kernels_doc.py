"""docs/kernels.md, the per-kernel inventory, stays true: one row per Triton kernel module of
sgl_kernel, and every test, benchmark and reference it names exists."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kernels.md"
PACKAGE = ROOT / "sgl-kernel" / "python" / "sgl_kernel"
BENCH = ROOT / "benchmark" / "kernels" / "bench_cold_l2_kernels.py"
HELPERS = {"pdl"}  # Triton device helpers, not kernels: described under the table


def _rows() -> Dict[str, List[str]]:
    """``{module: [cells]}`` of the table (rows opening with a backticked module name)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `(\w+)` \|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split(" | ")]
    return rows


def _kernel_modules() -> List[str]:
    """Public modules of the package that define a ``@triton.jit`` function, read from source."""
    out = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    "triton.jit" in ast.unparse(d) for d in node.decorator_list):
                out.append(path.stem)
                break
    return out


def _gpu_marked(path: Path, name: str) -> bool:
    """Whether test ``name`` of ``path`` is a CUDA test: ``@pytest.mark.gpu`` among its
    decorators, or a test of test_kernels_cuda.py (whose ``cuda`` parameter carries the mark)."""
    if path.name == "test_kernels_cuda.py":
        return True
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any("pytest.mark.gpu" in ast.unparse(d) for d in node.decorator_list)
    return False


def test_one_row_per_kernel_module():
    rows = _rows()
    assert sorted(rows) == sorted(set(_kernel_modules()) - HELPERS)
    assert all(len(cells) == 6 for cells in rows.values()), rows


def test_named_tests_benchmarks_and_references_exist():
    bench_src = BENCH.read_text()
    for module, cells in _rows().items():
        reference, tests, bench = cells[2], cells[3] + " " + cells[4], cells[5]
        for path, name in re.findall(r"`((?:test/srt/)?test_\w+\.py)(?:::(\w+))?`", tests):
            full = ROOT / path if path.startswith("test/") else ROOT / "test" / "kernels" / path
            assert full.exists(), (module, path)
            if name:
                assert f"def {name}(" in full.read_text(), (module, path, name)
        for script in re.findall(r"benchmark/kernels/(\w+\.py)", bench):
            assert (ROOT / "benchmark" / "kernels" / script).exists(), (module, script)
        for chosen in re.findall(r"--kernels (\w+)", bench):
            assert chosen == module and f'"{chosen}": bench_{chosen},' in bench_src, module
        assert "`" in bench and "`" in tests, (module, cells)
        for path, name in re.findall(r"`(test_\w+\.py)::(\w+)`", cells[4]):
            assert _gpu_marked(ROOT / "test" / "kernels" / path, name), (module, path, name)
        for dotted in re.findall(r"`([\w.]+\.\w+)`", reference):
            name = dotted if dotted.startswith("sglang.") else f"sgl_kernel.{dotted}"
            mod, attr = name.rsplit(".", 1)
            assert hasattr(importlib.import_module(mod), attr), (module, dotted)
