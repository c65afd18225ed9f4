"""Fixtures shared by the engine-level tests of test/srt."""
import os

import pytest


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
