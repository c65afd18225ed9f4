"""One switch for the layers that run either a one-launch Triton kernel or their torch form."""
from __future__ import annotations

from typing import Tuple, Type

import torch
from torch import nn


def set_use_triton(model: nn.Module, types: Tuple[Type[nn.Module], ...], on: bool,
                   choice: str, device: torch.device) -> bool:
    """Set ``use_triton`` on every module of ``model`` that is one of ``types``; returns ``on``.
    Turning it on needs CUDA, or ``TRITON_INTERPRET=1`` on CPU (tests): otherwise a
    ``ValueError`` that names ``choice`` (the ``KernelChoices`` field asking for it)."""
    from sglang.srt.environ import require_triton_runtime

    if on:
        require_triton_runtime(f"KernelChoices({choice}=True)", device.type)
    for module in model.modules():
        if isinstance(module, types):
            module.use_triton = on
    return on
