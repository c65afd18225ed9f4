"""Tensor parallelism: process groups (gloo on CPU, NCCL on CUDA) and collectives."""
from sglang.srt.distributed.parallel_state import (
    broadcast_pyobj,
    destroy_distributed_environment,
    divide,
    get_cpu_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_min_ints,
)

__all__ = [
    "broadcast_pyobj",
    "destroy_distributed_environment",
    "divide",
    "get_cpu_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_min_ints",
]
