"""Fit the STS temperatures of a DSpark draft's confidence head on held-out data.

Usage::

    python -m sglang.benchmark.dspark_sts_fit --target-path TARGET --output sts.json \\
        [--draft-path DRAFT] [--num-prompts 64] [--prompt-len 64] [--max-new-tokens 128] \\
        [--device auto] [--seed 0] [--data-cache held_out.pt]

    python -m sglang.launch_server --model-path TARGET --speculative-algorithm DSPARK \\
        --speculative-dspark-sps-table-path sps.json \\
        --speculative-dspark-confidence-sts-path sts.json

``--target-path`` defaults to the bundled model (``python/sglang/assets/tiny-bailing-v3``),
``--draft-path`` to the target's ``dspark/`` folder (the rule of
:func:`sglang.srt.configs.dspark.find_dspark_draft`, as the server applies it). The output is the
JSON list of ``gamma`` temperatures that ``--speculative-dspark-confidence-sts-path`` loads
(:mod:`sglang.srt.rounds.dspark.sts`); ``--block-size`` must then equal the server's
``--speculative-dspark-block-size`` when that flag is used.

Steps (every one seeded by ``--seed``):

1. **Held-out prompts**: ``--num-prompts`` windows of ``--prompt-len`` tokens from the held-out
   files of the training corpus (:mod:`sglang.train.data`; the bundled target and draft never
   saw them), drawn by :func:`sglang.train.dspark_data.draw_prompts`.
2. **Greedy continuations** of ``--max-new-tokens`` tokens by the target through
   ``sglang.Engine`` (:func:`~sglang.train.dspark_data.generate_with_engine`), then the target's
   features of each whole sequence (:class:`~sglang.train.dspark_data.TargetFeatureRunner`).
   ``--data-cache FILE`` keeps the sequences and features for re-runs (refused when made with
   other settings or another target).
3. **Rounds**: the draft, loaded by the serving loader in fp32, drafts at every anchor of every
   sequence and greedy verification is simulated
   (:func:`sglang.train.dspark_eval.confidence_rounds`): the round at anchor ``p`` accepts draft
   ``k`` while drafts ``1 .. k`` equal the target's argmax; slots past the sequence end are not
   verified.
4. **Fit**: :func:`sglang.srt.rounds.dspark.sts.fit_sts`, position after position, each
   temperature minimising the ECE (``--num-bins`` equal-width bins) of the prefix survival
   ``a_k = prod_{i<=k} sigmoid(z_i / T_i)`` against the observed event "drafts ``1 .. k`` were
   all accepted".

Printed: per position the verified rounds, the observed prefix acceptance, the mean predicted
``a_k`` and the ECE before (all ``T = 1``) and after the fit. The temperature of position 1 never
raises its ECE (``T = 1`` is on the grid); later positions are fitted on top of the earlier
temperatures, so their ECE after is the best reachable given those, usually but not necessarily
below the uncalibrated one.

What is calibrated is acceptance under **greedy** verification (a draft survives when it equals
the target's argmax). Under sampling the acceptance of a draft is random, with probability
``1 - TV(p_draft, p_target)``, which is what the head is trained on; the greedy event is its
deterministic counterpart on the target's own greedy text.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["build_argparser", "calibration_report", "held_out_sequences", "main"]


def build_argparser() -> argparse.ArgumentParser:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m sglang.benchmark.dspark_sts_fit",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-path", default=None,
                    help="target checkpoint folder (default: the bundled model)")
    ap.add_argument("--draft-path", default=None,
                    help="DSpark draft folder (default: the target's dspark/ folder)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="gamma, as --speculative-dspark-block-size (default: the draft's)")
    ap.add_argument("--output", required=True, help="where the JSON temperature list is written")
    ap.add_argument("--num-prompts", type=int, default=64, help="held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="greedy tokens generated per prompt (anchors come from these)")
    ap.add_argument("--num-bins", type=int, default=20, help="ECE bins")
    ap.add_argument("--gen-batch-size", type=int, default=16,
                    help="engine max_running_requests while generating")
    ap.add_argument("--feature-batch-tokens", type=int, default=4096,
                    help="tokens per prefill when computing the target features")
    ap.add_argument("--data-cache", default=None,
                    help="torch file with the held-out sequences and features: read when it "
                         "exists (and matches this run), written otherwise")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto",
                    help="target dtype (auto: float32 on CPU, the checkpoint's dtype on CUDA)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads of this process and of the engine's scheduler")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _check_args(args: argparse.Namespace) -> None:
    """Refuse nonsensical values with the flag's name."""
    for name in ("num_prompts", "prompt_len", "num_bins", "gen_batch_size",
                 "feature_batch_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_new_tokens < 2:
        raise SystemExit("--max-new-tokens must be >= 2 (an anchor needs a label after it)")
    if args.block_size is not None and args.block_size < 2:
        raise SystemExit("--block-size must be >= 2")
    if args.num_threads is not None and args.num_threads < 1:
        raise SystemExit("--num-threads must be >= 1")
    if os.path.isdir(args.output):
        raise SystemExit(f"--output {args.output!r} is a folder; give a file path")


def held_out_sequences(args: argparse.Namespace, target_path: str, layer_ids: List[int],
                       device: torch.device, dtype: str) -> tuple:
    """``(sequences, embed, head)``: greedy held-out sequences with the target's features (from
    ``--data-cache`` when it matches) and the target's fp32 embedding and LM head."""
    from sglang.train.data import load_corpus
    from sglang.train.dspark_data import (FeatureSequence, SamplingSetting, TargetFeatureRunner,
                                          draw_prompts, generate_with_engine, load_feature_cache,
                                          save_feature_cache, target_fingerprint)
    from sglang.train.tokenizer import load_tokenizer

    meta = {"target": target_fingerprint(target_path), "layer_ids": layer_ids, "dtype": dtype,
            "split": "held_out", "sampling": ["greedy"],
            **{k: getattr(args, k) for k in ("num_prompts", "prompt_len", "max_new_tokens",
                                             "seed")}}
    per_seq = args.prompt_len + args.max_new_tokens

    def feature_runner() -> TargetFeatureRunner:
        # Built only once the engine is gone, so that the two never hold the device together.
        return TargetFeatureRunner(target_path, layer_ids, device=device.type, dtype=dtype,
                                   max_batch_tokens=max(args.feature_batch_tokens, per_seq),
                                   seed=args.seed)

    if args.data_cache and os.path.isfile(args.data_cache):
        _, seqs = load_feature_cache(args.data_cache, meta)
        embed, head = feature_runner().embed_and_head()
        print(f"[sts] {len(seqs)} held-out sequences from {args.data_cache}")
        return seqs, embed, head
    corpus = load_corpus()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = draw_prompts(corpus.held_out_texts(), load_tokenizer(target_path),
                           args.num_prompts, args.prompt_len, gen)
    print(f"[sts] generating {len(prompts)} held-out greedy sequences x {args.max_new_tokens} "
          "tokens with the engine", flush=True)
    batch = args.gen_batch_size
    engine_kwargs: Dict[str, Any] = dict(device=device.type, dtype=dtype, random_seed=args.seed,
                                         max_running_requests=batch,
                                         max_total_tokens=batch * per_seq + 64,
                                         log_level="warning")
    if args.num_threads is not None:
        engine_kwargs["cpu_num_threads"] = args.num_threads
    greedy = SamplingSetting()
    outputs = generate_with_engine(target_path, prompts, [greedy] * len(prompts),
                                   args.max_new_tokens, args.seed, engine_kwargs)
    tokens = [p + o for p, o in zip(prompts, outputs)]
    features = feature_runner()
    embed, head = features.embed_and_head()
    seqs = [FeatureSequence(torch.tensor(s, dtype=torch.long), len(p), greedy.name, a, f)
            for s, p, (a, f) in zip(tokens, prompts, features.features(tokens))]
    if args.data_cache:
        save_feature_cache(args.data_cache, meta, [], seqs)
    return seqs, embed, head


def calibration_report(confidence_logits: torch.Tensor, accepted: torch.Tensor,
                       verify_lens: torch.Tensor, temperatures: Optional[Sequence[float]] = None,
                       num_bins: int = 20) -> Dict[str, List[float]]:
    """Per position ``k``: ``rounds`` (verified rounds), ``observed`` (fraction of them whose
    drafts ``1 .. k`` were all accepted), ``predicted`` (mean ``a_k``) and ``ece`` of ``a_k``
    under ``temperatures`` (``None``: all 1), with the ECE the fit minimises; NaN where a
    position was never verified."""
    from sglang.srt.rounds.dspark.sts import (expected_calibration_error,
                                                   observed_prefix_acceptance, prefix_survival)

    g = confidence_logits.shape[1]
    labels, observed = observed_prefix_acceptance(accepted, g, verify_lens)
    temps = None if temperatures is None else torch.tensor(list(temperatures),
                                                           dtype=torch.float64)
    survival = prefix_survival(confidence_logits, temps)
    out: Dict[str, List[float]] = {"rounds": [], "observed": [], "predicted": [], "ece": []}
    for k in range(g):
        rows = observed[:, k]
        n = int(rows.sum())
        out["rounds"].append(n)
        if n == 0:
            for key in ("observed", "predicted", "ece"):
                out[key].append(math.nan)
            continue
        p, y = survival[rows, k], labels[rows, k]
        out["observed"].append(float(y.double().mean()))
        out["predicted"].append(float(p.mean()))
        out["ece"].append(float(expected_calibration_error(p, y, num_bins)))
    return out


def _print_table(before: Dict[str, List[float]], after: Dict[str, List[float]],
                 temps: Sequence[float]) -> None:
    print(f"{'pos':>4} {'rounds':>7} {'accepted':>9} {'pred':>7} {'ECE':>7} {'T':>7} "
          f"{'pred':>7} {'ECE':>7}")
    print(f"{'':>4} {'':>7} {'':>9} {'-- before --':>15} {'':>7} {'-- after --':>15}")
    for k, t in enumerate(temps):
        print(f"{k + 1:>4} {before['rounds'][k]:>7} {before['observed'][k]:>9.4f} "
              f"{before['predicted'][k]:>7.4f} {before['ece'][k]:>7.4f} {t:>7.3f} "
              f"{after['predicted'][k]:>7.4f} {after['ece'][k]:>7.4f}")


def _nanmean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the fit, write ``--output`` and return the temperatures with both reports."""
    from sglang.srt.configs.dspark import DSparkDraftConfig, find_dspark_draft
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
    from sglang.srt.models.dspark import load_dspark_draft
    from sglang.srt.rounds.dspark.sts import fit_sts, save_sts_temperatures
    from sglang.train.dspark_eval import confidence_rounds
    from sglang.train.eval import engine_dtype, resolve_device

    args = build_argparser().parse_args(argv)
    _check_args(args)
    t0 = time.perf_counter()
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    target_path = args.target_path or str(BUNDLED_MODEL_DIR)
    if not os.path.isfile(os.path.join(target_path, "config.json")):
        raise SystemExit(f"--target-path {target_path!r} has no config.json")
    device = resolve_device(args.device)
    dtype = engine_dtype(device, args.dtype)
    hf_config = ModelConfig.from_path(target_path).hf_config
    draft_path = find_dspark_draft(target_path, args.draft_path)
    config = DSparkDraftConfig.from_path(draft_path, hf_config, args.block_size)
    if not config.enable_confidence_head:
        raise SystemExit(f"the draft {draft_path!r} has no confidence head "
                         "(enable_confidence_head is false): there is nothing to calibrate")

    seqs, embed, head = held_out_sequences(args, target_path, list(config.target_layer_ids),
                                           device, dtype)
    model = load_dspark_draft(draft_path, hf_config, dtype=torch.float32, device=device,
                              block_size=args.block_size)
    model.set_embed_and_head(embed.to(device), head.to(device))
    rounds = confidence_rounds(model, seqs, head.to(device))
    if rounds.accepted.numel() == 0:
        raise SystemExit("the held-out sequences gave no draft rounds; raise --max-new-tokens")
    temps = fit_sts(rounds.confidence_logits, rounds.accepted, rounds.verify_lens,
                    num_bins=args.num_bins)
    before = calibration_report(rounds.confidence_logits, rounds.accepted, rounds.verify_lens,
                                None, args.num_bins)
    after = calibration_report(rounds.confidence_logits, rounds.accepted, rounds.verify_lens,
                               temps, args.num_bins)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    save_sts_temperatures(args.output, temps)

    print(f"[sts] draft {draft_path}, gamma {model.gamma}: {rounds.accepted.numel()} rounds "
          f"over {len(seqs)} held-out sequences ({args.num_bins}-bin ECE of a_k)")
    _print_table(before, after, temps)
    result = {"output": args.output, "draft_path": draft_path, "gamma": model.gamma,
              "temperatures": temps, "sequences": len(seqs),
              "rounds": int(rounds.accepted.numel()), "before": before, "after": after,
              "mean_ece_before": _nanmean(before["ece"]),
              "mean_ece_after": _nanmean(after["ece"]),
              "seconds": time.perf_counter() - t0}
    print(f"[sts] mean ECE {result['mean_ece_before']:.4f} -> {result['mean_ece_after']:.4f}; "
          f"wrote {args.output} in {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
