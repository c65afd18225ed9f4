"""Shared by the Triton kernel tests: the device they run on and the mark that skips them where
Triton can run neither compiled (CUDA) nor interpreted (test/conftest.py sets TRITON_INTERPRET=1
without CUDA, before triton is first imported)."""
from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1 set before triton is imported (test/conftest.py)")
