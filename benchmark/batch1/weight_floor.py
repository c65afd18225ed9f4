"""Weight-bandwidth floor of one batch-1 decode step: bytes the step must read / HBM bandwidth.

At batch 1 every decode step streams the weights it touches (all attention and dense weights, the
router, the shared expert, the ``top_k`` selected experts of each MoE layer, the lm_head) plus the
recurrent KDA state (read and written) and the MLA latent cache of the context. Dividing by the
measured device-to-device copy bandwidth gives a lower bound on the step time that no kernel work
can beat; the engine's measured step is reported next to it.

    python benchmark/batch1/weight_floor.py --model-path ling-3.0-flash \
        --json-model-override-args '{"num_hidden_layers": 12}' --context 8192 [--measure]
        [--quantization fp8] [--tokens 4]
"""
from __future__ import annotations

import argparse
import json
from typing import Dict

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.srt.configs.model_config import ModelConfig


FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)  # an e4m3 weight plus its share of one fp32 block scale


def decode_step_bytes(cfg: BailingMoeV3Config, context: int, weight_bytes: int = 2,
                      tokens: int = 1, quant_bytes: float = None) -> Dict[str, float]:
    """Bytes read by one decode forward of ``tokens`` tokens at ``context``, by category.

    ``quant_bytes``: bytes per weight of the quantised projections (attention, dense MLP,
    experts; e.g. :data:`FP8_BLOCK_BYTES`); the router, the lm_head and the caches keep
    ``weight_bytes`` (the model dtype) as ``--quantization fp8`` leaves them.

    Routed experts count ``num_experts_per_tok`` distinct experts per token (an upper bound for
    ``tokens`` > 1 where experts repeat). The router weight is counted in fp32 when
    ``router_dtype`` is fp32, the KDA state as fp32 read + write.
    """
    qb = weight_bytes if quant_bytes is None else quant_bytes
    h = cfg.hidden_size
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    kda_w = (5 * h * nh * hd + h * nh + nh * hd * h + 3 * nh * hd * cfg.short_conv_kernel_size)
    kda_state = 2 * nh * hd * hd * 4  # fp32 read + write
    q_in = cfg.q_lora_rank
    q_w = (h * q_in + q_in * nh * cfg.qk_head_dim) if q_in else h * nh * cfg.qk_head_dim
    mla_w = (q_w + h * cfg.kv_cache_dim + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
             + h * nh + nh * cfg.v_head_dim * h)
    mla_cache = context * cfg.kv_cache_dim * weight_bytes
    expert_w = 3 * h * cfg.moe_intermediate_size
    shared_w = 3 * h * cfg.shared_expert_intermediate_size
    router_bytes = cfg.num_experts * h * (4 if cfg.router_dtype == "fp32" else weight_bytes)
    dense_w = 3 * h * cfg.intermediate_size
    n_experts = min(cfg.num_experts, cfg.num_experts_per_tok * tokens)
    out = {"kda_weights": 0.0, "kda_state": 0.0, "mla_weights": 0.0, "mla_cache": 0.0,
           "dense_mlp": 0.0, "moe_routed": 0.0, "moe_shared": 0.0, "router": 0.0}
    for i in range(cfg.num_hidden_layers):
        if cfg.is_kda_layer(i):
            out["kda_weights"] += kda_w * qb
            out["kda_state"] += kda_state
        else:
            out["mla_weights"] += mla_w * qb
            out["mla_cache"] += mla_cache
        if cfg.is_moe_layer(i):
            out["moe_routed"] += n_experts * expert_w * qb
            out["moe_shared"] += shared_w * qb
            out["router"] += router_bytes
        else:
            out["dense_mlp"] += dense_w * qb
    out["lm_head"] = float(cfg.vocab_size * h * weight_bytes)
    out["total"] = sum(out.values())
    return out


def measure_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (CUDA only)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="ling-3.0-flash")
    p.add_argument("--json-model-override-args", default=None)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="use this bandwidth (GB/s) instead of measuring")
    p.add_argument("--measure", action="store_true", help="measure copy bandwidth on CUDA")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="block-fp8 projections and experts (as --quantization fp8 serves them)")
    p.add_argument("--tokens", type=int, default=1,
                   help="tokens per forward (a NEXTN verify of k steps reads k + 1)")
    args = p.parse_args()
    cfg = ModelConfig.from_path(args.model_path, args.json_model_override_args).hf_config
    parts = decode_step_bytes(cfg, args.context, tokens=args.tokens,
                              quant_bytes=FP8_BLOCK_BYTES if args.quantization else None)
    bw = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else (
        measure_copy_bandwidth() if args.measure else None)
    for k, v in parts.items():
        print(f"{k:>12}: {v / 1e6:10.1f} MB")
    result = {"bytes": parts, "context": args.context, "tokens": args.tokens,
              "quantization": args.quantization}
    if bw:
        result["bandwidth_GBps"] = bw / 1e9
        result["floor_ms"] = parts["total"] / bw * 1e3
        print(f"bandwidth {bw / 1e9:.0f} GB/s -> floor {result['floor_ms']:.3f} ms per decode step")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
