"""``--load-format dummy``: deterministic random weights, no file I/O.

Used for presets (the real architecture without a checkpoint: memory, latency and shape tests)
and for tests. Values depend only on the seed, the parameter's name and its (per-rank) shape,
so the same seed, config and TP size give the same model; replicated parameters (norms, router)
are identical on every TP rank because they share name and shape.

Default rule, chosen so activations stay finite through all layers of the real model:
``>= 2-D`` weights ~ N(0, 1/fan_in) with fan_in = last dim (unit-variance outputs for
unit-variance inputs), 1-D weights named ``*norm*`` = 1 (identity norms), other 1-D = 0 (biases,
``A_log``, ``dt_bias``, expert bias). A parameter may override this with
``param.dummy_init = fn(tensor, generator)``.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

# Elements generated per call, so no temporary larger than this exists even for a 4 GB tensor.
_CHUNK_NUMEL = 1 << 26


def param_seed(seed: int, name: str) -> int:
    """A per-parameter seed: independent of construction order, equal for equal names."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def default_dummy_init(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Fill ``tensor`` in place following the module docstring's default rule."""
    if not tensor.is_floating_point():
        tensor.zero_()
    elif tensor.dim() >= 2:
        std = float(tensor.shape[-1]) ** -0.5
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), _CHUNK_NUMEL):
            flat[start:start + _CHUNK_NUMEL].normal_(0.0, std, generator=generator)
    elif tensor.dim() == 1 and "norm" in name.lower():
        tensor.fill_(1.0)
    else:
        tensor.zero_()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of ``model`` deterministically on its own device."""
    for name, param in model.named_parameters():
        data = param.data
        if not data.is_contiguous():
            raise ValueError(f"dummy init needs contiguous parameters; {name} is not")
        generator = torch.Generator(device=data.device)
        generator.manual_seed(param_seed(seed, name))
        hook = getattr(param, "dummy_init", None)
        if hook is not None:
            hook(data, generator)
        else:
            default_dummy_init(name, data, generator)
