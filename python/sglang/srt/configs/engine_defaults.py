"""Engine-wide defaults and choice lists, defined once.

``server_args`` (the CLI), the model runner, the attention registry and the layers all need the
same numbers and names; each is written here so that two modules can never disagree (one of them
used to size memory with a different ``mem_fraction_static`` than the CLI announced). This module
imports nothing from the engine and does not import torch at import time, so any module,
including a layer, can import it without a cycle and without slowing ``--help`` down.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

__all__ = [
    "DEFAULT_MEM_FRACTION_STATIC",
    "DEFAULT_MAX_RUNNING_REQUESTS",
    "AUTO_MAX_RUNNING_REQUESTS",
    "STATE_TO_KV_MEMORY_RATIO",
    "SPECULATIVE_MAX_RUNNING_REQUESTS",
    "DEFAULT_CHUNKED_PREFILL_SIZE",
    "DEFAULT_MAX_PREFILL_TOKENS",
    "CPU_DEFAULT_MAX_TOTAL_TOKENS",
    "DEFAULT_CUDA_GRAPH_MAX_BS",
    "SPECULATIVE_CUDA_GRAPH_MAX_BS",
    "DEFAULT_PREFILL_CUDA_GRAPH_TOKENS",
    "default_cuda_graph_batch_sizes",
    "DTYPE_CHOICES",
    "DTYPE_ALIASES",
    "torch_dtype",
    "DEVICE_CHOICES",
    "LOAD_FORMAT_CHOICES",
    "QUANTIZATION_CHOICES",
    "LOG_LEVEL_CHOICES",
    "KERNEL_BACKEND_CHOICES",
    "resolve_kernel_backend",
    "parse_switch",
    "KDA_PREFILL_IMPL_CHOICES",
    "ATTENTION_BACKEND_CHOICES",
    "SUBSTITUTED_ATTENTION_BACKENDS",
    "KNOWN_UPSTREAM_ATTENTION_BACKENDS",
    "UPSTREAM_ONLY_FLAGS",
    "FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES",
    "LOG_REQUESTS_LEVEL_CHOICES",
    "DEFAULT_LOG_REQUESTS_LEVEL",
    "DEFAULT_WATCHDOG_TIMEOUT",
    "CPU_MAX_DEFAULT_THREADS",
    "available_cpu_cores",
    "default_cpu_num_threads",
]

# ---------------------------------------------------------------------------- memory and batching
# Fraction of the GPU's memory planned for weights, caches and states (upstream's value).
DEFAULT_MEM_FRACTION_STATIC = 0.85
# Request slots when --max-running-requests is not given and speculation is off, off CUDA (on
# CUDA the slots are sized from memory, see below).
DEFAULT_MAX_RUNNING_REQUESTS = 16
# On CUDA without --max-running-requests: the request slots (KDA state, its speculative copies
# and the algorithm's own per-slot state) may take up to this ratio of the memory the KV cache
# gets (upstream's default --mamba-full-memory-ratio, 0.9), i.e. 0.9 / 1.9 of what the weights
# leave, while the KV cache keeps room for one request of the full context length; no more
# slots than this cap (SPECULATIVE_MAX_RUNNING_REQUESTS with speculation).
STATE_TO_KV_MEMORY_RATIO = 0.9
AUTO_MAX_RUNNING_REQUESTS = 256
# Upstream resets the default running-request cap to this when speculation is on. Here it caps
# the slots sized from memory on CUDA (each slot then also holds the speculative algorithm's
# per-slot state: rounds/contract.py, SpecRequirements), and is the slot count off CUDA.
SPECULATIVE_MAX_RUNNING_REQUESTS = 48
# Tokens per prefill chunk (--chunked-prefill-size; -1 disables chunking).
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
# Prompt tokens of new requests one prefill batch takes at most (--max-prefill-tokens, upstream's
# default); a longer prompt still starts alone, in chunks.
DEFAULT_MAX_PREFILL_TOKENS = 16384
# Token slots on CPU without --max-total-tokens: enough for tests and demos, small for host memory.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384

# ---------------------------------------------------------------------------- CUDA graphs
# Largest captured batch when --cuda-graph-max-bs is not given: batched serving (request slots
# sized from memory, up to AUTO_MAX_RUNNING_REQUESTS) replays decode steps up to 64 requests;
# a verify graph holds num_draft_tokens rows per request, hence the smaller speculative cap.
# Both are further capped by --max-running-requests and by the request slots.
DEFAULT_CUDA_GRAPH_MAX_BS = 64
SPECULATIVE_CUDA_GRAPH_MAX_BS = 16
# Prompt sizes whose one-request prefill is captured as a CUDA graph when
# --prefill-cuda-graph-tokens is not given (on CUDA; each capped at --chunked-prefill-size, and
# only the smallest of them where the decode graphs leave less room below the graph count that
# slows every replay: model_executor/prefill_graph_runner.py, auto_prefill_graph_tokens). An
# eager prefill of the large models is bound by its host's launches up to thousands of tokens;
# with sizes a factor two apart a padded replay beats it for short and mid-size prompts and
# matches it for long ones (docs/performance.md, "Prefill graphs by default").
DEFAULT_PREFILL_CUDA_GRAPH_TOKENS = (1024, 2048, 4096, 8192)


def default_cuda_graph_batch_sizes(max_bs: int, speculative: bool = False) -> List[int]:
    """Upstream's capture buckets up to ``max_bs``, sorted, always ending with ``max_bs``.

    A batch is replayed on the smallest captured size that holds it, so buckets trade capture
    time and memory against padding. Without speculation: 1, 2, 4, 8, 12, then every 8 up to
    256, every 16 up to 512, every 32 beyond. With speculation (each request is several verify
    rows, so padding costs more): every size up to 8, every 2 up to 32, every 4 up to 64, every
    8 up to 256, every 16 beyond.
    """
    if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"cuda graph max batch size must be an integer >= 1, got {max_bs!r}")
    if speculative:
        steps = ((1, 8, 1), (10, 32, 2), (40, 64, 4), (72, 256, 8), (272, max_bs, 16))
        sizes = [bs for lo, hi, step in steps for bs in range(lo, hi + 1, step)]
    else:
        sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
        sizes += list(range(512, max_bs + 1, 32))
    return sorted({bs for bs in sizes if bs < max_bs} | {max_bs})


# ---------------------------------------------------------------------------- dtypes
# --dtype choices (upstream's spellings); "auto" is bf16 on CUDA and fp32 on CPU for the server,
# and the config's torch_dtype where a checkpoint decides.
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "half", "float")
# Every accepted dtype name (CLI spellings, config.json torch_dtype, short forms) -> the name of
# the torch dtype attribute.
DTYPE_ALIASES: Dict[str, str] = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "float32": "float32", "float": "float32", "fp32": "float32",
}


def torch_dtype(name: str):
    """The ``torch.dtype`` called ``name`` (any spelling of :data:`DTYPE_ALIASES`).

    ``"auto"`` is not resolved here: what it means depends on the device or the checkpoint.
    Raises ``ValueError`` listing the accepted names.
    """
    canonical = DTYPE_ALIASES.get(name) if isinstance(name, str) else None
    if canonical is None:
        raise ValueError(f"unsupported dtype {name!r}; choose one of "
                         f"{', '.join(sorted(DTYPE_ALIASES))}")
    import torch  # here, not at import time: this module stays cheap to import

    return getattr(torch, canonical)


# ---------------------------------------------------------------------------- other CLI choices
DEVICE_CHOICES = ("auto", "cuda", "cpu")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy")
# --quantization and --speculative-draft-model-quantization: block fp8, or the model dtype
# ("unquant"; dequantises an fp8 checkpoint). Unset: whatever the checkpoint is.
QUANTIZATION_CHOICES = ("fp8", "unquant")
LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")
# --log-requests-level (upstream's levels): 0 metadata, 1 + sampling parameters, 2 + the input and
# output cut to a few thousand characters, 3 + everything.
LOG_REQUESTS_LEVEL_CHOICES = (0, 1, 2, 3)
DEFAULT_LOG_REQUESTS_LEVEL = 2
# --flashinfer-allreduce-fusion-backend values upstream accepts (only "auto" is served here).
FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES = ("auto", "trtllm", "mnnvl")
# --watchdog-timeout: seconds a scheduler may go without finishing a forward while it has work.
DEFAULT_WATCHDOG_TIMEOUT = 300.0

# ---------------------------------------------------------------------------- CPU threads
# Default cap on torch's intra-op threads per scheduler process (--cpu-num-threads unset, CPU).
# OpenMP threads meet at a barrier after every op: when the machine is shared (other TP ranks,
# this server's own tokenizer and detokenizer processes, a CI job next door) and there are more
# threads than free cores, one preempted thread holds up every op, and the step time collapses
# instead of degrading. The small matrices of a batch-1 decode step gain little past a few
# threads anyway, so a few threads per rank are the safe default; --cpu-num-threads overrides.
CPU_MAX_DEFAULT_THREADS = 4


def available_cpu_cores() -> int:
    """Cores this process may run on: its CPU affinity (``taskset``, cgroup cpusets), which can
    be fewer than ``os.cpu_count()`` reports on a shared machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def default_cpu_num_threads(tp_size: int, cores: int) -> int:
    """Threads per scheduler when ``--cpu-num-threads`` is unset: the ``cores`` split between
    the ``tp_size`` ranks, at most :data:`CPU_MAX_DEFAULT_THREADS`, at least one."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    return max(1, min(CPU_MAX_DEFAULT_THREADS, cores // tp_size))

# ---------------------------------------------------------------------------- backends
# --moe-runner-backend / --linear-attn-decode-backend: "triton" runs the project's kernels
# (sgl-kernel), "torch_native" the reference, "auto" see resolve_kernel_backend.
KERNEL_BACKEND_CHOICES = ("auto", "triton", "torch_native")


def resolve_kernel_backend(choice: str, device_type: str) -> str:
    """``--moe-runner-backend`` / ``--linear-attn-decode-backend``: ``auto`` is ``triton`` on
    CUDA (the grouped-GEMV MoE and the KDA recurrence: faster in CUDA graphs and passing the
    graph == eager and NEXTN-lossless gates, docs/performance.md) and ``torch_native`` elsewhere
    (the reference; Triton would run in its interpreter)."""
    if choice not in KERNEL_BACKEND_CHOICES:
        raise ValueError(f"kernel backend must be one of {', '.join(KERNEL_BACKEND_CHOICES)}, "
                         f"got {choice!r}")
    if choice != "auto":
        return choice
    return "triton" if device_type == "cuda" else "torch_native"


# The words parse_switch reads as on / off.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_switch(name: str, raw: str, allow_auto: bool = False) -> Optional[bool]:
    """The one parser of boolean (and ``auto``) values, of ``SGLANG_*`` variables and of the
    benchmarks' ``--kernel-choices``: True / False for :data:`TRUE_WORDS` / :data:`FALSE_WORDS`
    (case-insensitive), None for ``auto`` when ``allow_auto``; else ``ValueError`` naming
    ``name`` (what the value was given for) and the accepted words."""
    value = raw.strip().lower()
    if allow_auto and value == "auto":
        return None
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    words = ("auto",) * allow_auto + TRUE_WORDS + FALSE_WORDS
    raise ValueError(f"{name}={raw!r} is not a {'switch' if allow_auto else 'boolean'}; use "
                     f"one of {', '.join(words)}")


def resolve_pdl_flag(raw: str, device_type: str, capability: tuple = (0, 0)) -> bool:
    """``SGLANG_ENABLE_PDL``: ``auto`` is on for CUDA devices of compute capability 9.0 or newer
    (programmatic dependent launch needs Hopper); ``1`` there too, an error elsewhere."""
    wanted = parse_switch("environment variable SGLANG_ENABLE_PDL", raw, allow_auto=True)
    able = device_type == "cuda" and tuple(capability) >= (9, 0)
    if wanted and not able:
        raise ValueError(f"SGLANG_ENABLE_PDL={raw!r} needs a CUDA device of compute capability "
                         f"9.0 or newer, got {device_type} {tuple(capability)}")
    return able if wanted is None else wanted


# --kda-prefill-impl: torch = the chunked reference, fla = fla-core's chunk_kda (CUDA), auto.
KDA_PREFILL_IMPL_CHOICES = ("auto", "torch", "fla")
# --attention-backend values this engine implements.
ATTENTION_BACKEND_CHOICES = ("torch_native", "triton")
# Upstream backends for other hardware that are served by this device's default backend (triton
# on CUDA, torch_native on CPU) so that published launch commands work unchanged. trtllm_mla is
# Blackwell-only upstream (FlashInfer's TRT-LLM MLA kernels); here the engine's MLA does its work.
SUBSTITUTED_ATTENTION_BACKENDS = ("trtllm_mla",)
# Names upstream SGLang accepts but this engine does not implement (a clearer error than
# "unknown").
KNOWN_UPSTREAM_ATTENTION_BACKENDS = (
    "flashinfer", "fa3", "fa4", "flashmla", "cutlass_mla", "cutedsl_mla", "trtllm_mha",
    "flex_attention", "hpc_ops", "aiter", "wave", "dsa", "dsv4", "ascend", "intel_amx",
)

# Upstream SGLang server flags this engine does not have. The CLI names such a flag as an upstream
# one that is not implemented here instead of offering a look-alike flag of this engine
# (--dp-size is no misspelling of --tp-size). Not exhaustive: any other unknown flag is refused too.
UPSTREAM_ONLY_FLAGS = frozenset((
    # parallelism beyond tensor parallel
    "--dp-size", "--data-parallel-size", "--enable-dp-attention", "--enable-dp-lm-head",
    "--ep-size", "--expert-parallel-size", "--pp-size", "--pipeline-parallel-size",
    "--nnodes", "--node-rank", "--dist-init-addr", "--dist-timeout", "--base-gpu-id",
    "--gpu-id-step", "--moe-a2a-backend", "--deepep-mode", "--enable-eplb",
    "--enable-two-batch-overlap", "--load-balance-method",
    # compilation and kernels
    "--enable-torch-compile", "--torch-compile-max-bs", "--disable-cuda-graph-padding",
    "--enable-cudagraph-gc", "--cuda-graph-max-bs-decode", "--cuda-graph-bs-decode",
    "--cuda-graph-config", "--prefill-attention-backend", "--decode-attention-backend",
    "--mm-attention-backend", "--sampling-backend", "--grammar-backend",
    "--triton-attention-num-kv-splits", "--enable-flashinfer-allreduce-fusion",
    "--disable-shared-experts-fusion",
    # LoRA, memory and caches
    "--enable-lora", "--lora-paths", "--max-loras-per-batch", "--lora-backend",
    "--kv-cache-dtype", "--page-size", "--enable-hierarchical-cache", "--hicache-ratio",
    "--mamba-full-memory-ratio", "--max-mamba-cache-size", "--disable-chunked-prefix-cache",
    "--enable-memory-saver", "--quantization-param-path", "--max-queued-requests",
    # scheduling, serving and disaggregation
    "--schedule-policy", "--schedule-conservativeness", "--num-continuous-decode-steps",
    "--disaggregation-mode", "--disaggregation-transfer-backend", "--tool-call-parser",
    "--reasoning-parser", "--skip-tokenizer-init", "--tokenizer-mode", "--revision",
    "--download-dir", "--is-embedding", "--allow-auto-truncate", "--file-storage-path",
    "--enable-custom-logit-processor", "--speculative-token-map",
    "--speculative-accept-threshold-single", "--speculative-accept-threshold-acc",
    # logging and debugging
    "--log-level-http", "--enable-cache-report", "--show-time-cost", "--enable-nan-detection",
    "--enable-p2p-check", "--crash-dump-folder", "--enable-metrics-for-all-schedulers",
))
