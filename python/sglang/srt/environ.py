"""Typed registry of the ``SGLANG_*`` environment flags this engine reads.

Every flag is declared once, here, with its type, default and meaning, and read through
``envs.SGLANG_X.get()``. Reading goes through one parser per type so that a typo such as
``SGLANG_OPT_FUSED_KDA_VERIFY=ture`` fails loudly (``ValueError`` naming the variable) instead of
silently meaning "off". Flags are read at call time, not import time, so tests and launchers can
set them late (``with envs.SGLANG_X.override(True): ...``).

A few variables are declared only so that upstream launch commands run unchanged; their field
carries ``compat`` (why the variable has no effect here). When one is set to anything but its
default, the process logs one warning naming it: on its first read, or from
:func:`warn_compat_envs`, which ``ServerArgs.__post_init__`` calls (through
``warn_compat_flags``) whenever server arguments are built.

Variables that were retired (:data:`RETIRED_ENV_VARS`) are no longer declared; setting one logs
one warning saying what replaced it, from the same check that names a misspelt variable.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Set, Type

from sglang.srt.configs.engine_defaults import parse_switch

logger = logging.getLogger(__name__)


def parse_bool(name: str, raw: str) -> bool:
    """Parse a boolean variable's value (``engine_defaults.parse_switch``: 1/true/yes/on,
    0/false/no/off, case-insensitive); ``ValueError`` names the variable."""
    return parse_switch(f"environment variable {name}", raw)


@dataclass(frozen=True)
class EnvField:
    """One environment flag: its variable name, value type, default and documentation.

    ``compat`` is set for variables accepted only for compatibility with upstream SGLang: it says
    why the variable has no effect in this engine (``None``: the variable has a meaning here).
    """

    name: str
    type: Type
    default: Any
    doc: str
    compat: Optional[str] = None

    def __post_init__(self) -> None:
        if self.type not in (bool, int, float, str):
            raise TypeError(f"{self.name}: unsupported flag type {self.type!r}")

    def is_set(self) -> bool:
        """True when the variable is present and non-empty in the environment."""
        return bool(os.environ.get(self.name, "").strip())

    def get(self) -> Any:
        """Current value: the parsed variable, or the default when unset or empty."""
        raw = os.environ.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        value = self.parse(raw)
        if self.compat is not None and value != self.default:
            _warn_compat_once(self)
        return value

    def parse(self, raw: str) -> Any:
        """Convert a raw string to this flag's type; ``ValueError`` names the variable."""
        if self.type is bool:
            return parse_bool(self.name, raw)
        if self.type is str:
            return raw
        try:
            return self.type(raw.strip())
        except ValueError:
            raise ValueError(
                f"environment variable {self.name}={raw!r} is not a valid {self.type.__name__}"
            ) from None

    def set(self, value: Any) -> None:
        """Set the variable in this process's environment (validated by round-tripping)."""
        raw = _format(value)
        self.parse(raw)
        os.environ[self.name] = raw

    def clear(self) -> None:
        """Remove the variable, so ``get()`` returns the default."""
        os.environ.pop(self.name, None)

    @contextlib.contextmanager
    def override(self, value: Any) -> Iterator[None]:
        """Temporarily set the flag (restores the previous raw value, or its absence)."""
        previous = os.environ.get(self.name)
        self.set(value)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = previous


def _format(value: Any) -> str:
    # bools go out as 1/0 so that any reader (including child processes) parses them.
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


class Envs:
    """The registry: each class attribute is an :class:`EnvField` named after its variable."""

    SGLANG_ENABLE_METADATA_GLUE_GRAPH = EnvField(
        "SGLANG_ENABLE_METADATA_GLUE_GRAPH",
        bool,
        False,
        "Opt-in: capture the attention-metadata preparation that precedes each decode / verify "
        "CUDA-graph replay in a small graph of its own (upstream's meaning of the variable); "
        "see docs/performance.md.",
    )
    SGLANG_OPT_FUSED_KDA_VERIFY = EnvField(
        "SGLANG_OPT_FUSED_KDA_VERIFY",
        bool,
        False,
        "Upstream: run the KDA chain of a speculative verify (conv update -> gated delta rule "
        "-> gated RMSNorm) as one fused kernel chain.",
        compat="the Triton verify recurrence is chosen with --linear-attn-decode-backend triton",
    )
    SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH = EnvField(
        "SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH",
        bool,
        False,
        "Upstream (NEXTN): capture the target verify and the following draft extend in one CUDA "
        "graph.",
        compat="with CUDA graphs on, the whole NEXTN round (draft, verify, draft extend) is "
               "already one graph here",
    )
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvField(
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
        bool,
        True,
        "/health runs a one-token generation through the scheduler; off: it only checks that "
        "the processes are alive.",
    )
    SGLANG_HEALTH_CHECK_TIMEOUT = EnvField(
        "SGLANG_HEALTH_CHECK_TIMEOUT",
        float,
        20.0,
        "Seconds /health waits for its generation before reporting the server unhealthy.",
    )
    SGLANG_RETURN_ORIGINAL_LOGPROB = EnvField(
        "SGLANG_RETURN_ORIGINAL_LOGPROB",
        bool,
        False,
        "Return log-probabilities of the raw logits; default (as upstream): of the distribution "
        "the token was sampled from (after penalties, logit bias and temperature).",
    )
    SGLANG_INPUT_LOGPROB_LOGITS_BYTES = EnvField(
        "SGLANG_INPUT_LOGPROB_LOGITS_BYTES",
        int,
        1 << 30,
        "A prefill batch that returns prompt-token logprobs keeps fp32 logits for every token "
        "([tokens, vocab]); its tokens are capped so these logits stay under this many bytes "
        "(a long prompt is then prefilled in more chunks instead of exhausting memory).",
    )
    SGLANG_ENABLE_PDL = EnvField(
        "SGLANG_ENABLE_PDL",
        str,
        "0",
        "Launch the Triton decode kernels with programmatic dependent launch (sgl_kernel.pdl), "
        "so that inside a CUDA graph each kernel's launch overlaps its predecessor's tail. "
        "With it the small-M GEMM also asks for its first weight tiles in L2 before its "
        "dependency wait. Opt-in: on the GPU host it barely shortened a decode step and "
        "lengthened a NEXTN round (docs/performance.md). 1 needs a CUDA device of compute "
        "capability 9.0 or newer; auto turns it on where one is present.",
    )
    SGLANG_TORCH_PROFILER_DIR = EnvField(
        "SGLANG_TORCH_PROFILER_DIR",
        str,
        "/tmp",
        "Where /start_profile writes its traces unless the request names an output_dir "
        "(bench_serving --profile prints it too).",
    )
    SGLANG_MAX_REQUEST_BODY_BYTES = EnvField(
        "SGLANG_MAX_REQUEST_BODY_BYTES",
        int,
        32 * 1024 * 1024,
        "Largest HTTP request body the server reads, in bytes; a larger one is answered 413 "
        "before it is parsed, so one request cannot bloat the server's memory.",
    )
    SGLANG_MAX_PROMPT_CHARS = EnvField(
        "SGLANG_MAX_PROMPT_CHARS",
        int,
        0,
        "Longest text prompt, in characters, that the server tokenizes (after the chat "
        "template; a chat's messages are also checked before the template runs); a longer one "
        "is answered 400 before the tokenizer sees it. 0 means 64 x the context length, far "
        "more than any prompt that fits the context can need in practice.",
    )
    SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT = EnvField(
        "SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT",
        float,
        20.0,
        "Seconds the HTTP server lets in-flight requests finish after SIGTERM / SIGINT (new "
        "ones get 503 meanwhile) before it aborts the rest and exits; 0 aborts at once. The "
        "default leaves a 30 s orchestrator kill deadline room for the abort and the exit.",
    )
    SGLANG_IS_IN_CI = EnvField(
        "SGLANG_IS_IN_CI",
        bool,
        False,
        "Set by upstream CI runners.",
        compat="this engine behaves the same inside and outside CI",
    )


envs = Envs()

# Variables this engine read once and no longer does -> what replaced each. A kernel switch that
# measured faster became the CUDA default; one measured slower or used only for an A/B became a
# field of sglang.srt.layers.kernel_choices.KernelChoices, which tests and benchmarks set
# (benchmark command lines: --kernel-choices). A retired variable is undeclared like any
# unknown SGLANG_* name, and its warning (warn_unknown_sglang_env_vars) says what replaced it
# instead of naming the closest declared variable.
RETIRED_ENV_VARS: Dict[str, str] = {
    "SGLANG_TRITON_RMSNORM": "the Triton norms are the CUDA default; tests and benchmarks "
                             "choose them with KernelChoices(rmsnorm=...)",
    "SGLANG_TRITON_MLA_ROPE": "the MLA RoPE kernel is the CUDA default; tests and benchmarks "
                              "choose it with KernelChoices(mla_rope=...)",
    "SGLANG_TRITON_ROUTER": "the router kernel follows --moe-runner-backend (on with triton, "
                            "the CUDA default); tests and benchmarks: KernelChoices(router=...)",
    "SGLANG_TRITON_MOE_COMBINE": "the one-kernel MoE combine follows --moe-runner-backend (on "
                                 "with triton, the CUDA default); tests and benchmarks: "
                                 "KernelChoices(moe_combine=...)",
    "SGLANG_TRITON_SMALL_M_GEMM": "the small-M GEMM is on for CUDA with fp8 weights, and with "
                                  "16-bit weights under --enable-deterministic-inference; tests "
                                  "and benchmarks: KernelChoices(small_m_gemm=...)",
    "SGLANG_KDA_NORM_IN_O_PROJ": "KDA's output norm inside o_proj measured slower and is off; "
                                 "tests and benchmarks: KernelChoices(kda_norm_in_o_proj=...)",
    "SGLANG_PDL_WEIGHT_PREFETCH": "the weight prefetch is on whenever SGLANG_ENABLE_PDL is; "
                                  "A/Bs: KernelChoices(pdl_weight_prefetch=...)",
    "SGLANG_MOE_GROUPED_MM": "torch's grouped GEMM for the torch-native MoE is a test and "
                             "benchmark choice: KernelChoices(moe_grouped_mm=...)",
    "SGLANG_RAGGED_VERIFY_MODE": "DSPARK's verify mode is the flag "
                                 "--speculative-dspark-verify-mode",
    "SGLANG_FUSED_ROUND_PREP": "the one-launch round start is the CUDA default; tests and "
                               "benchmarks: FutureMap(fused_prep=...)",
    "SGLANG_GRAPH_FULL_REFILL": "the reference refill is a test and benchmark parameter: "
                                "init_cuda_graphs(refill_mode='full')",
    "SGLANG_ROUND_GRAPH_PER_PHASE": "one graph per round phase is an A/B of "
                                    "benchmark/batch1/graph_ab.py: init_cuda_graphs(per_phase=True)",
}


def list_env_fields() -> List[EnvField]:
    """All registered flags, sorted by name."""
    fields = [v for v in vars(Envs).values() if isinstance(v, EnvField)]
    return sorted(fields, key=lambda f: f.name)


def get_env_field(name: str) -> EnvField:
    """Look a flag up by variable name; ``KeyError`` lists the known ones."""
    for f in list_env_fields():
        if f.name == name:
            return f
    known = ", ".join(f.name for f in list_env_fields())
    raise KeyError(f"unknown environment flag {name!r}; known flags: {known}")


_COMPAT_WARNED: Set[str] = set()


def _warn_compat_once(f: EnvField) -> None:
    if f.name in _COMPAT_WARNED:
        return
    _COMPAT_WARNED.add(f.name)
    logger.warning("environment variable %s is accepted for compatibility with upstream SGLang "
                   "and has no effect here: %s", f.name, f.compat)


def compat_env_fields() -> List[EnvField]:
    """The flags declared only for compatibility (``compat`` set), sorted by name."""
    return [f for f in list_env_fields() if f.compat is not None]


def warn_compat_envs() -> List[str]:
    """Log one warning per process for each compatibility-only variable set to a value other
    than its default; return their names (warned now or earlier). A malformed value raises
    ``ValueError`` naming the variable, as any read does."""
    return [f.name for f in compat_env_fields() if f.is_set() and f.get() != f.default]


def require_triton_runtime(what: str, device_type: str) -> None:
    """Raise ``ValueError`` naming ``what`` (a flag or kernel choice asking for Triton kernels)
    unless they can run: on CUDA, or in Triton's CPU interpreter (``TRITON_INTERPRET=1``, as the
    tests set it before triton is first imported)."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what} needs CUDA (or TRITON_INTERPRET=1 to run the kernels in "
                         "Triton's CPU interpreter)")


def env_snapshot() -> Dict[str, Any]:
    """Current parsed value of every flag (for logs and /server_info)."""
    return {f.name: f.get() for f in list_env_fields()}


def unknown_sglang_env_vars(environ: Optional[Dict[str, str]] = None) -> List[str]:
    """``SGLANG_*`` variables present in the environment that no flag declares (likely typos)."""
    environ = os.environ if environ is None else environ
    known = {f.name for f in list_env_fields()}
    return sorted(k for k in environ if k.startswith("SGLANG_") and k not in known)


_UNKNOWN_WARNED: Set[str] = set()


def warn_unknown_sglang_env_vars(environ: Optional[Dict[str, str]] = None) -> List[str]:
    """Warn once per process about each ``SGLANG_*`` variable no flag declares (a misspelt one
    would otherwise be ignored in silence): a retired one (:data:`RETIRED_ENV_VARS`) with what
    replaced it, any other with the closest declared variable; return the unknown names."""
    unknown = unknown_sglang_env_vars(environ)
    known = [f.name for f in list_env_fields()]
    for name in unknown:
        if name in _UNKNOWN_WARNED:
            continue
        _UNKNOWN_WARNED.add(name)
        if name in RETIRED_ENV_VARS:
            logger.warning("environment variable %s was retired and is ignored: %s", name,
                           RETIRED_ENV_VARS[name])
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        logger.warning("environment variable %s is not a variable of this engine and is "
                       "ignored%s", name, hint)
    return unknown


def set_env_values() -> Dict[str, Any]:
    """The declared ``SGLANG_*`` variables set in this process's environment, with their
    resolved values (for the start-up log)."""
    return {f.name: f.get() for f in list_env_fields() if f.is_set()}


def describe_envs() -> str:
    """A human-readable table of the flags: name, type, default, current value and doc."""
    lines = []
    for f in list_env_fields():
        try:
            current = repr(f.get())
        except ValueError as e:
            current = f"<invalid: {e}>"
        lines.append(f"{f.name} ({f.type.__name__}, default {f.default!r}, now {current})")
        lines.append(f"    {f.doc}")
        if f.compat is not None:
            lines.append(f"    Accepted for compatibility; no effect here: {f.compat}.")
    return "\n".join(lines)
