"""Tensor-parallel process group state and collectives.

One TP group per engine (no pipeline or data parallelism). On CPU the group uses gloo, on CUDA
NCCL. With ``tp_size == 1`` nothing is initialised and every collective is the identity, so the
model code calls the same functions in both cases.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: Optional[dist.ProcessGroup] = None
# A gloo group beside the NCCL one for CPU-side object broadcasts (requests from rank 0).
_CPU_GROUP: Optional[dist.ProcessGroup] = None


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the TP group (``world_size`` == tp_size). ``init_method`` is e.g. ``tcp://127.0.0.1:PORT``."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _CPU_GROUP
    _TP_RANK, _TP_SIZE = rank, world_size
    if world_size == 1:
        _TP_GROUP = _CPU_GROUP = None
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
    _TP_GROUP = dist.group.WORLD
    _CPU_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else _TP_GROUP


def destroy_distributed_environment() -> None:
    """Leave the group (safe to call when never initialised)."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP, _CPU_GROUP = 0, 1, None, None


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def get_tp_group() -> Optional[dist.ProcessGroup]:
    return _TP_GROUP


def get_cpu_group() -> Optional[dist.ProcessGroup]:
    """Group for host-side objects (gloo even when tensors go over NCCL)."""
    return _CPU_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place when TP > 1); identity for TP = 1."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's ``x`` along ``dim`` in rank order; identity for TP = 1."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_min_ints(values: Sequence[int]) -> List[int]:
    """The element-wise minimum of host integers over the TP group (gloo): a decision every
    rank must take alike from numbers each rank measures itself. Identity for TP = 1."""
    if _TP_SIZE == 1:
        return [int(v) for v in values]
    box = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return [int(v) for v in box.tolist()]


def broadcast_pyobj(obj, src: int = 0):
    """Send a picklable object from ``src`` to every rank (host side); identity for TP = 1."""
    if _TP_SIZE == 1:
        return obj
    box = [obj if _TP_RANK == src else None]
    dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
    return box[0]


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact division for TP sharding, with an error naming what did not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def free_port() -> int:
    """A free TCP port on localhost (for init_method and ZMQ endpoints)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_cpu_threads_for_rank(tp_size: int) -> None:
    """Split CPU threads between TP ranks so two gloo ranks do not oversubscribe the cores."""
    if tp_size > 1 and not torch.cuda.is_available():
        n = max(1, (os.cpu_count() or 1) // tp_size)
        torch.set_num_threads(n)
