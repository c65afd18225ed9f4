"""Fixtures shared by the engine-level tests of test/srt."""
import os

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread_children():
    """Spawned schedulers inherit the environment: one thread each is fastest for tiny shapes and
    does not oversubscribe the shared CI cores (``pytest.mark.usefixtures`` in the module)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module's in-process forwards: tiny matmuls are fastest on
    one thread, and the CI machine's two cores are shared (``pytest.mark.usefixtures``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
