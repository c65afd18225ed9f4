"""Shared pytest configuration: GPU tests skip cleanly without CUDA; tests run in fp32 on CPU."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep instead of spinning. The tests run tiny shapes on two intra-op
# threads, often with a spawned scheduler or server beside them; spinning threads then take the
# cores the other process needs (a bundled-model forward measured 16x slower on a busy 2-core
# machine). The thread count, and so every result, is unchanged. Set before torch (and its
# OpenMP runtime) is first loaded, below; spawned processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests
        return False


# Without a GPU, Triton kernels run in Triton's CPU interpreter. The mode is fixed when triton is
# first imported (its own library functions are decorated then), so it is set here, first.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def two_torch_threads():
    """At most two intra-op threads for the module (engine tests on the CI machine's 2 cores),
    restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(n)
