"""Server arguments: SGLang's flag names and defaults, validated and resolved in one place.

``ServerArgs`` is built either directly (``ServerArgs(model_path=..., tp_size=2)``, as the
``Engine`` API does) or from the command line (``prepare_server_args(sys.argv[1:])``). On
construction it fills device-dependent defaults (``_resolve``) and validates (``check``): a
contradictory or unsupported value raises ``ValueError`` whose message starts with the flag it is
about, and the CLI turns that into an argparse error (exit code 2). The flags themselves are
registered by ``server_args_cli``; ``--config FILE.yaml`` is merged by
``server_args_config_parser``.

``PortArgs`` (defined in ``port_args``, re-exported here) names the ZMQ IPC endpoints that
connect the tokenizer, scheduler and detokenizer processes.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set

from sglang.srt.arg_checks import int_at_least, is_int, is_number, one_of
from sglang.srt.configs.engine_defaults import (  # re-exported: scripts and tests import them here
    ATTENTION_BACKEND_CHOICES,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DEFAULT_MEM_FRACTION_STATIC,
    DEFAULT_LOG_REQUESTS_LEVEL,
    DEFAULT_WATCHDOG_TIMEOUT,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES,
    KDA_PREFILL_IMPL_CHOICES,
    KERNEL_BACKEND_CHOICES,
    KNOWN_UPSTREAM_ATTENTION_BACKENDS,
    LOAD_FORMAT_CHOICES,
    LOG_LEVEL_CHOICES,
    LOG_REQUESTS_LEVEL_CHOICES,
    QUANTIZATION_CHOICES,
    SPECULATIVE_CUDA_GRAPH_MAX_BS,
    SPECULATIVE_MAX_RUNNING_REQUESTS,
    SUBSTITUTED_ATTENTION_BACKENDS,
    available_cpu_cores,
    default_cpu_num_threads,
    default_cuda_graph_batch_sizes,
    torch_dtype,
)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, parse_override_args, resolve_model_path
from sglang.srt.environ import (require_triton_runtime, warn_compat_envs,
                                warn_unknown_sglang_env_vars)
from sglang.srt.managers.template_manager import check_chat_template
from sglang.srt.port_args import PortArgs  # noqa: F401  (re-exported: upstream's import path)
from sglang.srt.rounds.registry import (arg_classes, canonical_name, check_algorithm_args,
                                        resolve_algorithm_args)
from sglang.srt.server_args_cli import NO_OP_FLAGS, ServerArgumentParser, register_server_flags
from sglang.srt.server_args_config_parser import ConfigArgumentMerger

logger = logging.getLogger(__name__)

# The name this module has always used for the implemented attention backends.
SUPPORTED_ATTENTION_BACKENDS = ATTENTION_BACKEND_CHOICES

# NO_OP_FLAGS already described in this process's log (each is described once).
_NO_OP_LOGGED: Set[str] = set()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class ServerArgs(*arg_classes()):
    """All launch options of the server/engine (field = flag name with ``-`` -> ``_``). Each
    speculative algorithm's own fields come from its ``ARGS`` dataclass (keyword-only), joined
    here through :func:`sglang.srt.rounds.registry.arg_classes`."""

    # Model and tokenizer
    model_path: Optional[str] = None  # None: the bundled tiny model
    tokenizer_path: Optional[str] = None  # None: same as the model
    trust_remote_code: bool = False
    load_format: str = "auto"
    quantization: Optional[str] = None  # None: as the checkpoint is (fp8 if its config says so)
    json_model_override_args: str = "{}"
    context_length: Optional[int] = None  # None: from the model config
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None  # None: the tokenizer's own template
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    skip_server_warmup: bool = False
    # Runtime
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    tp_size: int = 1
    random_seed: Optional[int] = None
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    chunked_prefill_size: Optional[int] = None  # -1 disables chunking
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None  # None: max of cuda_graph_bs, else a small cap
    cuda_graph_bs: Optional[List[int]] = None  # None: upstream's buckets up to cuda_graph_max_bs
    # None: engine_defaults.DEFAULT_PREFILL_CUDA_GRAPH_TOKENS, fitted to the decode graphs at
    # start-up (prefill_graph_runner.auto_prefill_graph_tokens); [] or "none": every prefill eager
    prefill_cuda_graph_tokens: Optional[List[int]] = None
    attention_backend: Optional[str] = None
    flashinfer_allreduce_fusion_backend: Optional[str] = None
    kda_prefill_impl: str = "auto"
    moe_runner_backend: str = "auto"
    linear_attn_decode_backend: str = "auto"
    enable_deterministic_inference: bool = False
    watchdog_timeout: float = DEFAULT_WATCHDOG_TIMEOUT
    cpu_num_threads: Optional[int] = None  # None: see resolved_cpu_num_threads
    # Speculative decoding
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_draft_model_quantization: Optional[str] = None  # None: same as --quantization
    # (each algorithm's own fields come from its rounds/<name>/args.py, through the registry)
    # Logging and metrics
    log_level: str = "info"
    stream_interval: int = 1
    decode_log_interval: int = 40
    enable_metrics: bool = False
    log_requests: bool = False
    log_requests_level: int = DEFAULT_LOG_REQUESTS_LEVEL

    def __post_init__(self) -> None:
        self._resolve()
        self.check()
        warn_compat_flags(self)

    # ------------------------------------------------------------------ resolution
    def resolved_device(self) -> str:
        """``cuda`` or ``cpu``: ``--device auto`` picks CUDA when a GPU is visible."""
        if self.device == "auto":
            return "cuda" if _cuda_available() else "cpu"
        return self.device

    def resolved_dtype(self):
        """The torch dtype of weights/activations: ``auto`` is bf16 on CUDA and fp32 on CPU."""
        if self.dtype == "auto":
            return torch_dtype("bfloat16" if self.resolved_device() == "cuda" else "float32")
        return torch_dtype(self.dtype)

    def resolved_model_path(self) -> str:
        """The checkpoint folder or preset name; ``None`` becomes the bundled model's folder."""
        return resolve_model_path(self.model_path)

    def resolved_tokenizer_path(self) -> str:
        """Where the tokenizer lives (defaults to the model folder)."""
        return self.tokenizer_path or self.resolved_model_path()

    def resolved_cpu_num_threads(self) -> Optional[int]:
        """Torch intra-op threads for each scheduler process, or ``None`` to leave torch's own
        choice: ``--cpu-num-threads`` when given (any device); on CPU otherwise
        ``OMP_NUM_THREADS`` when set (the caller's choice, torch already follows it), else
        ``engine_defaults.default_cpu_num_threads`` (a few threads per TP rank: see there)."""
        if self.cpu_num_threads is not None:
            return self.cpu_num_threads
        if self.resolved_device() != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return None
        return default_cpu_num_threads(self.tp_size, available_cpu_cores())

    def is_speculative(self) -> bool:
        """True when a speculative algorithm is enabled."""
        return self.speculative_algorithm is not None

    def cuda_graph_batch_sizes(self) -> List[int]:
        """Batch sizes to capture CUDA graphs for, sorted: ``--cuda-graph-bs`` when given, else
        upstream's buckets; either way ending with ``--cuda-graph-max-bs`` (the largest captured).
        The list does not say whether graphs are used: that is ``--disable-cuda-graph``."""
        max_bs = self.cuda_graph_max_bs
        if self.cuda_graph_bs is None:
            return default_cuda_graph_batch_sizes(max_bs, speculative=self.is_speculative())
        return sorted(set(self.cuda_graph_bs) | {max_bs})

    def url(self) -> str:
        """Base URL of the HTTP server."""
        return f"http://{self.host}:{self.port}"

    def _resolve(self) -> None:
        """Fill defaults that depend on other fields or on the machine. Never raises on bad
        values: those are left for ``check`` so that its messages name the flag."""
        if isinstance(self.speculative_algorithm, str):
            self.speculative_algorithm = canonical_name(self.speculative_algorithm)
        if isinstance(self.attention_backend, str):
            self.attention_backend = self.attention_backend.strip().lower()
        if self.device not in DEVICE_CHOICES:
            return  # check() reports it; everything below depends on the device
        on_cuda = self.resolved_device() == "cuda"
        default_backend = "triton" if on_cuda else "torch_native"
        if self.attention_backend in SUBSTITUTED_ATTENTION_BACKENDS:
            logger.warning("--attention-backend %s is served by this engine's %s backend",
                           self.attention_backend, default_backend)
            self.attention_backend = default_backend
        if self.attention_backend is None:
            self.attention_backend = default_backend
        if not on_cuda:
            self.disable_cuda_graph = True  # graphs are a CUDA feature
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = DEFAULT_CHUNKED_PREFILL_SIZE
        if self.mem_fraction_static is None:
            self.mem_fraction_static = DEFAULT_MEM_FRACTION_STATIC
        if self.random_seed is None:
            self.random_seed = random.randint(0, (1 << 30) - 1)
        if self.served_model_name is None:
            self.served_model_name = self.model_path or BUNDLED_MODEL_DIR.name
        resolve_algorithm_args(self)
        # max_running_requests stays None unless given, with speculation too: the target's
        # runner then sizes the request slots from memory on CUDA, counting what the algorithm
        # adds per slot, up to SPECULATIVE_MAX_RUNNING_REQUESTS (upstream's fixed speculative
        # default, 48 slots, left no KV cache for Ling-3.0-flash fp8 on one H200).
        if self.cuda_graph_max_bs is None:
            self.cuda_graph_max_bs = self._default_cuda_graph_max_bs()
        pgt = self.prefill_cuda_graph_tokens
        words = [pgt] if isinstance(pgt, str) else pgt
        if isinstance(words, (list, tuple)) and len(words) == 1 and isinstance(words[0], str) \
                and words[0].strip().lower() == "none":
            self.prefill_cuda_graph_tokens = []  # "none" (the CLI's word): every prefill eager

    def _default_cuda_graph_max_bs(self) -> int:
        """As upstream, the largest of ``--cuda-graph-bs`` when given; otherwise a small cap
        (batch 1 first), never above ``--max-running-requests``."""
        bs = self.cuda_graph_bs
        if isinstance(bs, (list, tuple)) and bs and all(is_int(b) for b in bs):
            return max(bs)
        cap = SPECULATIVE_CUDA_GRAPH_MAX_BS if self.is_speculative() else DEFAULT_CUDA_GRAPH_MAX_BS
        if is_int(self.max_running_requests) and self.max_running_requests > 0:
            cap = min(cap, self.max_running_requests)
        return cap

    # ------------------------------------------------------------------ validation
    def check(self) -> None:
        """Raise ``ValueError`` (message starts with the offending flag) on any bad value."""
        one_of("--dtype", self.dtype, DTYPE_CHOICES)
        one_of("--device", self.device, DEVICE_CHOICES)
        one_of("--load-format", self.load_format, LOAD_FORMAT_CHOICES)
        for flag, value in (("--quantization", self.quantization),
                            ("--speculative-draft-model-quantization",
                             self.speculative_draft_model_quantization)):
            if value is not None:
                one_of(flag, value, QUANTIZATION_CHOICES)
        one_of("--log-level", self.log_level, LOG_LEVEL_CHOICES)
        one_of("--kda-prefill-impl", self.kda_prefill_impl, KDA_PREFILL_IMPL_CHOICES)
        self._check_allreduce_fusion()
        if self.log_requests_level not in LOG_REQUESTS_LEVEL_CHOICES or \
                isinstance(self.log_requests_level, bool):
            raise ValueError(f"--log-requests-level must be one of "
                             f"{', '.join(map(str, LOG_REQUESTS_LEVEL_CHOICES))}; "
                             f"got {self.log_requests_level!r}")
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        if self.enable_metrics and importlib.util.find_spec("prometheus_client") is None:
            raise ValueError("--enable-metrics needs the prometheus_client package "
                             "(pip install prometheus_client)")
        if self.device == "cuda" and not _cuda_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        int_at_least("--tp-size", self.tp_size, 1)
        if self.resolved_device() == "cuda":
            import torch

            if self.tp_size > torch.cuda.device_count():
                raise ValueError(f"--tp-size {self.tp_size} exceeds the "
                                 f"{torch.cuda.device_count()} visible GPUs")
        # Before the integer checks below: cuda_graph_max_bs defaults to the largest size, so a
        # bad --cuda-graph-bs would otherwise be reported as a bad --cuda-graph-max-bs.
        self._check_cuda_graph_bs()
        pgt = self.prefill_cuda_graph_tokens
        if pgt is not None and (not isinstance(pgt, (list, tuple))
                                or not all(is_int(t) and t >= 1 for t in pgt)):
            raise ValueError(f"--prefill-cuda-graph-tokens must be a list of integers >= 1 or "
                             f"the word 'none' alone, got {pgt!r}")
        int_at_least("--port", self.port, 1)
        if self.port > 65535:
            raise ValueError(f"--port must be <= 65535, got {self.port}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("--host must be a non-empty host name or address")
        for flag, value in (
            ("--context-length", self.context_length),
            ("--max-running-requests", self.max_running_requests),
            ("--max-total-tokens", self.max_total_tokens),
            ("--cuda-graph-max-bs", self.cuda_graph_max_bs),
        ):
            if value is not None:
                int_at_least(flag, value, 1)
        if self.cpu_num_threads is not None:
            int_at_least("--cpu-num-threads", self.cpu_num_threads, 1)
        int_at_least("--stream-interval", self.stream_interval, 1)
        int_at_least("--decode-log-interval", self.decode_log_interval, 1)
        cps = self.chunked_prefill_size
        if cps is not None and (not is_int(cps) or (cps != -1 and cps <= 0)):
            raise ValueError(f"--chunked-prefill-size must be -1 or > 0, got {cps!r}")
        int_at_least("--max-prefill-tokens", self.max_prefill_tokens, 1)
        mfs = self.mem_fraction_static
        if mfs is not None and (not is_number(mfs) or not 0.0 < mfs < 1.0):
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {mfs!r}")
        if not is_number(self.watchdog_timeout) or self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout!r}")
        if self.random_seed is not None and not is_int(self.random_seed):
            raise ValueError(f"--random-seed must be an integer, got {self.random_seed!r}")
        parse_override_args(self.json_model_override_args)  # names the flag on bad JSON
        self._check_attention_backend()
        self._check_kda_prefill_impl()
        for flag, value in (("--moe-runner-backend", self.moe_runner_backend),
                            ("--linear-attn-decode-backend", self.linear_attn_decode_backend)):
            one_of(flag, value, KERNEL_BACKEND_CHOICES)
            if value == "triton":
                require_triton_runtime(f"{flag} triton", self.resolved_device())
        self._check_speculative()

    def _check_allreduce_fusion(self) -> None:
        value = self.flashinfer_allreduce_fusion_backend
        if value is None:
            return
        one_of("--flashinfer-allreduce-fusion-backend", value,
                FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES)
        if value != "auto":
            raise ValueError(
                f"--flashinfer-allreduce-fusion-backend {value}: this engine has no FlashInfer "
                "fused all-reduce + RMSNorm; only 'auto' is accepted (the all-reduce then runs "
                "unfused)")

    def _check_cuda_graph_bs(self) -> None:
        bs = self.cuda_graph_bs
        if bs is None:
            return
        if not isinstance(bs, (list, tuple)) or not bs or not all(is_int(b) and b >= 1 for b in bs):
            raise ValueError(f"--cuda-graph-bs must be a non-empty list of integers >= 1, got {bs!r}")
        if not is_int(self.cuda_graph_max_bs) or self.cuda_graph_max_bs < 1:
            return  # check() reports --cuda-graph-max-bs itself
        too_big = [b for b in bs if b > self.cuda_graph_max_bs]
        if too_big:
            raise ValueError(f"--cuda-graph-bs {', '.join(map(str, too_big))} exceeds "
                             f"--cuda-graph-max-bs {self.cuda_graph_max_bs}")

    def _check_attention_backend(self) -> None:
        name = self.attention_backend
        if name == "triton":  # the MLA decode / verify kernel must be able to run
            require_triton_runtime("--attention-backend triton", self.resolved_device())
        if name is None or name in SUPPORTED_ATTENTION_BACKENDS:
            return
        supported = ", ".join(SUPPORTED_ATTENTION_BACKENDS + SUBSTITUTED_ATTENTION_BACKENDS)
        if name in KNOWN_UPSTREAM_ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend {name} is an upstream SGLang backend that this engine does "
                f"not implement; supported: {supported}"
            )
        raise ValueError(f"--attention-backend {name!r} is unknown; supported: {supported}")

    def _check_kda_prefill_impl(self) -> None:
        if self.kda_prefill_impl != "fla":
            return
        if self.resolved_device() != "cuda":
            raise ValueError("--kda-prefill-impl fla needs CUDA (fla-core's chunk_kda is GPU-only)")
        if importlib.util.find_spec("fla") is None:
            raise ValueError("--kda-prefill-impl fla needs the fla-core package (pip install fla-core)")

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None:
            for flag, value in (
                ("--speculative-draft-model-path", self.speculative_draft_model_path),
                ("--speculative-draft-model-quantization",
                 self.speculative_draft_model_quantization),
            ):
                if value is not None:
                    raise ValueError(f"{flag} needs --speculative-algorithm")
        check_algorithm_args(self)  # the algorithm's name and its own flags

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Register every flag (SGLang's names) on ``parser``; defaults come from the fields."""
        register_server_flags(parser, {f.name: f.default for f in dataclasses.fields(ServerArgs)})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """Build (resolve + validate) from a namespace produced by ``add_cli_args``."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


add_cli_args = ServerArgs.add_cli_args


def warn_compat_flags(server_args: ServerArgs) -> List[str]:
    """Warn once per process, for each flag of ``NO_OP_FLAGS`` that is set, what it does here,
    about compatibility-only ``SGLANG_*`` variables that are set (``environ.warn_compat_envs``)
    and about ``SGLANG_*`` names no variable declares (``environ.
    warn_unknown_sglang_env_vars``: a misspelling is named with the closest variable). Returns
    the no-op flags and compatibility variables. A warning, not an
    info line: the CLI parses its flags before logging is configured, when only warnings show."""
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    flags = []
    for flag, what in NO_OP_FLAGS.items():
        field = flag[2:].replace("-", "_")
        if getattr(server_args, field) == defaults[field]:
            continue
        flags.append(flag)
        if flag not in _NO_OP_LOGGED:
            _NO_OP_LOGGED.add(flag)
            logger.warning("%s: %s.", flag, what)
    warn_unknown_sglang_env_vars()
    return flags + warn_compat_envs()


def prepare_server_args(argv: Sequence[str]) -> ServerArgs:
    """Parse ``argv`` (without the program name); bad values exit with code 2 naming the flag,
    an unknown flag with one line naming it (``ServerArgumentParser``).

    ``--config FILE.yaml`` supplies flag values from a YAML mapping; flags on the command line
    override them (``server_args_config_parser.ConfigArgumentMerger``).
    """
    parser = ServerArgumentParser(prog="python -m sglang.launch_server",
                                  description="Serve a model over SGLang's HTTP API.")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--config", type=str, default=None, metavar="FILE.yaml",
                        help="YAML mapping of flag names (with or without '--', dashes or "
                             "underscores) to values; command-line flags override them.")
    argv = list(argv)
    try:
        ConfigArgumentMerger(parser).apply(argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))  # exits with status 2
        raise  # unreachable; keeps type checkers happy

