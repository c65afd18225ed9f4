"""Cold-L2 timing shared by the kernel benchmarks: the weight-streaming kernels of a batch-1 step
read weights that every other layer has pushed out of L2, so each timed call here does too."""
from __future__ import annotations

import os
import time
from typing import Callable, Tuple

import torch

FLUSH_BYTES = 256 << 20  # > the H200's L2 (60 MB)
SPIN_CYCLES = 1_000_000  # about 0.5 ms at the H200's clock: longer than any wrapper's launch


def flush_buffer(device: str) -> torch.Tensor:
    """The buffer :func:`cold_time_us` writes before each call (1 byte off CUDA: no L2 to flush)."""
    return torch.empty(FLUSH_BYTES if device == "cuda" else 1, dtype=torch.uint8, device=device)


def cold_time_us(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    """Mean microseconds of ``fn()`` (after one warm-up call): CUDA events with ``flush`` written
    before each call on CUDA; wall clock off CUDA (smoke runs under Triton's interpreter)."""
    fn()
    if not flush.is_cuda:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1e6 * (time.perf_counter() - start) / iters
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        # Keep the GPU busy while the host enqueues the call: otherwise a Python wrapper that
        # takes longer to launch than the flush takes to run is timed along with the kernel.
        torch.cuda._sleep(SPIN_CYCLES)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return 1000.0 * sum(s.elapsed_time(e) for s, e in zip(starts, ends)) / iters


def capture_graph(fn: Callable[[], object], calls: int = 1) -> "torch.cuda.CUDAGraph":
    """``calls`` calls of ``fn`` captured in one CUDA graph, after one warm-up call on a side
    stream (Triton compiles, a library picks its kernel, NCCL warms up on the capture stream,
    none of which a capture may do). Replay it to time the kernels without host launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def kernel_bench_device(script: str) -> Tuple[str, torch.dtype]:
    """``(device, dtype)`` of a kernel benchmark: CUDA in bf16, or under ``TRITON_INTERPRET=1``
    the CPU in fp32 (a smoke run of the script); anything else exits naming ``script``."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.cuda.is_available() and not interpreted:
        return "cuda", torch.bfloat16
    if not interpreted:
        raise SystemExit(f"{script} needs CUDA (or TRITON_INTERPRET=1 for a smoke run)")
    return "cpu", torch.float32
