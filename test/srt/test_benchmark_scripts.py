"""The measurement scripts under benchmark/ still run (CPU smoke runs on the bundled model)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_round_census_attributes_a_nextn_round_to_its_phases():
    cmd = [sys.executable, str(ROOT / "benchmark/batch1/round_census.py"), "--device", "cpu",
           "--dtype", "float32", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
           "--prompt-len", "16", "--steps", "2", "--warmup", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "python"), str(ROOT / "sgl-kernel/python"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    ops = {m.group(1): float(m.group(2))
           for m in re.finditer(r"^\| ([^|*]+?) \| (\d+) \|", out.stdout, re.MULTILINE)}
    for phase in ("target forward", "KDA verify (in target)", "MTP forward", "acceptance"):
        assert ops.get(phase, 0) > 0, (phase, out.stdout)
    assert "unprofiled" in out.stdout


def test_grouped_gemv_sweep_runs_and_ranks_configs():
    """benchmark/kernels/tune_grouped_gemv.py on tiny shapes in the interpreter: every config is
    checked against the reference and both projections get a ranked table with the default."""
    cmd = [sys.executable, str(ROOT / "benchmark/kernels/tune_grouped_gemv.py"), "--experts", "8",
           "--hidden", "64", "--intermediate", "32", "--topk", "2", "--block-n", "8", "16",
           "--block-k", "32", "--num-warps", "4", "--num-stages", "1", "--iters", "2",
           "--check-tokens", "2"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "python"), str(ROOT / "sgl-kernel/python"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("up+SwiGLU", "down"):
        table = out.stdout.split(f"### {name}")[1].split("###")[0]
        labels = re.findall(r"^\| ([\w/]+) \| [\d.]+ \|", table, re.MULTILINE)
        assert sorted(labels) == ["16/32/4/1", "8/32/4/1", "default"], table
        assert "2 tokens (4 pairs" in table, table
