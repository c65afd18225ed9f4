"""The command-line flags of :class:`~sglang.srt.server_args.ServerArgs` (SGLang's names).

``register_server_flags`` adds one argparse option per ``ServerArgs`` field (the field name with
``_`` -> ``-``), in argument groups as upstream groups them (:data:`FLAG_GROUPS`);
``ServerArgs.add_cli_args`` calls it with the dataclass defaults. Every flag acts as upstream
SGLang's does or is refused (by argparse choices, or by ``ServerArgs.check`` with a message naming
it), except the few in :data:`NO_OP_FLAGS`, whose help says what they do here.

:class:`ServerArgumentParser` is the parser of the commands that take server flags: it refuses
abbreviations (``--max-running-request`` is not ``--max-running-requests``), has ``--version``,
ends each flag's help with its default (:class:`ServerHelpFormatter`) and reports an unknown flag
(most often an upstream one this engine lacks) in one line with exit code 2.
"""
from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, Dict, List, Optional, Sequence

from sglang.srt.configs.engine_defaults import (
    ATTENTION_BACKEND_CHOICES,
    AUTO_MAX_RUNNING_REQUESTS,
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    CPU_MAX_DEFAULT_THREADS,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_MEM_FRACTION_STATIC,
    DEFAULT_PREFILL_CUDA_GRAPH_TOKENS,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES,
    KDA_PREFILL_IMPL_CHOICES,
    KERNEL_BACKEND_CHOICES,
    LOAD_FORMAT_CHOICES,
    LOG_LEVEL_CHOICES,
    LOG_REQUESTS_LEVEL_CHOICES,
    QUANTIZATION_CHOICES,
    SPECULATIVE_CUDA_GRAPH_MAX_BS,
    SPECULATIVE_MAX_RUNNING_REQUESTS,
    UPSTREAM_ONLY_FLAGS,
)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.managers.template_manager import BUILTIN_CHAT_TEMPLATES
from sglang.srt.rounds.registry import add_algorithm_flags, describe_algorithms

__all__ = [
    "NO_OP_FLAGS",
    "FLAG_GROUPS",
    "ServerArgumentParser",
    "ServerHelpFormatter",
    "package_version",
    "register_server_flags",
    "shown_default",
    "unknown_arguments_message",
]

# Upstream flags that change nothing here because this engine already behaves the way they ask
# for, with what each does here (its --help text). Setting one logs that text once per process.
NO_OP_FLAGS: Dict[str, str] = {
    "--trust-remote-code": "Accepted so that upstream launch commands run unchanged; nothing "
                           "from a checkpoint is ever executed here (the model code is part of "
                           "this engine, tokenizers load without remote code), so there is "
                           "nothing to trust",
    "--disable-radix-cache": "This engine has no prefix (radix) cache yet: every prompt is "
                             "prefilled in full whether or not the flag is given",
    "--enable-mixed-chunk": "Running requests always take a decode step between the chunks of "
                            "a long prompt here (the chunk and the decode step run as two "
                            "forwards, not one mixed batch), with or without the flag",
    "--flashinfer-allreduce-fusion-backend": "Only 'auto' is accepted: this engine has no fused "
                                             "all-reduce + RMSNorm, so the tensor-parallel "
                                             "all-reduce runs unfused (same results); trtllm "
                                             "and mnnvl are refused",
}

# The argument groups of --help, in order: (title, description). Upstream groups its flags the
# same way (model, HTTP, runtime / memory / scheduling, speculative, kernels, logging).
FLAG_GROUPS: Dict[str, str] = {
    "model and tokenizer": "Which checkpoint to serve and how to load and tokenize it.",
    "HTTP server": "Where the OpenAI-compatible and native HTTP API listens.",
    "runtime, memory and scheduling": "Device, parallelism, memory plan and batching.",
    "speculative decoding": "Draft-and-verify decoding: each algorithm's flags are named "
                            "after it.",
    "kernels and CUDA graphs": "Which kernels run each part of the model, and CUDA graph "
                               "capture.",
    "logging and metrics": "Log lines, request logs and Prometheus metrics.",
    "compatibility-only flags": "Upstream flags taken so that upstream launch commands run "
                                "unchanged; this engine already behaves as they ask, and "
                                "setting one logs what it does here.",
}

# Attributes _flag sets on an argparse Action: the words --help shows for its default, and the
# default they describe (a --config file may change the default; then the value is shown).
_WORDS_ATTR = "sglang_default_words"
_REGISTERED_ATTR = "sglang_registered_default"

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
# A help text that already states its default ("%(default)s", "default: ...", "(default ...").
_SAYS_DEFAULT = re.compile(r"%\(default\)|\bdefault:|\(default\b", re.IGNORECASE)


def _token_count_or_none(text: str) -> Any:
    """One value of ``--prefill-cuda-graph-tokens``: an integer, or the word ``none``
    (``ServerArgs`` turns ``["none"]`` into no sizes and rejects it beside numbers)."""
    if text.strip().lower() == "none":
        return "none"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts or 'none', got {text!r}")


def _flag(group: Any, *names: str, words: Optional[str] = None, **kwargs: Any) -> argparse.Action:
    """``group.add_argument(*names, **kwargs)``; ``words`` say what a default that is no plain
    value (``None``, ``auto``) resolves to, for ``--help``."""
    action = group.add_argument(*names, **kwargs)
    if words is not None:
        setattr(action, _WORDS_ATTR, words)
        setattr(action, _REGISTERED_ATTR, action.default)
    return action


def register_server_flags(parser: argparse.ArgumentParser, d: Dict[str, Any]) -> None:
    """Add every server flag to ``parser`` in :data:`FLAG_GROUPS`; ``d`` maps field names to
    their defaults.

    Also switches off argparse's prefix matching on ``parser`` (a parser that takes server flags
    must not read ``--max-running-request`` as ``--max-running-requests``) and, when it has
    argparse's plain formatter, gives it :class:`ServerHelpFormatter` so that ``--help`` shows
    every default; the benchmark scripts that build their own parser get both this way.
    """
    parser.allow_abbrev = False
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = ServerHelpFormatter
    g = {title: parser.add_argument_group(title, text) for title, text in FLAG_GROUPS.items()}
    _model_flags(g["model and tokenizer"], d)
    _http_flags(g["HTTP server"], d)
    _runtime_flags(g["runtime, memory and scheduling"], d)
    _speculative_flags(g["speculative decoding"], d)
    _kernel_flags(g["kernels and CUDA graphs"], d)
    _logging_flags(g["logging and metrics"], d)
    _compat_flags(g["compatibility-only flags"], d)


def _model_flags(g: Any, d: Dict[str, Any]) -> None:
    _flag(g, "--model-path", "--model", type=str, default=d["model_path"],
          words=f"the bundled tiny model, {BUNDLED_MODEL_DIR.name}",
          help="Checkpoint folder or preset name (e.g. ling-3.0-flash).")
    _flag(g, "--tokenizer-path", type=str, default=d["tokenizer_path"], words="the model path",
          help="Tokenizer folder, when it is not the checkpoint's.")
    _flag(g, "--load-format", choices=LOAD_FORMAT_CHOICES, default=d["load_format"],
          help="auto / safetensors: the checkpoint's weights; dummy: random weights from the "
               "config (performance work).")
    _flag(g, "--quantization", choices=QUANTIZATION_CHOICES, default=d["quantization"],
          words="as the checkpoint is: fp8 when its config says so",
          help="fp8: block-fp8 weights (an fp8 checkpoint as is, a bf16 one or dummy weights "
               "quantised at load); unquant: the model dtype.")
    _flag(g, "--json-model-override-args", type=str, default=d["json_model_override_args"],
          help="JSON object overriding config.json fields, e.g. '{\"num_hidden_layers\": 2}'.")
    _flag(g, "--context-length", type=int, default=d["context_length"],
          words="the model config's max_position_embeddings",
          help="Longest prompt + output a request may have, in tokens.")
    _flag(g, "--served-model-name", type=str, default=d["served_model_name"],
          words=f"the --model-path value, or {BUNDLED_MODEL_DIR.name} for the bundled model",
          help="Model name reported by /v1/models and /model_info.")
    _flag(g, "--chat-template", type=str, default=d["chat_template"],
          words="the tokenizer's own template",
          help="Jinja chat template for /v1/chat/completions instead of the tokenizer's: a "
               f"template file, or a built-in name ({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))}).")


def _http_flags(g: Any, d: Dict[str, Any]) -> None:
    _flag(g, "--host", type=str, default=d["host"], help="Address the HTTP server binds to.")
    _flag(g, "--port", type=int, default=d["port"], help="Port the HTTP server listens on.")
    _flag(g, "--api-key", type=str, default=d["api_key"], words="none: no authentication",
          help="Require this bearer token on every request.")
    _flag(g, "--skip-server-warmup", action="store_true",
          help="Report ready without the warm-ups: one short generate request and, on "
               "CUDA, the start-up prefills that compile the prefill kernels.")


def _runtime_flags(g: Any, d: Dict[str, Any]) -> None:
    _flag(g, "--dtype", choices=DTYPE_CHOICES, default=d["dtype"],
          words="auto: bfloat16 on CUDA, float32 on CPU",
          help="Dtype of weights and activations (half = float16, float = float32).")
    _flag(g, "--device", choices=DEVICE_CHOICES, default=d["device"],
          words="auto: cuda when a GPU is visible, else cpu", help="Where the model runs.")
    _flag(g, "--tp-size", "--tensor-parallel-size", type=int, default=d["tp_size"],
          help="Tensor-parallel ranks (one process and GPU each).")
    _flag(g, "--random-seed", type=int, default=d["random_seed"],
          words="a new random seed at each launch",
          help="Seed of sampling (and of dummy weights).")
    _flag(g, "--mem-fraction-static", type=float, default=d["mem_fraction_static"],
          words=str(DEFAULT_MEM_FRACTION_STATIC),
          help="Fraction of GPU memory for weights, KV cache and recurrent states.")
    _flag(g, "--max-running-requests", type=int, default=d["max_running_requests"],
          words=f"on CUDA sized from memory (at most {AUTO_MAX_RUNNING_REQUESTS}; at most "
                f"{SPECULATIVE_MAX_RUNNING_REQUESTS} with speculative decoding, whose per-slot "
                f"state is counted), elsewhere {DEFAULT_MAX_RUNNING_REQUESTS} "
                f"({SPECULATIVE_MAX_RUNNING_REQUESTS} with speculative decoding)",
          help="Requests decoded together at most (request slots).")
    _flag(g, "--max-total-tokens", type=int, default=d["max_total_tokens"],
          words="on CUDA what --mem-fraction-static leaves for the KV cache; elsewhere "
                f"context length x request slots, at most {CPU_DEFAULT_MAX_TOTAL_TOKENS}",
          help="KV-cache token slots shared by all running requests.")
    _flag(g, "--chunked-prefill-size", type=int, default=d["chunked_prefill_size"],
          words=str(DEFAULT_CHUNKED_PREFILL_SIZE),
          help="Tokens per prefill chunk of a long prompt; -1 disables chunking.")
    _flag(g, "--max-prefill-tokens", type=int, default=d["max_prefill_tokens"],
          help="Prompt tokens of new requests in one prefill batch; a longer prompt still "
               "starts alone, chunked.")
    _flag(g, "--disable-overlap-schedule", action="store_true",
          help="Consume each step's result before launching the next (no host run-ahead).")
    _flag(g, "--watchdog-timeout", type=float, default=d["watchdog_timeout"],
          help="Seconds a scheduler may go without finishing a forward while it has requests; "
               "past that it dumps its threads' stacks and exits, so the server reports "
               "unhealthy and fails the pending requests instead of hanging.")
    _flag(g, "--cpu-num-threads", type=int, default=d["cpu_num_threads"],
          words=f"on CPU OMP_NUM_THREADS when set, else the usable cores split between the TP "
                f"ranks, at most {CPU_MAX_DEFAULT_THREADS}; on CUDA torch's own choice",
          help="Torch intra-op threads of each scheduler process (not an upstream flag). More "
               "threads than free cores stalls every op on a shared machine.")


def _speculative_flags(g: Any, d: Dict[str, Any]) -> None:
    _flag(g, "--speculative-algorithm", type=str, default=d["speculative_algorithm"],
          words="none: speculative decoding off",
          help=f"One of {describe_algorithms()}.")
    _flag(g, "--speculative-draft-model-path", "--speculative-draft-model", type=str,
          default=d["speculative_draft_model_path"],
          words="the algorithm's draft inside the target checkpoint",
          help="Checkpoint of the draft model.")
    _flag(g, "--speculative-draft-model-quantization", choices=QUANTIZATION_CHOICES,
          default=d["speculative_draft_model_quantization"], words="the same as --quantization",
          help="The draft's weights: unquant keeps them in the model dtype.")
    add_algorithm_flags(g, d, _flag)  # each algorithm's own flags (rounds/<name>/args.py)


def _kernel_flags(g: Any, d: Dict[str, Any]) -> None:
    _flag(g, "--attention-backend", type=str, default=d["attention_backend"],
          words="triton on CUDA, torch_native on CPU",
          help=f"One of {', '.join(ATTENTION_BACKEND_CHOICES)} (trtllm_mla is accepted and "
               "served by the default).")
    _flag(g, "--kda-prefill-impl", choices=KDA_PREFILL_IMPL_CHOICES,
          default=d["kda_prefill_impl"], words="auto: fla on CUDA when fla-core is installed, "
                                               "else torch",
          help="KDA prefill kernel: torch (reference), fla (fla-core chunk_kda).")
    _flag(g, "--moe-runner-backend", choices=KERNEL_BACKEND_CHOICES,
          default=d["moe_runner_backend"], words="auto: triton on CUDA, torch_native elsewhere",
          help="Decode/verify routed experts: triton = grouped mat-vec, experts read in place.")
    _flag(g, "--linear-attn-decode-backend", choices=KERNEL_BACKEND_CHOICES,
          default=d["linear_attn_decode_backend"],
          words="auto: triton on CUDA, torch_native elsewhere",
          help="KDA decode/verify recurrence: triton = one kernel per layer.")
    _flag(g, "--enable-deterministic-inference", action="store_true",
          help="Batch-invariant decode on CUDA, so that a token's logits are the same alone, in "
               "a verify chain or beside other requests (bit-exact speculative decoding in "
               "bf16): the decode / verify projections, router gate and LM head of 16-bit "
               "weights run the small-M Triton GEMM (sgl_kernel.small_m_gemm; fp8 weights "
               "always do), MLA's absorbed per-head products run as grouped mat-vecs, and the "
               "Triton MLA kernel splits keys at fixed boundaries. Off CUDA the torch paths run "
               "regardless.")
    _flag(g, "--disable-cuda-graph", action="store_true",
          words="off on CUDA; always on without CUDA",
          help="Run every forward eagerly (no CUDA graph capture).")
    _flag(g, "--cuda-graph-max-bs", type=int, default=d["cuda_graph_max_bs"],
          words=f"the largest --cuda-graph-bs, else {DEFAULT_CUDA_GRAPH_MAX_BS} "
                f"({SPECULATIVE_CUDA_GRAPH_MAX_BS} with speculative decoding), at most "
                "--max-running-requests",
          help="Largest batch size captured.")
    _flag(g, "--cuda-graph-bs", type=int, nargs="+", default=d["cuda_graph_bs"],
          words="1 2 4 8 12 16 24 32 ... up to --cuda-graph-max-bs; finer steps with "
                "speculative decoding",
          help="Batch sizes to capture; a batch replays the smallest captured size that holds "
               "it.")
    _flag(g, "--prefill-cuda-graph-tokens", type=_token_count_or_none, nargs="+", metavar="N",
          default=d["prefill_cuda_graph_tokens"],
          words=f"{' '.join(map(str, DEFAULT_PREFILL_CUDA_GRAPH_TOKENS))}, each at most "
                "--chunked-prefill-size; only the smallest that keep the process below 4 CUDA "
                "graphs when the decode graphs are fewer; none with "
                "--enable-deterministic-inference",
          help="Token counts at which a one-request prefill is captured as a CUDA graph of the "
               "whole forward (not upstream's piecewise graphs). A fresh prompt of up to the "
               "largest count replays the smallest count that holds it, padded at its end; "
               "other prefills (several requests, a cached prefix, input logprobs) run "
               "eagerly. 'none': every prefill runs eagerly. CUDA only; none with "
               "--disable-cuda-graph.")


def _logging_flags(g: Any, d: Dict[str, Any]) -> None:
    _flag(g, "--log-level", choices=LOG_LEVEL_CHOICES, default=d["log_level"],
          help="Level of the server's log.")
    _flag(g, "--stream-interval", type=int, default=d["stream_interval"],
          help="Decode steps between two streamed chunks of a response.")
    _flag(g, "--decode-log-interval", type=int, default=d["decode_log_interval"],
          help="Decode steps between two throughput log lines.")
    _flag(g, "--enable-metrics", action="store_true",
          help="Serve Prometheus metrics at GET /metrics (needs prometheus_client).")
    _flag(g, "--log-requests", action="store_true",
          help="Log every request when it arrives and when it finishes (at log level info); "
               "--log-requests-level sets how much.")
    _flag(g, "--log-requests-level", type=int, choices=LOG_REQUESTS_LEVEL_CHOICES,
          default=d["log_requests_level"],
          help="0: metadata (no sampling parameters). 1: metadata and sampling parameters. "
               "2: also the input and output, cut to their first 2048 characters. 3: everything.")


def _compat_flags(g: Any, d: Dict[str, Any]) -> None:
    for flag in ("--trust-remote-code", "--disable-radix-cache", "--enable-mixed-chunk"):
        _flag(g, flag, action="store_true", help=NO_OP_FLAGS[flag] + ".")
    flag = "--flashinfer-allreduce-fusion-backend"
    _flag(g, flag, choices=FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES,
          default=d["flashinfer_allreduce_fusion_backend"], words="auto",
          help=NO_OP_FLAGS[flag] + ".")


# ---------------------------------------------------------------------------- --help and parsing
def shown_default(action: argparse.Action) -> Optional[str]:
    """What ``--help`` says an option's default is: the words it was registered with while its
    default is unchanged (a ``--config`` file changes it), else the value itself; ``None`` when
    there is nothing to show (``--help``, ``--version``, an option without a default)."""
    if not action.option_strings or action.default is argparse.SUPPRESS:
        return None
    words = getattr(action, _WORDS_ATTR, None)
    if words is not None and action.default == getattr(action, _REGISTERED_ATTR, None):
        return words
    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false switches
        return "on" if action.default == action.const else "off"
    if action.default is None:
        return None
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    if isinstance(action.default, (list, tuple)):
        return " ".join(map(str, action.default))
    return str(action.default) if action.default != "" else "''"


class ServerHelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, with ``(default: ...)`` after each option's text
    (:func:`shown_default`) and short metavars (``PATH``, ``INT``) instead of the flag name in
    capitals, which doubled the width of every line."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = shown_default(action)
        # Scripts that add their own flags next to the server's may already say the default.
        if shown is None or _SAYS_DEFAULT.search(text):
            return text
        # argparse %-formats the help string: a literal % in the words must be doubled.
        suffix = f"(default: {shown.replace('%', '%%')})"
        return f"{text} {suffix}" if text else suffix

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.dest.endswith("_path"):
            return "PATH"
        return {int: "INT", float: "FLOAT"}.get(action.type, "STR")


def package_version() -> str:
    """The sglang version: ``sglang.__version__``, else the installed distribution's, else a
    marker saying that neither is known (a bare source checkout)."""
    import sglang

    version = getattr(sglang, "__version__", None)
    if version:
        return str(version)
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "unknown (source checkout, not installed)"


def _looks_like_flag(word: str) -> bool:
    return len(word) > 1 and word.startswith("-") and not _NEGATIVE_NUMBER.match(word)


def _close_flag(flag: str, known: Sequence[str]) -> Optional[str]:
    """The flag of ``known`` that ``flag`` most likely misspells, if any. Never for an upstream
    flag this engine lacks (--dp-size is no misspelling of --tp-size)."""
    if flag in UPSTREAM_ONLY_FLAGS:
        return None
    # An abbreviation (which argparse would have taken, were it allowed) means its one flag.
    longer = [k for k in known if k.startswith(flag)]
    if len(longer) == 1:
        return longer[0]
    # A high cutoff: a looser one offers unrelated flags (--enable-metrics for
    # --enable-dp-attention), which reads as if they did the same thing.
    close = difflib.get_close_matches(flag, list(known), n=1, cutoff=0.8)
    return close[0] if close else None


def unknown_arguments_message(extras: Sequence[str], known: Sequence[str]) -> str:
    """One line (without ``error:``) about the words of a command line that no option took:
    the unknown flags, each with why it is refused (an upstream flag this engine lacks, or the
    flag it likely misspells), or else the first stray argument. ``known`` are the parser's
    option strings."""
    flags = list(dict.fromkeys(w.split("=", 1)[0] for w in extras if _looks_like_flag(w)))
    see = "--help lists the flags this engine has"
    if not flags:
        return f"unexpected argument {extras[0]!r}: every option is a --flag ({see})"
    upstream = [f for f in flags if f in UPSTREAM_ONLY_FLAGS]
    close = {f: _close_flag(f, known) for f in flags if f not in UPSTREAM_ONLY_FLAGS}
    if len(flags) == 1:
        flag = flags[0]
        if upstream:
            why = "an upstream SGLang flag that this engine does not implement; remove it"
        elif close[flag]:
            why = f"did you mean {close[flag]}?"
        else:
            why = "this engine does not implement it; remove it"
        return f"unknown flag {flag}: {why} ({see})"
    parts = []
    if upstream:
        parts.append(f"{', '.join(upstream)} (upstream SGLang flags that this engine does not "
                     "implement)")
    parts += [f"{f} (did you mean {m}?)" for f, m in close.items() if m]
    other = [f for f, m in close.items() if not m]
    if other:
        parts.append(f"{', '.join(other)} (not implemented here)")
    return f"unknown flags {', '.join(parts)}; {see}"


class ServerArgumentParser(argparse.ArgumentParser):
    """The parser of a command that takes server flags: no abbreviations, a short usage line
    (argparse's own lists every flag: dozens of lines above each error), ``--version``, every
    default in ``--help``, and an unknown flag reported in one line with exit code 2 instead of
    the usage and "unrecognized arguments"."""

    def __init__(self, prog: str, description: Optional[str] = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", ServerHelpFormatter)
        kwargs.setdefault("usage", "%(prog)s [--flag [VALUE ...] ...]  (--help lists the flags)")
        super().__init__(prog=prog, description=description, allow_abbrev=False, **kwargs)
        self.add_argument("--version", action="version", version=f"sglang {package_version()}",
                          help="Print the sglang version and exit.")

    def parse_args(self, args: Optional[Sequence[str]] = None,
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        """``argparse.ArgumentParser.parse_args``, except that words no option takes end the
        process with one line naming them (exit code 2)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            known: List[str] = [opt for opt in self._option_string_actions if opt.startswith("--")]
            self.exit(2, f"error: {unknown_arguments_message(extras, known)}\n")
        return parsed
