"""Numerics as a knob: greedy agreement and NEXTN accept length across the variants of one knob
(the router gate's dtype, or the weights' quantization).

    python benchmark/batch1/numerics_ab.py [--model-path DIR] [--knob router|quantization] \\
        [--variants fp32 bf16] [--prompts 8] [--gen 128] [--steps 3] [--device cpu] \\
        [--result-filename F]

At batch 1 the router gate is pure bandwidth (every MoE layer cold-reads its ``[E, H]`` weight
each step), so computing it in bf16 instead of fp32 halves those bytes; the price is rounding:
a different expert can win a near tie. This script measures the price on the model's own terms:
for each variant an ``sglang.Engine`` decodes held-out Python prompts greedily, plain and with
NEXTN; it reports how many outputs equal the first variant's token for token, the mean position
of the first differing token, and the NEXTN mean accept length. ``--knob router`` (default;
variants fp32 / bf16) sets ``--json-model-override-args '{"router_dtype": ...}'`` (the config
field of docs/model.md §5.2); ``--knob quantization`` (variants none / fp8) sets
``--quantization`` (block fp8 at load, the MTP layer quantized alike).

The LM head needs no knob here: it already runs in the model dtype (bf16 on the GPU; fp32 models
are the CPU reference), which is the seed's bf16 LM head.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.entrypoints.engine import Engine
from sglang.train.data import HELD_OUT_FILES, stdlib_root


def held_out_prompts(engine: Engine, count: int, length: int) -> List[List[int]]:
    """``count`` prompts of ``length`` tokens from the held-out files, each starting at a
    function definition a third into the file."""
    tok = engine.tokenizer_manager.tokenizer
    out = []
    for name in HELD_OUT_FILES:
        text = (stdlib_root() / name).read_text(encoding="utf-8")
        start = text.find("\ndef ", len(text) // 3) + 1
        ids = tok.encode(text[start:start + 4000])[:length]
        if len(ids) == length:
            out.append(ids)
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} held-out files give {length}-token prompts")


def _decode(engine: Engine, prompts: List[List[int]], gen: int) -> List[Dict[str, Any]]:
    params = {"temperature": 0, "max_new_tokens": gen, "ignore_eos": True}
    return engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))


def knob_args(knob: str, variant: str) -> Dict[str, Any]:
    """Engine keyword arguments of one variant of ``knob``."""
    if knob == "router":
        return {"json_model_override_args": json.dumps({"router_dtype": variant})}
    if knob == "quantization":
        return {"quantization": None if variant == "none" else variant}
    raise SystemExit(f"unknown knob {knob!r}: router or quantization")


def run_variant(model_path: str, knob: str, variant: str, device: str, prompts_n: int,
                prompt_len: int, gen: int, steps: int) -> Dict[str, Any]:
    """Greedy outputs (plain) and the NEXTN accept length of one variant."""
    common = dict(model_path=model_path, device=device, log_level="error",
                  **knob_args(knob, variant))
    with Engine(**common) as engine:
        prompts = held_out_prompts(engine, prompts_n, prompt_len)
        plain = [o["output_ids"] for o in _decode(engine, prompts, gen)]
    with Engine(**common, speculative_algorithm="NEXTN", speculative_num_steps=steps) as engine:
        outs = _decode(engine, prompts, gen)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    return {"variant": variant, "plain": plain,
            "nextn_ids": [o["output_ids"] for o in outs],
            "accept_length": tokens / max(rounds, 1)}


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    """Index of the first differing token (None when equal over the shorter length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=str(BUNDLED_MODEL_DIR))
    p.add_argument("--knob", choices=("router", "quantization"), default="router")
    p.add_argument("--variants", nargs="+", default=None,
                   help="default: fp32 bf16 (router), none fp8 (quantization)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--result-filename", default=None)
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = ["fp32", "bf16"] if args.knob == "router" else ["none", "fp8"]
    runs = [run_variant(args.model_path, args.knob, v, args.device, args.prompts,
                        args.prompt_len, args.gen, args.steps) for v in args.variants]
    base = runs[0]["plain"]
    rows = []
    print(f"| {args.knob} | plain greedy == {args.variants[0]} | mean first difference | "
          f"NEXTN-{args.steps} == own plain | NEXTN-{args.steps} accept length |")
    print("|---|---|---|---|---|")
    for run in runs:
        diffs = [first_difference(a, b) for a, b in zip(run["plain"], base)]
        same = sum(d is None for d in diffs)
        mean_diff = (sum(args.gen if d is None else d for d in diffs) / len(diffs))
        lossless = sum(a == b for a, b in zip(run["nextn_ids"], run["plain"]))
        row = {"knob": args.knob, "variant": run["variant"], "identical": same,
               "prompts": len(diffs),
               "mean_first_difference": mean_diff, "nextn_lossless": lossless,
               "accept_length": run["accept_length"], "gen": args.gen, "steps": args.steps}
        rows.append(row)
        print(f"| {row['variant']} | {same}/{len(diffs)} | {mean_diff:.1f} of {args.gen} | "
              f"{lossless}/{len(diffs)} | {row['accept_length']:.3f} |")
    if args.result_filename:
        with open(args.result_filename, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
