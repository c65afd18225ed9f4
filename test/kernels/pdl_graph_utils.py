"""Shared by the kernel tests of PDL (sgl_kernel.pdl): run a step inside a CUDA graph with PDL
off and on and hand back both outputs, for a bit-for-bit comparison on an sm90+ GPU."""
from __future__ import annotations

from typing import Callable, List, Sequence

import pytest
import torch


def skip_without_pdl() -> None:
    """Skip the calling test unless this is a GPU of compute capability 9.0 or newer."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs a CUDA GPU of compute capability 9.0")


def outputs_without_and_with_pdl(step: Callable[[], Sequence[torch.Tensor]]
                                 ) -> List[List[torch.Tensor]]:
    """``[outputs with PDL off, outputs with PDL on]`` of ``step`` captured in a CUDA graph and
    replayed once. ``step`` must rebuild its inputs from pristine copies first (an in-place
    kernel then replays to the same result), which also puts a torch kernel before the first
    PDL launch, as in a real step."""
    from sgl_kernel import pdl

    results = []
    for enabled in (False, True):
        try:
            assert pdl.set_pdl(enabled) == enabled
            step()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = step()
            graph.replay()
            torch.cuda.synchronize()
            results.append([o.clone() for o in outs])
        finally:
            pdl.set_pdl(False)
    return results


def assert_bitwise_equal(results: List[List[torch.Tensor]]) -> None:
    """Every output of the PDL run equals the non-PDL one bit for bit."""
    off, on = results
    assert len(off) == len(on)
    for i, (a, b) in enumerate(zip(off, on)):
        assert torch.equal(a, b), f"output {i} differs with PDL on"
