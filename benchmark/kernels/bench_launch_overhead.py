"""Host time per kernel launch on the GPU, by launch path: what an eager prefill pays per kernel.

An eager prefill of the 20-layer fp8 model launches about 800 kernels and its host needs about
98 ms to do so, whatever the prompt's length (docs/performance.md, "Where an eager prefill's
host time goes"); cProfile there puts Triton's launch path and fla's wrappers first but
overstates Python-dense code. This script times the launch paths themselves, unprofiled: the
host's wall time for ``--launches`` back-to-back launches of kernels whose device time is
shorter than the launch (so the GPU never throttles the host), in microseconds per launch:

* ``triton_jit``: a ``@triton.jit`` kernel with an argument list like the engine's kernels
  (8 tensors, 6 integers, a float, 4 constexprs) launched as ``kernel[grid](...)``;
* ``triton_compiled``: the same compiled kernel through its ``CompiledKernel[grid](...)``
  runner (no binder, no specialisation key, no cache lookup);
* ``torch_add``: one small torch element-wise op, ``torch.add(a, 1, out=b)``;
* ``rmsnorm``: ``sgl_kernel.rmsnorm.rmsnorm`` on 4 rows of 2560 (the engine's wrapper: checks,
  allocation, one Triton launch);
* ``fla_chunk_kda``: the engine's ``fla_kda.chunk_kda_varlen`` on 64 tokens of one sequence at
  Ling-3.0-flash's width (32 heads of 128), per call (fla's wrappers and its kernels).

Needs CUDA. ``--json`` appends one line per row; ``--profile-fla N`` prints a cProfile of N
calls of the fla row (where its host time goes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(p0, p1, p2, p3, p4, p5, p6, p7, i0, i1, i2, i3, i4, i5, f0,
                  C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr):
    # One store: the kernel's device time stays below any launch's host time.
    if tl.program_id(0) == 0:
        tl.store(p0, tl.load(p1) + i0 * C0 + f0)


def _per_launch_us(fn: Callable[[], object], launches: int) -> float:
    """Host microseconds per call of ``fn`` over ``launches`` calls (after a warm-up), the
    device drained before and after."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / launches * 1e6


def measure(launches: int, profile_calls: int = 0) -> List[Dict[str, object]]:
    """One row per launch path (module docstring); ``profile_calls`` > 0 also prints a cProfile
    of that many ``fla_chunk_kda`` calls."""
    dev = torch.device("cuda")
    bufs = [torch.zeros(16, device=dev) for _ in range(8)]
    ints = [3, 16, 1024, 2560, 7, 64]
    consts = dict(C0=1, C1=2, C2=4, C3=8)
    grid = (1,)

    def jit():
        return _probe_kernel[grid](*bufs, *ints, 0.5, **consts)

    compiled = jit()
    runner = compiled[(1, 1, 1)]
    all_args = [*bufs, *ints, 0.5, *consts.values()]
    stream = torch.cuda.current_stream().cuda_stream

    a, b = torch.zeros(16, device=dev), torch.zeros(16, device=dev)
    rows: List[Dict[str, object]] = [
        {"path": "triton_jit", "us": _per_launch_us(jit, launches)},
        {"path": "triton_compiled",
         "us": _per_launch_us(lambda: runner(*all_args, stream=stream), launches)},
        {"path": "torch_add", "us": _per_launch_us(lambda: torch.add(a, 1, out=b), launches)},
    ]
    from sgl_kernel.rmsnorm import rmsnorm

    x = torch.randn(4, 2560, device=dev, dtype=torch.bfloat16)
    w = torch.ones(2560, device=dev, dtype=torch.bfloat16)
    rows.append({"path": "rmsnorm", "us": _per_launch_us(lambda: rmsnorm(x, w, 1e-6), launches)})
    from sglang.srt.layers.attention import fla_kda

    if fla_kda.is_available():
        t, h, d = 64, 32, 128
        q, k, v = (torch.nn.functional.normalize(torch.randn(t, h, d, device=dev), dim=-1)
                   .to(torch.bfloat16) for _ in range(3))
        g = -torch.rand(t, h, d, device=dev) * 0.1
        beta = torch.rand(t, h, device=dev)
        state = torch.zeros(1, h, d, d, device=dev)
        varlen = fla_kda.fla_varlen([t], range(1), dev)

        def kda():
            return fla_kda.chunk_kda_varlen(q, k, v, g, beta, d ** -0.5, state, [t],
                                            varlen.cu_seqlens, varlen.cu_seqlens_cpu)

        rows.append({"path": "fla_chunk_kda", "us": _per_launch_us(kda, max(launches // 20, 10)),
                     "kernels": _count_kernels(kda)})
        if profile_calls:
            _print_profile(kda, profile_calls)
    return rows


def _print_profile(fn: Callable[[], object], calls: int) -> None:
    """cProfile of ``calls`` calls of ``fn``: the functions with the most time of their own,
    then by cumulative time (cProfile slows Python-dense code more than C calls)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(30)


def _count_kernels(fn: Callable[[], object]) -> int:
    """Device work items (kernels, copies, memsets) one call of ``fn`` launches, as the
    censuses count them (``benchmark/batch1/census_common.device_events``)."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batch1"))
    from census_common import device_events

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return len(device_events(prof.events()))


def main(argv: List[str] = None) -> List[Dict[str, object]]:
    parser = argparse.ArgumentParser(prog="benchmark/kernels/bench_launch_overhead.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=2000, help="launches per path")
    parser.add_argument("--json", default=None, help="append one JSON line per row here")
    parser.add_argument("--profile-fla", type=int, default=0, metavar="CALLS",
                        help="also print a cProfile of this many fla_chunk_kda calls")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_launch_overhead.py: needs a CUDA device (it times GPU kernel launches)")
    rows = measure(args.launches, args.profile_fla)
    name = torch.cuda.get_device_name()
    print(f"host time per launch on {name} (triton {triton.__version__}, torch "
          f"{torch.__version__}), {args.launches} launches each:")
    print("| path | µs per call | kernels per call |\n|---|---|---|")
    for row in rows:
        print(f"| {row['path']} | {row['us']:.2f} | {row.get('kernels', 1)} |")
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "device": name, "triton": triton.__version__,
                                    "torch": torch.__version__}) + "\n")
    return rows


if __name__ == "__main__":
    main()
