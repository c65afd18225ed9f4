"""Which kernel runs each part of the model: :class:`KernelChoices`, resolved once per runner.

No environment variable picks these kernels. Each default follows from what the runner already
knows (:func:`default_kernel_choices`):

* ``rmsnorm`` (every RMSNorm with its residual add, and KDA's gated output norm, as one launch:
  ``sgl_kernel.rmsnorm``) and ``mla_rope`` (MLA's query and key assembled with RoPE in one
  launch: ``sgl_kernel.mla_rope``): on for CUDA, where both measured faster inside CUDA graphs
  and passed the graph == eager gates (docs/performance.md); off elsewhere, where Triton would
  run in its interpreter.
* ``router`` (a MoE router's selection as one kernel: ``sgl_kernel.moe_router``) and
  ``moe_combine`` (the shared expert riding the routed experts' grouped mat-vecs, and the
  weighted combine as one kernel: ``sgl_kernel.moe_combine``): on with the Triton MoE runner,
  that is ``--moe-runner-backend triton``, or ``auto`` on CUDA. ``torch_native`` keeps the whole
  MoE block on its torch reference.
* ``small_m_gemm`` (dense projections, router gate and LM head of decode / verify batches
  through the batch-invariant ``sgl_kernel.small_m_gemm``): on for CUDA with block-fp8 weights,
  which it reads as they are (without it each dense call dequantises its weight), and for 16-bit
  weights on CUDA when ``enable_deterministic_inference`` asks for batch-invariant results
  (upstream's ``--enable-deterministic-inference``): a row then rounds the same alone and beside
  other rows, so that bf16 speculative decoding equals plain decoding.
* ``mla_absorb_gemv`` (MLA's absorbed per-head products, ``q_nope @ W_UK`` and ``o @ W_UV``,
  as one grouped mat-vec each: ``sgl_kernel.grouped_gemv``, a tile fixed by the weight's shape)
  instead of ``torch.bmm``, whose library kernel may round a token differently at another
  batch size: on for CUDA with ``enable_deterministic_inference``, off otherwise (its cost on
  the decode step is not measured).
* ``moe_align_kernel`` (the expert sort of the Triton MoE's grouped GEMM path, above the
  small-M batches, as three Triton launches: ``sgl_kernel.moe_align``, instead of the torch
  ops of ``moe_align.moe_align``, a multi-pass radix sort among them; the same
  alignment bit for bit): on with the Triton MoE backend on CUDA, where it took the 42-layer
  fp8 prefill of 1024 tokens from about 2550 MoE kernels to 474 (docs/performance.md, "Prefill
  census, 2026-12-05"). Only the Triton MoE backend's grouped GEMM path reads it.
* ``moe_fp8_activations`` and ``dense_fp8_activations`` ("w8a8" above the small-M range, the
  published fp8 checkpoints' ``activation_scheme: dynamic``: a block-fp8 layer's input quantised
  per token and 128-column group, ``sgl_kernel.fp8_act_quant``, and multiplied on the fp8 tensor
  cores; decode stays weight-only). For the Triton MoE's grouped GEMMs
  (``sgl_kernel.moe_grouped_gemm``): on for CUDA with block-fp8 weights, where the H200 sweep
  timed both grouped GEMMs 1.7x faster than on bf16 activations at 8192 tokens and 1.8x at
  1024, and the accuracy gate held (docs/performance.md, "Prefill MoE: swept fp8 tiles and fp8
  activations"). For the dense projections (``sgl_kernel.fp8_gemm``'s tiled GEMM instead of a
  dequantised weight and cuBLAS): off, measured slower.
* ``dense_scaled_mm`` (the dense projections' w8a8 product above the small-M range on torch's
  block-scaled ``_scaled_mm``, cuBLASLt's fp8 GEMM with 1 x 128 / 128 x 128 scales:
  ``sgl_kernel.fp8_scaled_mm``; each weight shape checked once against the dequantised product,
  each row group written into its columns of one output, a group off the library's rules
  weight-only on its weight dequantised once, so no call dequantises a weight): on for CUDA
  with block-fp8 weights, where on the H100 the model's dense projections of an 8192-token
  prefill took 37.2 ms this way against 54.7 ms for the one-pass dequantisation and cuBLAS
  (``benchmark/kernels/bench_fp8_gemm.py``, docs/performance.md) and the accuracy gate holds
  for w8a8 on every fp8 product; off elsewhere (the library is CUDA's).
* ``gated_act`` (the dense MLP's SwiGLU and MLA's sigmoid head gate each as one launch:
  ``sgl_kernel.gated_act``, where the torch forms take five to seven element-wise launches and
  fp32 intermediates): on for CUDA, where its CUDA test passed and the 42-layer fp8 decode step
  took 3.738 ms with it against 3.781 ms without (graphs + overlap, one call,
  docs/performance.md); off elsewhere.
* ``kda_norm_in_o_proj`` (KDA's output norm inside o_proj's loads; measured slower than its own
  launch) and ``moe_grouped_mm`` (the torch-native MoE's large batches through
  ``torch._grouped_mm``; never measured): off. ``pdl_weight_prefetch`` (the small-M GEMM's
  weight prefetch before its PDL dependency wait, active only with ``SGLANG_ENABLE_PDL``): on.

Tests and benchmarks force a path by passing ``ModelRunner(kernel_choices=KernelChoices(...))``
with the fields they force, the others left ``None`` (the default): ``KernelChoices(rmsnorm=True)``
runs the Triton norms on CPU under ``TRITON_INTERPRET=1``, ``KernelChoices(rmsnorm=False)`` the
torch norms on CUDA. Code that builds runners from a ``ServerArgs`` (a scheduler, a benchmark)
sets the record as its ``kernel_choices`` attribute (read by
``model_runner.runner_kwargs_from_server_args``); benchmark command lines spell it
``--kernel-choices rmsnorm=0,router=1`` (:meth:`KernelChoices.parse`).

This module imports nothing from the layers and not torch, so any module can import it.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from sglang.srt.configs.engine_defaults import parse_switch, resolve_kernel_backend

__all__ = ["KernelChoices", "default_kernel_choices", "add_kernel_choices_arg",
           "kernel_choices_from_args"]


@dataclass(frozen=True)
class KernelChoices:
    """One choice per kernel switch: ``True`` runs the Triton kernel (or the variant named),
    ``False`` the torch path, ``None`` the default :func:`default_kernel_choices` gives.

    A runner holds the resolved record (no ``None``) as ``ModelRunner.kernel_choices``; the
    module docstring says what each field selects and why its default is what it is.
    """

    rmsnorm: Optional[bool] = None
    mla_rope: Optional[bool] = None
    router: Optional[bool] = None
    moe_combine: Optional[bool] = None
    small_m_gemm: Optional[bool] = None
    mla_absorb_gemv: Optional[bool] = None
    kda_norm_in_o_proj: Optional[bool] = None
    moe_grouped_mm: Optional[bool] = None
    pdl_weight_prefetch: Optional[bool] = None
    moe_align_kernel: Optional[bool] = None
    moe_fp8_activations: Optional[bool] = None
    dense_fp8_activations: Optional[bool] = None
    dense_scaled_mm: Optional[bool] = None
    gated_act: Optional[bool] = None

    def __post_init__(self) -> None:
        for name, value in self.items().items():
            # An int or a string ("0") would read as a truthy choice; refuse it here.
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"KernelChoices.{name} must be True, False or None, "
                                f"got {value!r}")

    @classmethod
    def names(cls) -> List[str]:
        """The field names, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    def items(self) -> Dict[str, Optional[bool]]:
        """Field name -> choice, in declaration order."""
        return {name: getattr(self, name) for name in self.names()}

    def forced(self) -> Dict[str, bool]:
        """The fields set to ``True`` or ``False`` (what this record overrides)."""
        return {name: value for name, value in self.items().items() if value is not None}

    @property
    def is_resolved(self) -> bool:
        """Whether every field is decided (a runner's record)."""
        return all(value is not None for value in self.items().values())

    def resolve(self, device_type: str, *, quantized: bool, moe_runner_backend: str = "auto",
                enable_deterministic_inference: bool = False) -> "KernelChoices":
        """These choices over the defaults for this device, weights and flags (arguments as
        :func:`default_kernel_choices` takes them): a record with no ``None`` left."""
        base = default_kernel_choices(
            device_type, quantized=quantized, moe_runner_backend=moe_runner_backend,
            enable_deterministic_inference=enable_deterministic_inference)
        return dataclasses.replace(base, **self.forced())

    @classmethod
    def parse(cls, spec: str) -> "KernelChoices":
        """``"rmsnorm=0,router=1"`` (comma-separated ``field=value``, values as
        ``engine_defaults.parse_switch`` reads them) -> the record forcing those fields; an
        empty string forces nothing. ``ValueError`` names an unknown field or a bad value."""
        forced: Dict[str, bool] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in cls.names():
                raise ValueError(f"kernel choice {item!r} is not field=value with a field of "
                                 f"{', '.join(cls.names())}")
            forced[name] = parse_switch(f"kernel choice {name}", raw)
        return cls(**forced)

    def describe(self) -> str:
        """``field=1`` / ``field=0`` for each decided field (log lines, benchmark labels)."""
        return ",".join(f"{name}={int(value)}" for name, value in self.forced().items())


def default_kernel_choices(device_type: str, *, quantized: bool, moe_runner_backend: str = "auto",
                           enable_deterministic_inference: bool = False) -> KernelChoices:
    """The kernels a runner uses unless told otherwise (the rules in the module docstring).

    ``device_type``: ``"cuda"`` or ``"cpu"``; ``quantized``: the model has block-fp8 weights;
    ``moe_runner_backend``: ``--moe-runner-backend`` (``auto`` is resolved here, as the runner
    resolves it); ``enable_deterministic_inference``: batch-invariant dense GEMMs for 16-bit
    weights too.
    """
    cuda = device_type == "cuda"
    triton_moe = resolve_kernel_backend(moe_runner_backend, device_type) == "triton"
    return KernelChoices(
        rmsnorm=cuda,
        mla_rope=cuda,
        router=triton_moe,
        moe_combine=triton_moe,
        small_m_gemm=cuda and (quantized or bool(enable_deterministic_inference)),
        mla_absorb_gemv=cuda and bool(enable_deterministic_inference),
        kda_norm_in_o_proj=False,
        moe_grouped_mm=False,
        pdl_weight_prefetch=True,
        moe_align_kernel=cuda and triton_moe,
        moe_fp8_activations=cuda and quantized,
        dense_fp8_activations=False,
        dense_scaled_mm=cuda and quantized,
        gated_act=cuda,
    )


def add_kernel_choices_arg(parser: Any) -> None:
    """Add ``--kernel-choices`` (a benchmark's or tool's option, not a server flag) to
    ``parser`` (an ``argparse`` parser or argument group); read it back with
    :func:`kernel_choices_from_args`."""
    parser.add_argument(
        "--kernel-choices", type=str, default="",
        help="force kernel choices for an A/B, e.g. rmsnorm=0,router=1 (fields: "
             f"{', '.join(KernelChoices.names())}); unnamed ones keep their defaults")


def kernel_choices_from_args(args: argparse.Namespace) -> Optional[KernelChoices]:
    """The record ``--kernel-choices`` asks for, or None when it forces nothing."""
    choices = KernelChoices.parse(getattr(args, "kernel_choices", "") or "")
    return choices if choices.forced() else None
