"""ModelRunner: one TP rank's model, memory pools and attention backend, run eagerly.

Init order (as upstream): TP group -> model (``get_model``) -> pools sized from memory -> attention
backend. :meth:`ModelRunner.forward` attaches the pools and backend to a :class:`ForwardBatch`,
lets the backend build its metadata and calls the model.

Example — prefill one request, then one greedy decode step (the caller, normally the scheduler,
owns slot bookkeeping: it allocates KV slots and records them in ``req_to_token``)::

    runner = ModelRunner(ModelConfig.from_path(path), device="cpu", dtype=torch.float32)
    req = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req])              # every sequence starts from zero state
    ids = torch.tensor([11, 12, 13, 14])
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(req, 0, loc)
    out = runner.forward(ForwardBatch.for_extend(ids, [req], [0], [len(ids)], loc))
    nxt = out.next_token_logits.argmax(-1)                # [1]

    loc = runner.token_to_kv_pool_allocator.alloc(1)
    runner.req_to_token_pool.write(req, len(ids), loc)
    out = runner.forward(ForwardBatch.for_decode(
        nxt, torch.tensor([req]), torch.tensor([len(ids) + 1]), loc))
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional, Sequence, Union

import torch

from sglang.srt.configs.engine_defaults import (
    AUTO_MAX_RUNNING_REQUESTS,
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_MEM_FRACTION_STATIC,
    STATE_TO_KV_MEMORY_RATIO,
    resolve_kernel_backend,
    resolve_pdl_flag,
    torch_dtype,
)
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state as ps
from sglang.srt.environ import envs, set_env_values
from sglang.srt.layers.activation import set_gated_act_backend
from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.layers.kernel_choices import KernelChoices
from sglang.srt.layers.layernorm import set_norm_backend
from sglang.srt.layers.linear import set_linear_backend
from sglang.srt.layers.moe.moe_layer import set_moe_runner_backend
from sglang.srt.layers.quantization.fp8 import set_fp8_activations
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, set_rope_backend
from sglang.srt.mem_cache.memory_pool import (
    KDAStatePool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.prefill_graph_runner import PrefillGraphRunner
from sglang.srt.model_loader.loader import get_model, model_weight_bytes
from sglang.srt.models.bailing_moe_v3 import set_kda_norm_in_o_proj, set_mla_absorb_gemv

if TYPE_CHECKING:
    from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

logger = logging.getLogger(__name__)

def resolve_dtype(dtype: Union[str, torch.dtype], hf_config: "BailingMoeV3Config") -> torch.dtype:
    """``--dtype``: a torch dtype or its name; ``"auto"`` takes ``torch_dtype`` of the config."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch_dtype(hf_config.torch_dtype if dtype == "auto" else dtype)


def mla_pool_layer_ids(config: "BailingMoeV3Config", is_draft: bool,
                       draft_extra_mla_layers: bool) -> List[int]:
    """Layer ids that get an MLA latent cache.

    An MTP draft has one layer, the MTP layer (id ``num_hidden_layers``). A target that will
    share its pools with such a draft (``draft_extra_mla_layers``) also reserves that layer id,
    even when its own config has no MTP layer (the draft may come from another checkpoint).
    """
    if is_draft:
        if config.num_nextn_predict_layers < 1:
            raise ValueError("a draft runner needs a config with num_nextn_predict_layers = 1")
        return [config.mtp_layer_id]
    ids = list(config.full_attention_layer_ids)
    if draft_extra_mla_layers:
        ids.append(config.mtp_layer_id)
    return ids


def kv_bytes_per_token(config: "BailingMoeV3Config", num_layers: int, dtype: torch.dtype) -> int:
    """Bytes one token occupies across the MLA latent caches."""
    return num_layers * config.kv_cache_dim * _itemsize(dtype)


def kda_bytes_per_slot(config: "BailingMoeV3Config", num_layers: int, local_heads: int,
                       conv_dtype: torch.dtype) -> int:
    """Bytes of one request slot across the KDA pools: conv windows plus the fp32 state."""
    d = config.head_dim
    conv = 3 * local_heads * d * max(config.short_conv_kernel_size - 1, 0) * _itemsize(conv_dtype)
    ssm = local_heads * d * d * 4
    return num_layers * (conv + ssm)


def kv_slots_from_memory(*, total_bytes: int, fraction: float, used_bytes: int,
                         req_map_bytes: int, state_bytes: int, bytes_per_token: int,
                         free_bytes: int, max_total_tokens: Optional[int] = None) -> int:
    """KV slots that fit in ``fraction * total_bytes`` after what is already allocated
    (``used_bytes``: the weights), the request map and the request slots' states
    (``state_bytes``: KDA state, its speculative copies, the speculative worker's per-slot
    state); capped by ``max_total_tokens``. Raises ``ValueError`` when nothing remains or the
    device lacks the free memory for the result (e.g. another process holds it)."""
    if bytes_per_token <= 0:
        raise ValueError("no MLA layer to size a KV cache for")
    gib = float(1 << 30)
    budget = int(total_bytes * fraction)
    left = budget - used_bytes - req_map_bytes - state_bytes
    tokens = left // bytes_per_token - 1  # slot 0 is the padding slot
    if tokens < 1:
        raise ValueError(
            f"mem_fraction_static={fraction} allows {budget / gib:.2f} GiB but the weights take "
            f"{used_bytes / gib:.2f} GiB, the request map {req_map_bytes / gib:.2f} GiB and the "
            f"KDA state slots {state_bytes / gib:.2f} GiB (with any speculative copies): no "
            "memory is left for the KV cache; "
            "raise --mem-fraction-static or lower --max-running-requests / --context-length")
    if max_total_tokens is not None:
        tokens = min(tokens, int(max_total_tokens))
    need = req_map_bytes + state_bytes + (tokens + 1) * bytes_per_token
    if need > free_bytes:
        raise ValueError(
            f"the pools need {need / gib:.2f} GiB but only {free_bytes / gib:.2f} GiB of device "
            "memory is free (another process on this GPU?); lower --mem-fraction-static")
    return int(tokens)


def _fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (log lines)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class SlotCost:
    """Bytes one request slot takes, by part: the sizing counts them all, the log names them.

    ``kda_state``: the slot's KDA conv windows and fp32 state over all KDA layers;
    ``spec_copies``: staged copies of that state per slot (the KDA pool's stage-then-commit
    scratch, one per chain position of a speculative round: ``SpecRequirements
    .kda_scratch_depth``); ``draft_state``: what the speculative worker itself keeps per slot
    (its relay payload and chain buffers: ``SpecRequirements.draft_*_per_request_slot``);
    ``req_map_row``: the slot's row of the request->token map.
    """

    kda_state: int
    spec_copies: int = 0
    draft_state: int = 0
    req_map_row: int = 0

    @property
    def total(self) -> int:
        """Bytes of one slot, every part included."""
        return self.kda_state * (1 + self.spec_copies) + self.draft_state + self.req_map_row

    def describe(self) -> str:
        """``"<total> per slot = KDA state <x> x (1 + N speculative copies) + ..."``."""
        kda = f"KDA state {_fmt_bytes(self.kda_state)}"
        if self.spec_copies:
            kda += f" x (1 + {self.spec_copies} speculative copies)"
        parts = [kda]
        if self.draft_state:
            parts.append(f"speculative worker state {_fmt_bytes(self.draft_state)}")
        parts.append(f"request map row {_fmt_bytes(self.req_map_row)}")
        return f"{_fmt_bytes(self.total)} per slot = " + " + ".join(parts)


@dataclass(frozen=True)
class RequestSlotPlan:
    """How :func:`plan_request_slots` chose ``slots`` (kept for the start-up log and tests).

    ``by_share``: the slots whose states fit in ``ratio / (1 + ratio)`` of ``left_bytes``;
    ``by_kv``: the slots that still leave the KV cache ``min_kv_tokens`` slots; ``cap``: the
    most allowed. ``slots`` is the smallest of the three, but at least 1.
    """

    slots: int
    cost: SlotCost
    left_bytes: int  # the budget minus the weights
    bytes_per_token: int
    min_kv_tokens: int
    ratio: float
    by_share: int
    by_kv: int
    cap: int

    @property
    def limited_by(self) -> str:
        """Which bound set :attr:`slots`."""
        bound = min(self.by_share, self.by_kv, self.cap)
        if bound < 1:
            return "the minimum of one slot (no slot fits within the bounds)"
        if bound == self.cap:
            return "the cap"
        if bound == self.by_share:
            return f"the state share {self.ratio:g}/{1 + self.ratio:g}"
        return "the KV room for one full-context request"

    def describe(self) -> str:
        """One log line: the count, what it came from and which bound set it."""
        return (f"{self.slots} of {_fmt_bytes(self.left_bytes)} the weights leave, "
                f"{self.cost.describe()}; at most {self.by_share} by the state share "
                f"{self.ratio:g}/{1 + self.ratio:g}, {self.by_kv} leaving the KV cache "
                f"{self.min_kv_tokens} tokens x {self.bytes_per_token} B (one request of the "
                f"full context), cap {self.cap}: set by {self.limited_by}")


def plan_request_slots(*, total_bytes: int, fraction: float, used_bytes: int, cost: SlotCost,
                       bytes_per_token: int, min_kv_tokens: int,
                       cap: int = AUTO_MAX_RUNNING_REQUESTS,
                       ratio: float = STATE_TO_KV_MEMORY_RATIO) -> RequestSlotPlan:
    """Request slots when ``--max-running-requests`` is not given on CUDA.

    What the weights (``used_bytes``, a draft's still-to-load weights included) leave of
    ``fraction * total_bytes`` is shared between the request slots (``cost.total`` bytes each:
    KDA state, its speculative copies, the speculative worker's own per-slot state, the request
    map row) and the KV cache (``bytes_per_token`` per KV slot, a draft's per-KV-slot store
    included). The slots take at most ``ratio / (1 + ratio)`` of it and leave the KV cache at
    least ``min_kv_tokens`` slots (one request at the full context); both bounds count the
    padding slot every pool has. At least 1 slot, at most ``cap``: when even one does not fit,
    :func:`kv_slots_from_memory` then reports the budget as too small.
    """
    left = int(total_bytes * fraction) - used_bytes
    slot_bytes = cost.total
    if slot_bytes <= 0:
        return RequestSlotPlan(cap, cost, left, bytes_per_token, min_kv_tokens, ratio,
                               cap, cap, cap)
    # "- 1": the padding slot 0 of the request map, the KDA pool and the worker's relay.
    by_share = int(left * ratio / (1.0 + ratio)) // slot_bytes - 1
    # The KV pool has a padding slot too: one full-context request needs min_kv_tokens + 1.
    by_kv = (left - (min_kv_tokens + 1) * bytes_per_token) // slot_bytes - 1
    slots = int(max(1, min(cap, by_share, by_kv)))
    return RequestSlotPlan(slots, cost, left, bytes_per_token, min_kv_tokens, ratio,
                           int(by_share), int(by_kv), int(cap))


def request_slots_from_memory(*, total_bytes: int, fraction: float, used_bytes: int,
                              slot_bytes: int, bytes_per_token: int, min_kv_tokens: int,
                              cap: int = AUTO_MAX_RUNNING_REQUESTS,
                              ratio: float = STATE_TO_KV_MEMORY_RATIO) -> int:
    """:func:`plan_request_slots`'s count for slots of ``slot_bytes`` bytes each (all parts
    together)."""
    return plan_request_slots(total_bytes=total_bytes, fraction=fraction, used_bytes=used_bytes,
                              cost=SlotCost(kda_state=slot_bytes),
                              bytes_per_token=bytes_per_token, min_kv_tokens=min_kv_tokens,
                              cap=cap, ratio=ratio).slots


def request_slot_cost(config: "BailingMoeV3Config", *, num_kda_layers: int, local_heads: int,
                      dtype: torch.dtype, span: int, spec_copies: int = 0,
                      draft_state_bytes: int = 0) -> SlotCost:
    """One request slot of a runner over ``config``: ``num_kda_layers`` KDA layers of
    ``local_heads`` heads (conv windows in ``dtype``), ``spec_copies`` staged copies of that
    state, ``draft_state_bytes`` of the speculative worker's own, and a request-map row of
    ``span`` int32 positions."""
    return SlotCost(kda_state=kda_bytes_per_slot(config, num_kda_layers, local_heads, dtype),
                    spec_copies=spec_copies if num_kda_layers else 0,
                    draft_state=draft_state_bytes, req_map_row=span * 4)


class DeviceMemory(NamedTuple):
    """What the memory plan reads of a device: free and total bytes, bytes already allocated
    (the weights loaded so far)."""

    free: int
    total: int
    allocated: int


def device_memory(device: torch.device) -> Optional[DeviceMemory]:
    """The memory the pools are sized from: the CUDA device's figures, None elsewhere (the
    pools then take fixed sizes). Tests replace this function to plan a CPU runner's pools
    from a fake budget."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total), int(torch.cuda.memory_allocated(device)))


def _sizes_from_memory(runner: Any, mem_fraction_static, max_total_tokens) -> bool:
    """Whether ``runner``'s pools are sized from device memory: when the device reports its
    memory (CUDA), unless ``max_total_tokens`` alone (no ``mem_fraction_static``) sizes them."""
    return (device_memory(runner.device) is not None
            and not (mem_fraction_static is None and max_total_tokens))


def _slot_cost(runner: Any, kda_ids, local_heads) -> SlotCost:
    """One request slot of ``runner``: its KDA state, the spec scratch (one more copy of that
    state per chain position), the speculative worker's per-slot state, its request-map row."""
    return request_slot_cost(runner.hf_config, num_kda_layers=len(kda_ids),
                             local_heads=local_heads, dtype=runner.dtype,
                             span=runner.context_len + runner.position_headroom,
                             spec_copies=runner.spec_num_draft_tokens,
                             draft_state_bytes=runner.draft_bytes_per_req_slot)


def _token_bytes(runner: Any, mla_ids) -> int:
    """Bytes of one KV slot: the MLA latent rows plus a draft's own per-slot store."""
    return (kv_bytes_per_token(runner.hf_config, len(mla_ids), runner.dtype)
            + runner.draft_bytes_per_kv_slot)


def _used_bytes(runner: Any, mem: DeviceMemory) -> int:
    """Weights (+ any earlier runner), and weights still to come (an MTP draft's)."""
    return mem.allocated + runner.reserved_weight_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def runner_kwargs_from_server_args(server_args: Any, tp_rank: int = 0,
                                   nccl_port: Union[None, int, str] = None) -> dict:
    """:class:`ModelRunner` keyword arguments for one TP rank, from ``ServerArgs`` (the flags that
    size and place the model; callers override what they size themselves)."""
    kwargs = dict(
        device=server_args.resolved_device(),
        dtype=server_args.resolved_dtype(),
        tp_rank=tp_rank,
        tp_size=server_args.tp_size,
        nccl_port=nccl_port,
        load_format=server_args.load_format,
        attention_backend=server_args.attention_backend,
        kda_prefill_impl=server_args.kda_prefill_impl,
        linear_attn_decode_backend=server_args.linear_attn_decode_backend,
        moe_runner_backend=server_args.moe_runner_backend,
        max_total_tokens=server_args.max_total_tokens,
        mem_fraction_static=server_args.mem_fraction_static,
        context_length=server_args.context_length,
        random_seed=server_args.random_seed,
        quantization=getattr(server_args, "quantization", None),
        draft_quantization=getattr(server_args, "speculative_draft_model_quantization", None),
        # Upstream's --enable-deterministic-inference: batch-invariant dense GEMMs for 16-bit
        # weights too (KernelChoices.small_m_gemm's default).
        enable_deterministic_inference=getattr(server_args, "enable_deterministic_inference",
                                               False),
        # Not a server flag: tests and benchmarks that build runners through a ServerArgs set
        # this attribute to force kernel choices (layers/kernel_choices.py).
        kernel_choices=getattr(server_args, "kernel_choices", None),
    )
    if server_args.max_running_requests is not None:
        kwargs["max_running_requests"] = server_args.max_running_requests
    return kwargs


class ModelRunner:
    """Holds one TP rank's model, pools and attention backend; runs forwards eagerly.

    Pool sizing: on CUDA, ``mem_fraction_static`` (default :data:`DEFAULT_MEM_FRACTION_STATIC`) of the device's total memory is
    the budget for everything allocated statically (weights, request map, KDA state slots, MLA
    KV slots); what the weights leave is split into ``max_running_requests`` state slots and as
    many KV slots as fit, capped by ``max_total_tokens`` if given, else by
    ``max_running_requests * context_len`` (more can never be used). Without
    ``max_running_requests`` the slots are sized first (:func:`plan_request_slots`: every
    per-slot cost counted, speculative ones included; at most ``request_slot_cap``, else
    :data:`AUTO_MAX_RUNNING_REQUESTS`; the KV cache keeps room for one full-context request).
    On CPU, or on CUDA with only ``max_total_tokens`` given, that many KV slots are allocated
    (CPU default: ``min(context_len * max_running_requests, 16384)``) and
    ``request_slot_cap`` (else :data:`DEFAULT_MAX_RUNNING_REQUESTS`) request slots.

    A draft runner (``is_draft``) may reuse the target's pools by passing them in; the target
    must then have been built with ``draft_extra_mla_layers=True`` so its MLA pool covers the
    MTP layer.

    Speculative target (sized from the worker's
    :class:`~sglang.srt.rounds.contract.SpecRequirements`): with
    ``spec_num_draft_tokens = N > 0`` the KDA pool gets the stage-then-commit scratch for ``N``
    chain positions (counted in the CUDA memory plan, as are the weights of
    ``draft_model_config``'s draft, which loads after the pools, or ``draft_weight_elems`` weight
    elements and ``draft_elems_per_kv_slot`` elements of a draft store per KV slot, and the
    worker's own ``draft_elems_per_request_slot`` elements plus ``draft_bytes_per_request_slot``
    bytes per request slot), and the request->token map and
    the RoPE tables get ``position_headroom`` positions beyond the context length, because the
    device may run one round past a request's finish before the host notices (the scheduler's
    admission still limits requests to the context length).

    Kernels (:mod:`sglang.srt.layers.kernel_choices`): each layer's Triton kernel or torch path
    follows the device, the weights' quantization, ``moe_runner_backend`` and
    ``enable_deterministic_inference`` (batch-invariant dense GEMMs for 16-bit weights on CUDA);
    ``kernel_choices`` forces the fields it sets (tests, benchmarks). The resolved record is
    ``self.kernel_choices``.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: Union[str, torch.device],
        dtype: Union[str, torch.dtype],
        tp_rank: int = 0,
        tp_size: int = 1,
        nccl_port: Union[None, int, str] = None,
        load_format: str = "auto",
        attention_backend: str = "torch_native",
        kda_prefill_impl: str = "auto",
        linear_attn_decode_backend: str = "auto",
        moe_runner_backend: str = "auto",
        max_running_requests: Optional[int] = None,
        max_total_tokens: Optional[int] = None,
        mem_fraction_static: Optional[float] = None,
        context_length: Optional[int] = None,
        random_seed: int = 0,
        is_draft: bool = False,
        draft_extra_mla_layers: bool = False,
        req_to_token_pool: Optional[ReqToTokenPool] = None,
        token_to_kv_pool_allocator: Optional[TokenToKVPoolAllocator] = None,
        token_to_kv_pool: Optional[MLATokenToKVPool] = None,
        kda_state_pool: Optional[KDAStatePool] = None,
        spec_num_draft_tokens: int = 0,
        position_headroom: int = 0,
        draft_model_config: Optional[ModelConfig] = None,
        draft_weight_elems: int = 0,
        draft_elems_per_kv_slot: int = 0,
        draft_elems_per_request_slot: int = 0,
        draft_bytes_per_request_slot: int = 0,
        request_slot_cap: Optional[int] = None,
        quantization: Optional[str] = None,
        draft_quantization: Optional[str] = None,
        enable_deterministic_inference: bool = False,
        kernel_choices: Optional[KernelChoices] = None,
    ):
        if not (isinstance(tp_size, int) and tp_size >= 1 and 0 <= tp_rank < tp_size):
            raise ValueError(
                f"need tp_size >= 1 and 0 <= tp_rank < tp_size, got {tp_rank}/{tp_size}")
        if max_running_requests is not None and max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
        if not isinstance(spec_num_draft_tokens, int) or spec_num_draft_tokens < 0:
            raise ValueError(f"spec_num_draft_tokens must be an int >= 0, got {spec_num_draft_tokens!r}")
        if spec_num_draft_tokens and is_draft:
            raise ValueError("spec_num_draft_tokens belongs to the target runner, not the draft")
        if not isinstance(position_headroom, int) or position_headroom < 0:
            raise ValueError(f"position_headroom must be an int >= 0, got {position_headroom!r}")
        if request_slot_cap is not None and request_slot_cap < 1:
            raise ValueError(f"request_slot_cap must be >= 1, got {request_slot_cap}")
        self.request_slot_cap = request_slot_cap
        # How the request slots were sized from memory (None: given, shared, or fixed).
        self.request_slot_plan: Optional[RequestSlotPlan] = None
        self.spec_num_draft_tokens = spec_num_draft_tokens
        self.position_headroom = position_headroom
        self.model_config = model_config
        self.hf_config = model_config.hf_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.is_draft = is_draft
        self.max_running_requests = max_running_requests
        self.dtype = resolve_dtype(dtype, self.hf_config)
        self.device = self._init_device(torch.device(device))
        self.context_len = self._resolve_context_len(context_length)
        self._init_distributed(nccl_port)
        torch.manual_seed(random_seed)

        # Weights loaded after this runner's pools (an MTP draft's own layers, ~6 GB for
        # Ling-3.0-flash's MTP layer), counted per TP rank, so after the TP group exists.
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.reserved_weight_bytes = draft_weight_elems * elem + (
            0 if draft_model_config is None
            else model_weight_bytes(draft_model_config, dtype=self.dtype, is_draft=True,
                                    quantization=draft_quantization or quantization))
        # A draft's own per-KV-slot store (a block drafter's context K/V), allocated after
        # the pools.
        self.draft_bytes_per_kv_slot = draft_elems_per_kv_slot * elem
        # The speculative worker's own state per request slot (its relay payload, chain
        # buffers), allocated after the pools: part of what a request slot costs.
        self.draft_bytes_per_req_slot = draft_elems_per_request_slot * elem \
            + draft_bytes_per_request_slot
        # --quantization (a draft runner gets the draft's choice as its ``quantization``).
        self.model = get_model(model_config, load_format=load_format, dtype=self.dtype,
                               device=self.device, is_draft=is_draft, seed=random_seed,
                               quantization=quantization)
        moe_runner_backend = resolve_kernel_backend(moe_runner_backend, self.device.type)
        linear_attn_decode_backend = resolve_kernel_backend(linear_attn_decode_backend,
                                                            self.device.type)
        self._init_kernels(moe_runner_backend, enable_deterministic_inference, kernel_choices)
        self._init_pools(draft_extra_mla_layers, max_total_tokens, mem_fraction_static,
                         req_to_token_pool, token_to_kv_pool_allocator, token_to_kv_pool,
                         kda_state_pool)
        self.attn_backend = create_attn_backend(
            attention_backend, kda_prefill_impl=kda_prefill_impl,
            linear_attn_decode_backend=linear_attn_decode_backend,
            batch_invariant=self.enable_deterministic_inference, invariant_span=self.context_len)
        self._grow_rope_tables()
        self.prefill_graphs: Optional[PrefillGraphRunner] = None  # init_prefill_graphs
        set_vars = set_env_values()
        if set_vars and tp_rank == 0:  # what a set SGLANG_* variable resolved to, once
            logger.info("SGLANG_* variables set: %s",
                        ", ".join(f"{k}={v!r}" for k, v in set_vars.items()))

    # ------------------------------------------------------------------ init steps
    def _init_kernels(self, moe_runner_backend: str, enable_deterministic_inference: bool,
                      kernel_choices: Optional[KernelChoices]) -> None:
        """Resolve the kernel choices (``kernel_choices`` forces fields; the rest follow the
        device, the weights' quantization, the MoE backend and
        ``enable_deterministic_inference``: layers/kernel_choices.py) and point the model's
        layers at them, before any forward or graph capture."""
        if kernel_choices is not None and not isinstance(kernel_choices, KernelChoices):
            raise TypeError(f"kernel_choices must be a KernelChoices, got {kernel_choices!r}")
        # What was asked for, unresolved: a runner built beside this one (an MTP draft, whose
        # quantization may differ) resolves the same request for its own weights.
        self.requested_kernel_choices = kernel_choices
        self.enable_deterministic_inference = bool(enable_deterministic_inference)
        quantized = getattr(self.model, "quant_config", None) is not None
        kc = (kernel_choices or KernelChoices()).resolve(
            self.device.type, quantized=quantized, moe_runner_backend=moe_runner_backend,
            enable_deterministic_inference=self.enable_deterministic_inference)
        self.kernel_choices = kc
        self.moe_runner_backend = set_moe_runner_backend(
            self.model, moe_runner_backend, self.device, router=kc.router,
            fused_combine=kc.moe_combine, grouped_mm=kc.moe_grouped_mm,
            align_kernel=kc.moe_align_kernel)
        self.triton_norms = set_norm_backend(self.model, kc.rmsnorm, self.device)
        self.triton_rope = set_rope_backend(self.model, kc.mla_rope, self.device)
        set_gated_act_backend(self.model, kc.gated_act, self.device)
        self.small_m_gemm = set_linear_backend(self.model, kc.small_m_gemm, self.device)
        set_kda_norm_in_o_proj(self.model, kc.kda_norm_in_o_proj)
        set_mla_absorb_gemv(self.model, kc.mla_absorb_gemv)
        set_fp8_activations(self.model, moe=kc.moe_fp8_activations,
                            dense=kc.dense_fp8_activations, dense_scaled_mm=kc.dense_scaled_mm)
        self.pdl = self._init_pdl(kc.pdl_weight_prefetch)
        if quantized and self.device.type == "cuda" and not self.small_m_gemm:
            logger.warning("fp8 weights with KernelChoices(small_m_gemm=False): every dense "
                           "layer dequantises its weight in torch at each forward (the small-M "
                           "GEMM reads the fp8 weight itself at decode, a one-pass Triton "
                           "dequantisation serves prefill; docs/performance.md)")
        if kernel_choices is not None and kernel_choices.forced() and self.tp_rank == 0:
            logger.info("kernel choices forced: %s (resolved: %s)", kernel_choices.describe(),
                        kc.describe())

    def _init_pdl(self, weight_prefetch: bool) -> bool:
        """Programmatic dependent launch for the Triton decode kernels (``SGLANG_ENABLE_PDL``)
        and the small-M GEMM's weight prefetch under it: process-wide switches of
        ``sgl_kernel.pdl``, set here, before any graph is captured."""
        cap = (torch.cuda.get_device_capability(self.device) if self.device.type == "cuda"
               else (0, 0))
        wanted = resolve_pdl_flag(envs.SGLANG_ENABLE_PDL.get(), self.device.type, cap)
        if self.device.type != "cuda":
            return False
        from sgl_kernel.pdl import set_pdl, set_weight_prefetch

        set_weight_prefetch(weight_prefetch)
        return set_pdl(wanted)

    def _init_device(self, device: torch.device) -> torch.device:
        """On CUDA each TP rank owns GPU ``tp_rank`` unless an explicit index was given."""
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device 'cuda' requested but CUDA is not available")
            if device.index is None:
                device = torch.device("cuda", self.tp_rank)
            torch.cuda.set_device(device)
        return device

    def _resolve_context_len(self, context_length: Optional[int]) -> int:
        model_len = self.model_config.context_len
        if context_length is None:
            return model_len
        if context_length < 1 or context_length > model_len:
            raise ValueError(
                f"context_length {context_length} must be in [1, {model_len}] "
                "(max_position_embeddings of the model)"
            )
        return int(context_length)

    def _init_distributed(self, nccl_port: Union[None, int, str]) -> None:
        if self.tp_size == 1:
            ps.init_distributed_environment(1, 0, "")
            return
        if (torch.distributed.is_initialized()
                and ps.get_tensor_model_parallel_world_size() == self.tp_size):
            return  # a second runner (the draft) in a process whose TP group already exists
        if nccl_port is None:
            raise ValueError("tp_size > 1 needs nccl_port (a TCP port or an init_method URL)")
        init_method = nccl_port if isinstance(nccl_port, str) else f"tcp://127.0.0.1:{nccl_port}"
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cpu":
            ps.set_cpu_threads_for_rank(self.tp_size)
        ps.init_distributed_environment(self.tp_size, self.tp_rank, init_method, backend=backend)

    def _init_pools(self, draft_extra_mla_layers, max_total_tokens, mem_fraction_static,
                    req_to_token_pool, token_to_kv_pool_allocator, token_to_kv_pool,
                    kda_state_pool) -> None:
        cfg = self.hf_config
        mla_ids = mla_pool_layer_ids(cfg, self.is_draft, draft_extra_mla_layers)
        kda_ids = [] if self.is_draft else cfg.kda_layer_ids
        local_heads = ps.divide(cfg.num_attention_heads, self.tp_size, "num_attention_heads")
        shared = (req_to_token_pool, token_to_kv_pool_allocator, token_to_kv_pool)
        if any(p is not None for p in shared):
            self._adopt_pools(shared, kda_state_pool, mla_ids)
            return
        if kda_state_pool is not None:
            raise ValueError("kda_state_pool may only be shared together with the other pools")
        # Each TP rank sizes from its own memory, but the ranks schedule the same batches: all
        # take the smallest rank's counts (identities for TP = 1).
        if self.max_running_requests is None:
            self.max_running_requests, = ps.tensor_model_parallel_min_ints([
                self._plan_request_slots(mla_ids, kda_ids, local_heads, mem_fraction_static,
                                         max_total_tokens)])
        self.max_total_num_tokens, = ps.tensor_model_parallel_min_ints([self._plan_kv_tokens(
            mla_ids, kda_ids, local_heads, max_total_tokens, mem_fraction_static)])
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests,
                                                self.context_len + self.position_headroom,
                                                self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_num_tokens,
                                                                 self.device)
        self.token_to_kv_pool = MLATokenToKVPool(
            self.max_total_num_tokens, mla_ids, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            self.dtype, self.device)
        self.kda_state_pool = KDAStatePool(
            self.max_running_requests, kda_ids, local_heads, cfg.head_dim, cfg.head_dim,
            cfg.short_conv_kernel_size, self.dtype, self.device,
            spec_num_draft_tokens=self.spec_num_draft_tokens if kda_ids else 0)
        logger.info("pools: %d KV slots over MLA layers %s, %d request slots over %d KDA layers",
                    self.max_total_num_tokens, mla_ids, self.max_running_requests, len(kda_ids))

    def _adopt_pools(self, shared, kda_state_pool, mla_ids: List[int]) -> None:
        """Reuse pools built by another runner (the target's, for an MTP draft)."""
        if any(p is None for p in shared):
            raise ValueError("share all of req_to_token_pool, token_to_kv_pool_allocator and "
                             "token_to_kv_pool, or none")
        self.req_to_token_pool, self.token_to_kv_pool_allocator, self.token_to_kv_pool = shared
        missing = [i for i in mla_ids if i not in self.token_to_kv_pool.layer_ids]
        if missing:
            raise ValueError(
                f"shared MLA pool lacks layer(s) {missing}; build the target runner with "
                "draft_extra_mla_layers=True")
        self.kda_state_pool = kda_state_pool
        self.max_total_num_tokens = self.token_to_kv_pool.size
        self.context_len = min(self.context_len, self.req_to_token_pool.max_context_len)
        self.max_running_requests = self.req_to_token_pool.size

    def _plan_request_slots(self, mla_ids, kda_ids, local_heads, mem_fraction_static,
                            max_total_tokens) -> int:
        """Request slots without ``--max-running-requests``: :func:`plan_request_slots` when the
        pools are sized from memory (at most ``request_slot_cap``, else
        :data:`AUTO_MAX_RUNNING_REQUESTS`); otherwise ``request_slot_cap``, else
        :data:`DEFAULT_MAX_RUNNING_REQUESTS`."""
        if not _sizes_from_memory(self, mem_fraction_static, max_total_tokens):
            return self.request_slot_cap or DEFAULT_MAX_RUNNING_REQUESTS
        span = self.context_len + self.position_headroom
        mem = device_memory(self.device)
        plan = plan_request_slots(
            total_bytes=mem.total, fraction=mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC,
            used_bytes=_used_bytes(self, mem), cost=_slot_cost(self, kda_ids, local_heads),
            bytes_per_token=_token_bytes(self, mla_ids),
            min_kv_tokens=min(span, int(max_total_tokens or span)),
            cap=self.request_slot_cap or AUTO_MAX_RUNNING_REQUESTS)
        self.request_slot_plan = plan
        logger.info("request slots sized from memory (--max-running-requests sets them): %s",
                    plan.describe())
        return plan.slots

    def _plan_kv_tokens(self, mla_ids, kda_ids, local_heads, max_total_tokens,
                        mem_fraction_static) -> int:
        """Number of KV slots (see the class docstring for the rule)."""
        if not _sizes_from_memory(self, mem_fraction_static, max_total_tokens):
            if max_total_tokens is not None:
                return int(max_total_tokens)
            return min(self.context_len * self.max_running_requests, CPU_DEFAULT_MAX_TOTAL_TOKENS)

        fraction = mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        span = self.context_len + self.position_headroom
        # An explicit max_total_tokens is the user's size (if it fits). By default, more slots
        # than every request slot filled to the context length can never be used; without this
        # cap a tiny model would take nearly the whole GPU for its KV cache.
        cap = (int(max_total_tokens) if max_total_tokens is not None
               else self.max_running_requests * span)
        mem = device_memory(self.device)
        cost = _slot_cost(self, kda_ids, local_heads)
        slots = self.max_running_requests + 1  # + the padding slot of every per-slot buffer
        tokens = kv_slots_from_memory(
            total_bytes=mem.total, fraction=fraction, used_bytes=_used_bytes(self, mem),
            req_map_bytes=slots * cost.req_map_row,
            state_bytes=slots * (cost.total - cost.req_map_row),
            bytes_per_token=_token_bytes(self, mla_ids),
            free_bytes=mem.free - self.reserved_weight_bytes, max_total_tokens=cap)
        if tokens < self.context_len:
            logger.warning("only %d KV slots fit; fewer than context_len %d", tokens,
                           self.context_len)
        return tokens

    def _grow_rope_tables(self) -> None:
        """RoPE tables cover ``max_position_embeddings``; on CUDA positions are not checked per
        step, so tables that must reach into the speculative headroom are grown once here."""
        need = self.req_to_token_pool.max_context_len  # the largest position any forward sees + 1
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding) and need > module.max_position_embeddings:
                module.cos_sin_cache(self.device, need)

    def max_cuda_graph_tokens(self) -> Optional[int]:
        """The most tokens a captured forward may hold: the smallest limit any module declares
        through a ``max_cuda_graph_tokens()`` method (a MoE block whose expert path reads
        counts on the host above some batch), None when none does."""
        limits = [m.max_cuda_graph_tokens() for m in self.model.modules()
                  if m is not self.model and callable(getattr(m, "max_cuda_graph_tokens", None))]
        limits = [x for x in limits if x is not None]  # None: no limit
        return min(limits) if limits else None

    # ------------------------------------------------------------------ running
    def init_prefill_graphs(self, buckets: Sequence[int], **keywords: Any) -> PrefillGraphRunner:
        """Capture one-request prefills padded to ``buckets`` tokens
        (:class:`~sglang.srt.model_executor.prefill_graph_runner.PrefillGraphRunner`, which
        takes ``keywords``: capture modes, forward mode, per-token inputs, emulation);
        :meth:`forward` replays them from then on for the prefills they fit."""
        self.prefill_graphs = PrefillGraphRunner(self, buckets, **keywords)
        return self.prefill_graphs

    def forward(self, forward_batch: ForwardBatch, **model_kwargs: Any) -> "LogitsProcessorOutput":
        """Run one forward: a captured prefill graph's replay where one fits
        (:meth:`init_prefill_graphs`), else :meth:`forward_eager`."""
        if self.prefill_graphs is not None:
            out = self.prefill_graphs.run(forward_batch, model_kwargs)
            if out is not None:
                self._attach(forward_batch)  # as after an eager forward, for the caller
                return out
        return self.forward_eager(forward_batch, **model_kwargs)

    def _attach(self, forward_batch: ForwardBatch) -> None:
        """Give the batch this runner's pools and attention backend."""
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.kda_state_pool = self.kda_state_pool
        forward_batch.attn_backend = self.attn_backend

    def forward_eager(self, forward_batch: ForwardBatch,
                      **model_kwargs: Any) -> "LogitsProcessorOutput":
        """Run one eager forward; fills the batch's pool/backend handles first.

        ``model_kwargs`` go to ``model.forward``. An MTP draft needs ``hidden_states`` (the
        target's final-normed hidden states, row-aligned with the tokens); when not given it is
        taken from ``forward_batch.spec_info.hidden_states``.
        """
        if self.is_draft and "hidden_states" not in model_kwargs:
            hidden = getattr(forward_batch.spec_info, "hidden_states", None)
            if hidden is None:
                raise ValueError("a draft forward needs hidden_states (as a keyword or in "
                                 "forward_batch.spec_info.hidden_states)")
            model_kwargs["hidden_states"] = hidden
        self._attach(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        # no_grad rather than inference_mode: outputs may later be updated in place by the
        # scheduler, which inference tensors forbid outside inference mode.
        with torch.no_grad():
            return self.model.forward(forward_batch.input_ids, forward_batch.positions,
                                      forward_batch, **model_kwargs)
