r"""Peer row of the batch-1 prefill/decode measurements: transformers' own ``bailing_hybrid``.

Builds ``BailingHybridForCausalLM`` (transformers >= 5.24) with random ("dummy") weights in the
shape of our ``ling-3.0-flash`` preset, optionally overridden with ``--json-model-override-args``
(our config field names, the same meaning as the server flag; they are translated to
``BailingHybridConfig`` fields and the layer pattern is taken from *our* config so both models
have the same KDA/MLA layers). Then, per ``--prompt-len``: a warm-up, one timed prefill of the
prompt at batch 1 (median of ``--prefill-repeats``) and ``--decode-steps`` greedy decode steps
on the model's cache (median per step), timed with CUDA events (``perf_counter`` on CPU).
Prints a markdown table and appends one JSON line per prompt length to ``--result-filename``.

Attention is ``sdpa``; the routed experts use ``experts_implementation="grouped_mm"``
(``torch.nn.functional.grouped_mm`` over the 3-D expert tensors: transformers' fastest built-in
option without hub kernels; ``eager`` loops over the hit experts). Which KDA / short-conv kernels
transformers bound (fla-core or its PyTorch reference) is printed and stored in the JSON line:
it decides the peer's prefill time.

GPU (H200), the 12-layer shape (MLA at layers 5 and 11, the rest KDA; layers 0-1 dense, as in
our engine's ``{"num_hidden_layers": 12}``), bf16. The host's own transformers (5.17) has no
``bailing_hybrid``: install the staged 5.24 wheel into its own directory, first on PYTHONPATH;
``scripts/gpu_env.sh`` installs fla-core 0.6.0 (the KDA kernels transformers picks up)::

    source scripts/gpu_env.sh
    python3 -m pip install -q --no-index --no-deps --target /tmp/peer \
        .whl_peer/transformers-5.24.0-py3-none-any.whl
    PYTHONPATH=/tmp/peer:$PYTHONPATH python3 benchmark/batch1/hf_peer.py \
        --json-model-override-args '{"num_hidden_layers": 12}' --prompt-len 1024 \
        --decode-steps 32 --result-filename benchmark/results/hf_peer_h200.jsonl
    PYTHONPATH=/tmp/peer:$PYTHONPATH python3 benchmark/batch1/hf_peer.py \
        --json-model-override-args '{"num_hidden_layers": 12}' --prompt-len 8192 \
        --decode-steps 32 --result-filename benchmark/results/hf_peer_h200.jsonl

(``--prompt-len 1024 8192`` does both with one model build, ~60 GiB of weights.) The whole
42-layer preset is ~232 GiB in bf16 and does not fit one H200.

CPU smoke run (tiny shapes, fp32, the PyTorch KDA reference)::

    python benchmark/batch1/hf_peer.py --device cpu --tiny --prompt-len 16 --decode-steps 2
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("sglang") is None:  # a plain checkout: our config code is in python/
    sys.path.insert(0, str(ROOT / "python"))

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402

PRESET = "ling-3.0-flash"

# Every dimension shrunk, with the layer kinds still mixed: layers 0, 1 KDA and 2 MLA
# (layer_group_size 3), layer 0 dense and 1, 2 MoE. Token ids fit the small vocabulary.
TINY_OVERRIDES: Dict[str, Any] = {
    "num_hidden_layers": 3, "layer_group_size": 3, "first_k_dense_replace": 1,
    "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "pad_token_id": 0, "eos_token_id": 1,
}

# Our fields that BailingHybridConfig has no knob for, with what transformers does instead.
_NOT_REPRESENTED = {
    "expert_swiglu_limit_list": "no SwiGLU clamp in the routed experts",
    "share_expert_swiglu_limit_list": "no SwiGLU clamp in the shared expert",
    "router_dtype": "router always in fp32",
    "rope_interleave": "RoPE always interleaved",
}


# ---------------------------------------------------------------------------------- transformers
def import_bailing_hybrid() -> Tuple[Any, Any, Any]:
    """``(transformers, BailingHybridConfig, BailingHybridForCausalLM)``; exits with a clear
    message when this transformers has no ``bailing_hybrid`` (it arrived in 5.24)."""
    import transformers

    print(f"transformers {transformers.__version__} ({Path(transformers.__file__).parent})")
    try:
        from transformers.models.bailing_hybrid import (
            BailingHybridConfig,
            BailingHybridForCausalLM,
        )
    except ImportError as e:
        raise SystemExit(
            f"transformers {transformers.__version__} has no models.bailing_hybrid ({e}); this "
            "peer needs transformers >= 5.24: install its wheel into a separate directory and "
            "put that directory first on PYTHONPATH"
        ) from e
    return transformers, BailingHybridConfig, BailingHybridForCausalLM


def hf_config_kwargs(cfg: BailingMoeV3Config) -> Tuple[Dict[str, Any], List[str]]:
    """``BailingHybridConfig`` keyword arguments for our parsed config, and notes on fields that
    transformers cannot express (reported, since they could move the comparison).

    Raises ``ValueError`` where the two models would get different weight shapes.
    """
    same = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group",
            "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "pad_token_id",
            "bos_token_id", "eos_token_id", "tie_word_embeddings", "routed_scaling_factor",
            "head_dim", "short_conv_kernel_size", "layer_group_size", "kda_safe_gate",
            "kda_lower_bound")
    kw: Dict[str, Any] = {name: getattr(cfg, name) for name in same}
    kw["num_local_experts"] = cfg.num_experts
    kw["n_shared_experts"] = cfg.num_shared_experts
    kw["num_mtp_layers"] = cfg.num_nextn_predict_layers  # stored only; causal LM skips MTP
    # Explicit per-layer kinds: transformers' default makes an incomplete tail group KDA, ours
    # makes it MLA (docs/model.md §1.3); for 12 and 42 layers they agree, this keeps any count.
    kw["layer_types"] = list(cfg.layer_types)
    kw["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense"
                             for i in range(cfg.num_hidden_layers)]
    rope: Dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling:
        rope = dict(cfg.rope_scaling)
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    rope["rope_theta"] = cfg.rope_theta
    kw["rope_parameters"] = rope
    kw["rope_theta"] = cfg.rope_theta

    # transformers sizes the shared expert as moe_intermediate_size * n_shared_experts.
    hf_shared = cfg.moe_intermediate_size * cfg.num_shared_experts
    if cfg.shared_expert_intermediate_size != hf_shared:
        raise ValueError(
            f"shared expert width {cfg.shared_expert_intermediate_size} (ours) != {hf_shared} "
            "(transformers: moe_intermediate_size * num_shared_experts); override "
            "moe_shared_expert_intermediate_size together with moe_intermediate_size"
        )
    notes = []
    if any(cfg.expert_swiglu_limit(i) for i in range(cfg.num_hidden_layers)):
        notes.append(f"expert_swiglu_limit_list: {_NOT_REPRESENTED['expert_swiglu_limit_list']}")
    if any(cfg.shared_expert_swiglu_limit(i) for i in range(cfg.num_hidden_layers)):
        notes.append("share_expert_swiglu_limit_list: "
                     + _NOT_REPRESENTED["share_expert_swiglu_limit_list"])
    if cfg.router_dtype != "fp32":
        notes.append(f"router_dtype {cfg.router_dtype}: {_NOT_REPRESENTED['router_dtype']}")
    if not cfg.rope_interleave:
        notes.append(f"rope_interleave false: {_NOT_REPRESENTED['rope_interleave']}")
    return kw, notes


def build_model(model_cls: Any, config: Any, device: torch.device, dtype: torch.dtype,
                attn_implementation: str, experts_implementation: str) -> torch.nn.Module:
    """Instantiate the model directly on ``device`` in ``dtype`` without any weight init.

    ``no_init_weights`` turns ``torch.nn.init`` and transformers' ``init_weights`` into no-ops,
    so parameters are ``torch.empty`` storage until :func:`fill_dummy_weights` (random init of
    ~60 GB on the CPU would take minutes). Parameters the model declares in fp32 (router, KDA
    ``A_log``/``dt_bias``, short conv) stay fp32, as ``from_pretrained`` keeps them.
    """
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        model = model_cls._from_config(
            config, dtype=dtype, attn_implementation=attn_implementation,
            experts_implementation=experts_implementation)
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place on its device, with the rule of our ``--load-format dummy``
    (``sglang.srt.model_loader.dummy``) so activations and routing behave alike: >= 2-D weights
    ~ N(0, 1/fan_in) with fan_in the last dim, 1-D ``*norm*`` weights 1, other 1-D (``A_log``,
    ``dt_bias``) 0. Random router weights give random routing, as in our engine's dummy runs."""
    gen: Optional[torch.Generator] = None
    for name, param in model.named_parameters():
        data = param.data
        if gen is None or gen.device != data.device:
            gen = torch.Generator(device=data.device)
            gen.manual_seed(seed)
        if data.dim() >= 2:
            data.normal_(0.0, float(data.shape[-1]) ** -0.5, generator=gen)
        elif "norm" in name.lower():
            data.fill_(1.0)
        else:
            data.zero_()
    for name, buf in model.named_buffers():
        # Constructed values (RoPE frequencies, zero expert bias) are valid; check they are.
        if buf.is_floating_point() and not torch.isfinite(buf).all():
            raise RuntimeError(f"buffer {name} is not finite after construction")


def _bound_implementation(fn: Callable) -> Optional[Callable]:
    """The function transformers' ``use_kernel_func_from_hub_with_fallback`` chose at import
    time (a closure variable of the wrapper), or ``None`` if the wrapper looks different.
    transformers 5.25 hands the wrapper out inside a hub-kernel module (an ``nn.Module`` whose
    ``forward`` closes over it as ``func``): that layer is looked through."""
    forward = getattr(getattr(fn, "forward", None), "__func__", None)
    fcode = getattr(forward, "__code__", None)
    if fcode is not None and "func" in fcode.co_freevars and forward.__closure__ is not None:
        fn = forward.__closure__[fcode.co_freevars.index("func")].cell_contents
    code = getattr(fn, "__code__", None)
    if code is None or "implementation" not in code.co_freevars or fn.__closure__ is None:
        return None
    return fn.__closure__[code.co_freevars.index("implementation")].cell_contents


def kernel_report(modeling: Any) -> Dict[str, str]:
    """Which implementation each KDA/short-conv function of ``modeling_bailing_hybrid`` runs:
    ``"torch fallback"`` (the module's PyTorch reference) or the package function with the
    package version (fla-core for KDA, causal-conv1d for the short conv)."""
    out: Dict[str, str] = {}
    for label, attr in (("kda_chunk", "chunk_kimi_delta_attention"),
                        ("kda_recurrent", "recurrent_kimi_delta_attention"),
                        ("conv1d", "causal_conv1d_fn"),
                        ("conv1d_update", "causal_conv1d_update")):
        fn = getattr(modeling, attr, None)
        impl = _bound_implementation(fn) if fn is not None else None
        if impl is None:
            out[label] = "unknown"
        elif getattr(impl, "__module__", "") == modeling.__name__:
            out[label] = "torch fallback"
        else:
            package = impl.__module__.split(".")[0]
            version = getattr(importlib.import_module(package), "__version__", "?")
            out[label] = f"{impl.__module__}.{impl.__qualname__} ({package} {version})"
    return out


def grouped_mm_op(model: torch.nn.Module) -> str:
    """The op behind ``experts_implementation="grouped_mm"`` for this model's expert weights:
    torch's grouped GEMM, or transformers' per-expert ``torch.mm`` loop where torch has none
    for this device/dtype (asked through transformers' own check)."""
    from transformers.integrations import moe

    experts = next((m for m in model.modules() if hasattr(m, "gate_up_proj")), None)
    if experts is None:
        return "no routed experts"
    weight = experts.gate_up_proj
    probe = torch.zeros(1, weight.shape[-1], device=weight.device, dtype=weight.dtype)
    offs = torch.ones(weight.shape[0], device=weight.device, dtype=torch.int32)
    try:
        usable = moe._can_use_grouped_mm(probe, weight, offs)
    except Exception as e:  # a private helper: report rather than fail the measurement
        return f"unknown ({type(e).__name__})"
    if not usable:
        return "transformers per-expert torch.mm loop"
    if hasattr(torch.nn.functional, "grouped_mm"):
        return "torch.nn.functional.grouped_mm"
    return "torch._grouped_mm"


# ---------------------------------------------------------------------------------- timing
class _Timer:
    """Elapsed ms of a region: CUDA events on the stream (no sync inside a step), else
    ``perf_counter``. ``stop`` returns a callable that yields the ms once the device is done."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> Callable[[], float]:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return lambda: start.elapsed_time(end)
        ms = (time.perf_counter() - start) * 1e3
        return lambda: ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _prefill(model: torch.nn.Module, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """One prefill on a fresh cache; logits of the last position only (as a serving engine)."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], out.cache


@torch.inference_mode()
def _decode(model: torch.nn.Module, token: torch.Tensor, cache: Any) -> torch.Tensor:
    """One greedy decode step on ``cache`` (updated in place); next-token logits."""
    out = model(input_ids=token, cache=cache, use_cache=True)
    return out.logits[:, -1]


@torch.inference_mode()
def measure(model: torch.nn.Module, prompt_len: int, decode_steps: int, vocab_size: int,
            device: torch.device, warmup_decode: int = 2, prefill_repeats: int = 1,
            seed: int = 0) -> Dict[str, Any]:
    """Time a batch-1 prefill of ``prompt_len`` random tokens and ``decode_steps`` greedy steps.

    A full warm-up (prefill plus ``warmup_decode`` steps: Triton autotuning, cuBLAS handles)
    runs first. Decode continues from the last timed prefill's cache; a step is the forward plus
    the argmax. Returns ms and whether every logit seen was finite.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, prompt_len), generator=gen).to(device)
    timer = _Timer(device)

    logits, cache = _prefill(model, ids)
    for _ in range(warmup_decode):
        logits = _decode(model, logits.argmax(-1, keepdim=True), cache)
    _sync(device)
    del cache

    prefill_ms: List[Callable[[], float]] = []
    finite = torch.ones((), dtype=torch.bool, device=device)
    for _ in range(max(1, prefill_repeats)):
        cache = None  # free the previous cache before the next prefill allocates one
        t0 = timer.start()
        logits, cache = _prefill(model, ids)
        prefill_ms.append(timer.stop(t0))
        finite &= torch.isfinite(logits).all()
    step_ms: List[Callable[[], float]] = []
    for _ in range(decode_steps):
        t0 = timer.start()
        logits = _decode(model, logits.argmax(-1, keepdim=True), cache)
        step_ms.append(timer.stop(t0))
        finite &= torch.isfinite(logits).all()
    _sync(device)
    steps = [f() for f in step_ms]
    return {
        "prefill_ms": round(statistics.median(f() for f in prefill_ms), 3),
        "decode_median_ms": round(statistics.median(steps), 3) if steps else None,
        "decode_steps": decode_steps,
        "prefill_repeats": max(1, prefill_repeats),
        "finite": bool(finite.item()),
    }


# ---------------------------------------------------------------------------------- CLI
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=PRESET,
                   help="our preset (or a checkpoint folder) whose config.json gives the shape")
    p.add_argument("--json-model-override-args", default="{}",
                   help="JSON object of our config fields, as the server flag")
    p.add_argument("--tiny", action="store_true",
                   help="shrink every dimension (CPU smoke test); overrides still apply on top")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[1024])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--warmup-decode", type=int, default=2, help="decode steps of the warm-up")
    p.add_argument("--prefill-repeats", type=int, default=3,
                   help="timed prefills per prompt length (median)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--experts-implementation", default="grouped_mm",
                   help="transformers' experts_implementation: grouped_mm, batched_mm, eager, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-filename", default=None, help="append one JSON line per prompt length")
    p.add_argument("--run-name", default=None)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Build, fill and time the transformers peer; print the table; return the result rows."""
    args = parse_args(argv)
    transformers, config_cls, model_cls = import_bailing_hybrid()
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as modeling

    overrides = dict(TINY_OVERRIDES) if args.tiny else {}
    overrides.update(json.loads(args.json_model_override_args or "{}"))
    ours = ModelConfig.from_path(args.model_path, overrides).hf_config
    kwargs, notes = hf_config_kwargs(ours)
    config = config_cls(**kwargs)
    if list(config.layer_types) != ours.layer_types:
        raise RuntimeError(f"layer kinds differ: ours {ours.layer_types}, "
                           f"transformers {config.layer_types}")

    device = torch.device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = build_model(model_cls, config, device, dtype, args.attn_implementation,
                        args.experts_implementation)
    fill_dummy_weights(model, args.seed)
    _sync(device)
    build_s = time.perf_counter() - t0
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    attn_impl = model.config._attn_implementation
    experts_impl = model.config._experts_implementation
    kernels = kernel_report(modeling)
    experts_op = grouped_mm_op(model) if experts_impl == "grouped_mm" else None

    mla = [i for i, t in enumerate(ours.layer_types) if t == "full_attention"]
    print(f"model: {ours.num_hidden_layers} layers (MLA at {mla}, the rest KDA; "
          f"first {ours.first_k_dense_replace} dense), {weight_gb:.2f} GiB {dtype}, "
          f"built+filled in {build_s:.1f} s on {device}")
    print(f"attention: {attn_impl}; experts: {experts_impl}"
          + (f" ({experts_op})" if experts_op else ""))
    for label, impl in kernels.items():
        print(f"{label}: {impl}")
    for note in notes:
        print(f"not in transformers' model: {note}")
    if device.type == "cuda" and kernels["kda_chunk"] == "torch fallback":
        print("WARNING: KDA runs transformers' PyTorch reference (fla not importable): the "
              "prefill time is that of the reference loop, not of fla's kernels")

    rows: List[Dict[str, Any]] = []
    for prompt_len in args.prompt_len:
        res = measure(model, prompt_len, args.decode_steps, ours.vocab_size, device,
                      args.warmup_decode, args.prefill_repeats, args.seed)
        row = {
            "run_name": args.run_name or f"hf_peer {ours.num_hidden_layers}L",
            "impl": "transformers",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
            "dtype": str(dtype).replace("torch.", ""),
            "layers": ours.num_hidden_layers,
            "batch_size": 1,
            "prompt_len": prompt_len,
            **res,
            "attn_implementation": attn_impl,
            "experts_implementation": experts_impl,
            "experts_op": experts_op,
            "kda_kernel": kernels["kda_chunk"],
            "kda_decode_kernel": kernels["kda_recurrent"],
            "conv1d_kernel": kernels["conv1d"],
            "weight_gb": round(weight_gb, 3),
            "overrides": overrides,
            "not_represented": notes,
        }
        if device.type == "cuda":
            row["cuda_peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        rows.append(row)
        if not res["finite"]:
            print(f"WARNING: non-finite logits at prompt_len {prompt_len}")
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps(row) + "\n")

    print()
    print("| impl | transformers | layers | prompt | prefill ms | decode median ms | finite |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| transformers ({r['experts_implementation']}, {r['attn_implementation']}, KDA "
              f"{'fla' if r['kda_kernel'].startswith('fla') else r['kda_kernel']}) "
              f"| {r['transformers']} | {r['layers']} | {r['prompt_len']} | {r['prefill_ms']:.2f} "
              f"| {r['decode_median_ms']} | {r['finite']} |")
    return rows


if __name__ == "__main__":
    main()
