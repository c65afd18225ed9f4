"""The command-line flags of :class:`~sglang.srt.server_args.ServerArgs` (SGLang's names).

``register_server_flags`` adds one argparse option per ``ServerArgs`` field (the field name with
``_`` -> ``-``); ``ServerArgs.add_cli_args`` calls it with the dataclass defaults. Every flag acts
as upstream SGLang's does or is refused (by argparse choices, or by ``ServerArgs.check`` with a
message naming it), except the few in :data:`NO_OP_FLAGS`, whose help says what they do here.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict

from sglang.srt.configs.engine_defaults import (
    ATTENTION_BACKEND_CHOICES,
    CPU_MAX_DEFAULT_THREADS,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DEFAULT_MEM_FRACTION_STATIC,
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
)
from sglang.srt.managers.template_manager import BUILTIN_CHAT_TEMPLATES

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


def register_server_flags(parser: argparse.ArgumentParser, d: Dict[str, Any]) -> None:
    """Add every server flag to ``parser``; ``d`` maps field names to their defaults."""
    a = parser.add_argument
    # Model and tokenizer
    a("--model-path", "--model", type=str, default=d["model_path"],
      help="Checkpoint folder or preset name (e.g. ling-3.0-flash); default: bundled model.")
    a("--tokenizer-path", type=str, default=d["tokenizer_path"], help="Default: the model path.")
    a("--trust-remote-code", action="store_true", help=NO_OP_FLAGS["--trust-remote-code"] + ".")
    a("--load-format", choices=LOAD_FORMAT_CHOICES, default=d["load_format"],
      help="dummy: random weights from the config (performance work).")
    a("--quantization", choices=QUANTIZATION_CHOICES, default=d["quantization"],
      help="fp8: block-fp8 weights (an fp8 checkpoint as is, a bf16 one or dummy weights "
           "quantised at load); unquant: the model dtype. Default: as the checkpoint is.")
    a("--json-model-override-args", type=str, default=d["json_model_override_args"],
      help="JSON object overriding config.json fields, e.g. '{\"num_hidden_layers\": 2}'.")
    a("--context-length", type=int, default=d["context_length"])
    a("--served-model-name", type=str, default=d["served_model_name"])
    a("--chat-template", type=str, default=d["chat_template"],
      help="Jinja chat template for /v1/chat/completions instead of the tokenizer's: a template "
           f"file, or a built-in name ({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))}).")
    # HTTP
    a("--host", type=str, default=d["host"])
    a("--port", type=int, default=d["port"])
    a("--api-key", type=str, default=d["api_key"], help="Require this bearer token.")
    a("--skip-server-warmup", action="store_true")
    # Runtime
    a("--dtype", choices=DTYPE_CHOICES, default=d["dtype"],
      help="auto: bfloat16 on CUDA, float32 on CPU.")
    a("--device", choices=DEVICE_CHOICES, default=d["device"])
    a("--tp-size", "--tensor-parallel-size", type=int, default=d["tp_size"])
    a("--random-seed", type=int, default=d["random_seed"])
    a("--mem-fraction-static", type=float, default=d["mem_fraction_static"],
      help=f"Fraction of GPU memory for weights and caches (default {DEFAULT_MEM_FRACTION_STATIC}).")
    a("--max-running-requests", type=int, default=d["max_running_requests"])
    a("--max-total-tokens", type=int, default=d["max_total_tokens"])
    a("--chunked-prefill-size", type=int, default=d["chunked_prefill_size"],
      help=f"Tokens per prefill chunk (default {DEFAULT_CHUNKED_PREFILL_SIZE}); -1 disables.")
    a("--max-prefill-tokens", type=int, default=d["max_prefill_tokens"],
      help=f"Prompt tokens of new requests in one prefill batch (default "
           f"{DEFAULT_MAX_PREFILL_TOKENS}); a longer prompt still starts alone, chunked.")
    a("--enable-mixed-chunk", action="store_true", help=NO_OP_FLAGS["--enable-mixed-chunk"] + ".")
    a("--disable-radix-cache", action="store_true",
      help=NO_OP_FLAGS["--disable-radix-cache"] + ".")
    a("--disable-overlap-schedule", action="store_true", help="Consume each step's result "
      "before launching the next (no host run-ahead).")
    a("--disable-cuda-graph", action="store_true",
      help="Run every forward eagerly (no CUDA graph capture); always on without CUDA.")
    a("--cuda-graph-max-bs", type=int, default=d["cuda_graph_max_bs"],
      help="Largest batch size captured (default: the largest --cuda-graph-bs, else "
           f"{DEFAULT_CUDA_GRAPH_MAX_BS}, or {SPECULATIVE_CUDA_GRAPH_MAX_BS} with speculative "
           "decoding, capped by --max-running-requests).")
    a("--cuda-graph-bs", type=int, nargs="+", default=d["cuda_graph_bs"],
      help="Batch sizes to capture (default: 1, 2, 4, 8, 12, 16, 24, 32, ... up to "
           "--cuda-graph-max-bs; finer steps with speculative decoding).")
    a("--attention-backend", type=str, default=d["attention_backend"],
      help=f"One of {', '.join(ATTENTION_BACKEND_CHOICES)} "
           "(trtllm_mla is accepted and served by the default); default triton on CUDA, "
           "torch_native on CPU.")
    a("--flashinfer-allreduce-fusion-backend", choices=FLASHINFER_ALLREDUCE_FUSION_BACKEND_CHOICES,
      default=d["flashinfer_allreduce_fusion_backend"],
      help=NO_OP_FLAGS["--flashinfer-allreduce-fusion-backend"] + ".")
    a("--kda-prefill-impl", choices=KDA_PREFILL_IMPL_CHOICES, default=d["kda_prefill_impl"],
      help="KDA prefill kernel: torch (reference), fla (fla-core chunk_kda), auto.")
    a("--moe-runner-backend", choices=KERNEL_BACKEND_CHOICES, default=d["moe_runner_backend"],
      help="Decode/verify routed experts: triton = grouped mat-vec, experts read in place; "
           "auto = triton on CUDA, torch_native elsewhere.")
    a("--linear-attn-decode-backend", choices=KERNEL_BACKEND_CHOICES, help="KDA decode/verify "
      "recurrence: triton = one kernel per layer; auto = triton on CUDA, torch_native elsewhere.",
      default=d["linear_attn_decode_backend"])
    a("--watchdog-timeout", type=float, default=d["watchdog_timeout"],
      help="Seconds a scheduler may go without finishing a forward while it has requests; "
           "past that it dumps its threads' stacks and exits, so the server reports unhealthy "
           f"and fails the pending requests instead of hanging (default {d['watchdog_timeout']:g}).")
    a("--cpu-num-threads", type=int, default=d["cpu_num_threads"],
      help="Torch intra-op threads of each scheduler process (not an upstream flag). Default on "
           f"CPU: OMP_NUM_THREADS when set, else the usable cores split between the TP ranks, "
           f"at most {CPU_MAX_DEFAULT_THREADS} (more threads than free cores stalls every op on "
           "a shared machine); on CUDA torch's own default.")
    # Speculative decoding
    a("--speculative-algorithm", type=str, default=d["speculative_algorithm"],
      help="NEXTN (alias EAGLE) or DSPARK.")
    a("--speculative-draft-model-path", "--speculative-draft-model", type=str,
      default=d["speculative_draft_model_path"])
    a("--speculative-draft-model-quantization", choices=QUANTIZATION_CHOICES,
      default=d["speculative_draft_model_quantization"],
      help="The draft's weights (NEXTN's MTP layer): unquant keeps them in the model dtype. "
           "Default: the same as --quantization.")
    a("--speculative-num-steps", type=int, default=d["speculative_num_steps"])
    a("--speculative-eagle-topk", type=int, default=d["speculative_eagle_topk"])
    a("--speculative-num-draft-tokens", type=int, default=d["speculative_num_draft_tokens"])
    a("--speculative-dspark-block-size", type=int, default=d["speculative_dspark_block_size"],
      help="DSPARK: draft tokens per round (gamma; the verify window is gamma + 1). Default: "
           "the draft checkpoint's block_size, else 7.")
    a("--speculative-dspark-sps-table-path", type=str,
      default=d["speculative_dspark_sps_table_path"],
      help="DSPARK: JSON table of target steps/s per verify batch size; turns on the confidence "
           "scheduler (per-request verify lengths). Without it every draft is verified.")
    a("--speculative-dspark-confidence-sts-path", type=str,
      default=d["speculative_dspark_confidence_sts_path"],
      help="DSPARK: JSON list of gamma per-position temperatures calibrating the confidence "
           "head for the scheduler (needs --speculative-dspark-sps-table-path).")
    # Logging and metrics
    a("--log-level", choices=LOG_LEVEL_CHOICES, default=d["log_level"])
    a("--stream-interval", type=int, default=d["stream_interval"])
    a("--decode-log-interval", type=int, default=d["decode_log_interval"])
    a("--enable-metrics", action="store_true",
      help="Serve Prometheus metrics at GET /metrics (needs prometheus_client).")
    a("--log-requests", action="store_true",
      help="Log every request when it arrives and when it finishes (at log level info); "
           "--log-requests-level sets how much.")
    a("--log-requests-level", type=int, choices=LOG_REQUESTS_LEVEL_CHOICES,
      default=d["log_requests_level"],
      help="0: metadata (no sampling parameters). 1: metadata and sampling parameters. "
           "2: also the input and output, cut to their first 2048 characters. 3: everything.")
