"""Train a DSpark draft for a target: ``python -m sglang.train.dspark --target-path P
--output-dir D``. One command from the target checkpoint to a servable draft folder.

Phases (every step seeded):

1. **data** (:mod:`sglang.train.dspark_data`): prompts from the training corpus, continued by the
   target itself through ``sglang.Engine`` under each ``--sampling`` setting; held-out prompts
   (from the corpus' held-out files) continued greedily for the evaluation. The target's
   features of every sequence (outputs of the draft's ``target_layer_ids`` and the final hidden
   state) come from a prefill on the engine's model. ``--data-cache FILE`` keeps them for re-runs;
2. **train** (:mod:`sglang.train.dspark_blocks`, :mod:`sglang.train.dspark_losses`): random
   anchors in each generated sequence, context strictly before the anchor, teacher-forced
   Markov inputs; loss ``alpha_ce * CE + alpha_tv * L1 + alpha_conf * BCE + alpha_accept *
   L_accept`` with the position decay ``exp(-k / loss_decay_gamma)``; AdamW, warm-up + cosine
   on a progress clock (``max(step / steps, elapsed / --time-budget-s)``), so a run cut short
   by the budget still finishes its decay. The target, its embedding and LM head stay frozen;
3. **save**: ``config.json`` (DeepSpec layout, ``architectures = ["LingDSparkModel"]``) and
   ``model.safetensors`` (``--save-dtype``, bf16 by default), ``train_log.json``,
   ``loss_curve.png`` (when matplotlib is importable) and a ``README.md`` saying how the folder
   was made;
4. **eval** (:mod:`sglang.train.dspark_eval`): the saved folder is loaded back with
   ``load_dspark_draft`` and scored on the held-out sequences: greedy accept length (committed
   tokens per verify round), per-slot acceptance, confidence calibration (ECE); with
   ``--eval-served`` the saved draft is also served through ``sglang.Engine`` (DSPARK) and with
   ``--compare-nextn [STEPS ...]`` the target's NEXTN (MTP) layer at the same gamma, or at each
   number of chained drafts given.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from sglang.train.dspark_blocks import (BlockBatch, blocks_at, sample_blocks,
                                        teacher_forced_outputs)
from sglang.train.dspark_data import FeatureSequence, SamplingSetting, parse_sampling_settings
from sglang.train.dspark_losses import LossWeights, dspark_loss
from sglang.train.dspark_report import plot_losses, write_readme
from sglang.train.target import ProgressClock, lr_at

# Over this the draft folder would not be a small bundled asset (the bundled model and its
# draft stay within 48 MB together; the target's folder holds about 30 MB).
SIZE_LIMIT_BYTES = 12 * 10 ** 6


def draft_config(target: Any, *, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, block_size: int, markov_rank: int,
                 target_layer_ids: Sequence[int], mask_token_id: int, num_anchors: int,
                 dtype_name: str = "bfloat16") -> Dict[str, Any]:
    """The draft's config.json dict (DeepSpec layout) for ``target`` (a BailingMoeV3Config)."""
    return {
        "architectures": ["LingDSparkModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "num_target_layers": target.num_hidden_layers,
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
        "num_anchors": num_anchors,
        "markov_rank": markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "torch_dtype": dtype_name,
    }


def build_argparser() -> argparse.ArgumentParser:
    """Command-line options (defaults = the bundled draft's recipe)."""
    ap = argparse.ArgumentParser(prog="python -m sglang.train.dspark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-path", required=True, help="target checkpoint folder")
    ap.add_argument("--output-dir", required=True, help="where the draft folder is written")
    g = ap.add_argument_group("draft architecture")
    g.add_argument("--num-draft-layers", type=int, default=2)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--num-kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--intermediate-size", type=int, default=512)
    g.add_argument("--block-size", type=int, default=7, help="gamma: draft tokens per round")
    g.add_argument("--markov-rank", type=int, default=32)
    g.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                   help="target decoder layers feeding the draft (default: the DFlash rule, "
                        "one per draft layer, evenly spaced from 1 to L-3)")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's <|mask|> token")
    g = ap.add_argument_group("data")
    g.add_argument("--sampling", nargs="+", default=["greedy", "0.7:0.8", "1.0:0.95"],
                   help="generation settings: 'greedy' or TEMPERATURE[:TOP_P[:TOP_K]]")
    g.add_argument("--prompts-per-setting", type=int, default=128)
    g.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts (greedy)")
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-batch-size", type=int, default=32,
                   help="engine max_running_requests while generating")
    g.add_argument("--feature-batch-tokens", type=int, default=4096,
                   help="tokens per prefill when computing the target features")
    g.add_argument("--max-train-files", type=int, default=None,
                   help="draw prompts from a deterministic slice of the corpus (smoke tests)")
    g.add_argument("--data-cache", default=None,
                   help="torch file with the generated sequences and features: read when it "
                        "exists (and matches this run), written otherwise")
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=3000)
    g.add_argument("--time-budget-s", type=float, default=840.0,
                   help="wall-clock budget of the training phase")
    g.add_argument("--batch-seqs", type=int, default=4, help="sequences per step")
    g.add_argument("--anchors-per-seq", type=int, default=32)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=float, default=0.04)
    g.add_argument("--min-lr-ratio", type=float, default=0.05)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    # Defaults: LossWeights' (plain CE + the confidence BCE, the ablation's winner).
    g.add_argument("--alpha-ce", type=float, default=LossWeights.alpha_ce,
                   help="weight of the position-decayed cross-entropy")
    g.add_argument("--alpha-tv", type=float, default=LossWeights.alpha_tv,
                   help="weight of the L1 (total variation) term (DSpark's recipe: 0.9, with "
                        "--alpha-ce 0.1)")
    g.add_argument("--alpha-conf", type=float, default=LossWeights.alpha_conf,
                   help="weight of the confidence head's BCE")
    g.add_argument("--alpha-accept", type=float, default=LossWeights.alpha_accept,
                   help="weight of the acceptance-aware loss -E[accepted prefix] / gamma "
                        "(off by default: it lost to plain CE, docs/speculative_decoding.md)")
    g.add_argument("--loss-decay-gamma", type=float, default=4.0,
                   help="position weights exp(-k / this), 0-based slot k")
    g.add_argument("--eval-interval", type=int, default=25)
    g.add_argument("--eval-anchors", type=int, default=16,
                   help="anchors per held-out sequence in the periodic evaluation")
    g = ap.add_argument_group("output and evaluation")
    g.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    g.add_argument("--compare-nextn", type=int, nargs="*", default=None, metavar="STEPS",
                   help="also measure the target's NEXTN layer on the held-out prompts through "
                        "the engine: alone, with gamma chained MTP drafts per round; with "
                        "values, at each number of drafts given (e.g. 3 7)")
    g.add_argument("--eval-served", action="store_true",
                   help="also serve the saved draft (--speculative-algorithm DSPARK) through "
                        "the engine on the held-out prompts and record its accept length")
    g = ap.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto",
                   help="target dtype for generation and features (auto: float32 on CPU, the "
                        "checkpoint's dtype on CUDA)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of this process and of the engine's scheduler")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds every phase: the data (its cache records it) and the training")
    g.add_argument("--train-seed", type=int, default=None,
                   help="seed of the training phase alone (the draft's initialisation and its "
                        "batches; default --seed), so that runs over one data cache differ "
                        "only in it")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse nonsensical values with the flag's name."""
    positive = ("num_draft_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                "block_size", "markov_rank", "prompt_len", "max_new_tokens", "gen_batch_size",
                "feature_batch_tokens", "steps", "batch_seqs", "anchors_per_seq",
                "eval_interval", "eval_anchors", "prompts_per_setting")
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_prompts < 1:
        raise SystemExit("--eval-prompts must be >= 1 (the evaluation needs held-out data)")
    if args.max_new_tokens < 2:
        raise SystemExit("--max-new-tokens must be >= 2 (an anchor needs a label after it)")
    if not args.time_budget_s > 0:
        raise SystemExit("--time-budget-s must be > 0")
    if args.num_threads is not None and args.num_threads < 1:
        raise SystemExit("--num-threads must be >= 1")
    if args.compare_nextn and min(args.compare_nextn) < 1:
        raise SystemExit(f"--compare-nextn takes draft counts >= 1, got {args.compare_nextn}")
    if not 0 <= args.warmup < 1 or not 0 <= args.min_lr_ratio <= 1 or not args.lr > 0:
        raise SystemExit("--lr must be > 0, --warmup in [0, 1), --min-lr-ratio in [0, 1]")


def _engine_kwargs(args: argparse.Namespace, device: torch.device, dtype: str,
                   batch: Optional[int] = None) -> Dict[str, Any]:
    """The engines' flags: device, dtype, seed, threads; with ``batch`` also slots and a token
    pool for that many sequences of ``--prompt-len + --max-new-tokens``."""
    from sglang.train.dspark_eval import engine_base_kwargs

    kw = engine_base_kwargs(device.type, dtype, args.seed, args.num_threads)
    if batch is not None:
        kw.update(max_running_requests=batch,
                  max_total_tokens=batch * (args.prompt_len + args.max_new_tokens) + 64)
    return kw


def prepare_data(args: argparse.Namespace, tokenizer: Any, layer_ids: List[int],
                 device: torch.device, dtype: str, log: Dict[str, Any]) -> tuple:
    """(train sequences, held-out sequences, embed, head): from ``--data-cache`` or made now."""
    from sglang.train.data import load_corpus, slice_corpus
    from sglang.train.dspark_data import (TargetFeatureRunner, draw_prompts,
                                          generate_with_engine, load_feature_cache,
                                          save_feature_cache, target_fingerprint)

    settings = parse_sampling_settings(args.sampling)
    meta = {"target": target_fingerprint(args.target_path), "layer_ids": layer_ids,
            "sampling": [s.name for s in settings], "dtype": dtype,
            **{k: getattr(args, k) for k in ("prompts_per_setting", "eval_prompts",
                                             "prompt_len", "max_new_tokens", "max_train_files",
                                             "seed")}}

    def feature_runner() -> TargetFeatureRunner:
        # Built only once the engine is gone, so the two never hold the device together.
        return TargetFeatureRunner(args.target_path, layer_ids, device=device.type, dtype=dtype,
                                   max_batch_tokens=max(args.feature_batch_tokens,
                                                        args.prompt_len + args.max_new_tokens),
                                   seed=args.seed)

    t0 = time.perf_counter()
    if args.data_cache and Path(args.data_cache).is_file():
        train, held = load_feature_cache(args.data_cache, meta)
        embed, head = feature_runner().embed_and_head()
        log["data"] = {"cache": str(args.data_cache), "loaded": True, **meta}
        print(f"[dspark] data: {len(train)} train / {len(held)} held-out sequences from "
              f"{args.data_cache}")
        return train, held, embed, head
    corpus = load_corpus()
    if args.max_train_files is not None:
        corpus = slice_corpus(corpus, args.max_train_files, len(corpus.held_out))
    gen = torch.Generator().manual_seed(args.seed)
    n_train = args.prompts_per_setting * len(settings)
    prompts = draw_prompts(corpus.train_texts(), tokenizer, n_train, args.prompt_len, gen)
    prompts += draw_prompts(corpus.held_out_texts(), tokenizer, args.eval_prompts,
                            args.prompt_len, gen)
    per_prompt = [settings[i // args.prompts_per_setting] for i in range(n_train)]
    per_prompt += [SamplingSetting()] * args.eval_prompts
    print(f"[dspark] generating {len(prompts)} sequences x {args.max_new_tokens} tokens with "
          f"the engine ({', '.join(s.name for s in settings)}; held-out: greedy)", flush=True)
    outputs = generate_with_engine(args.target_path, prompts, per_prompt, args.max_new_tokens,
                                   args.seed, _engine_kwargs(args, device, dtype,
                                                             args.gen_batch_size))
    t_gen = time.perf_counter() - t0
    seqs = [p + o for p, o in zip(prompts, outputs)]
    print(f"[dspark] generated in {t_gen:.0f} s; target features of "
          f"{sum(map(len, seqs))} tokens", flush=True)
    features = feature_runner()
    embed, head = features.embed_and_head()
    feats = features.features(seqs)
    del features  # its KV pool is not needed for training
    all_seqs = [FeatureSequence(torch.tensor(s, dtype=torch.long), len(p), st.name, a, f)
                for s, p, st, (a, f) in zip(seqs, prompts, per_prompt, feats)]
    train, held = all_seqs[:n_train], all_seqs[n_train:]
    if args.data_cache:
        save_feature_cache(args.data_cache, meta, train, held)
    log["data"] = {"cache": args.data_cache, "loaded": False, "generate_seconds": t_gen,
                   "feature_seconds": time.perf_counter() - t0 - t_gen,
                   "train_tokens": sum(int(s.tokens.numel()) for s in train),
                   "train_generated_tokens": sum(s.num_generated for s in train),
                   "held_out_generated_tokens": sum(s.num_generated for s in held),
                   "corpus_train_files": len(corpus.train), **meta}
    return train, held, embed, head


def heldout_blocks(held: Sequence[FeatureSequence], per_seq: int, gamma: int) -> BlockBatch:
    """A fixed block batch of the held-out sequences (evenly spaced anchors) for periodic
    evaluation during training."""
    anchors = []
    for s in held:
        lo, hi = s.prompt_len, int(s.tokens.numel()) - 1
        n = min(per_seq, hi - lo)
        anchors.append(sorted({lo + (i * (hi - lo)) // max(n, 1) for i in range(n)}))
    return blocks_at(held, anchors, gamma)


@torch.no_grad()
def periodic_eval(draft: Any, batch: BlockBatch, embed: torch.Tensor, head: torch.Tensor,
                  weights: LossWeights) -> Dict[str, Any]:
    """Held-out loss terms and the greedy accept length over the batch's anchors.

    On greedy data the teacher-forced Markov inputs equal the drafts wherever the earlier drafts
    were accepted, so the teacher-forced argmax matches give the exact greedy accepted count."""
    was = draft.training
    draft.eval()
    logits, target, conf = teacher_forced_outputs(draft, batch, embed, head)
    labels, valid = batch.labels.to(logits.device), batch.valid.to(logits.device)
    terms = dspark_loss(logits, target, labels, valid, conf, weights)
    match = (logits.argmax(-1) == target.argmax(-1)) & valid
    accepted = torch.cumprod(match.long(), dim=-1).sum(-1)
    has = valid.any(-1)
    draft.train(was)
    return {"loss": float(terms["loss"]), "ce": float(terms["ce"]), "tv": float(terms["tv"]),
            "conf": float(terms["conf"]), "tau_sampling": float(terms["tau"]),
            "accept_length": float(1 + accepted[has].float().mean())}


def train_draft(args: argparse.Namespace, config: Dict[str, Any],
                train: Sequence[FeatureSequence], held: Sequence[FeatureSequence],
                embed: torch.Tensor, head: torch.Tensor, device: torch.device) -> tuple:
    """The training phase; returns ``(draft, log)``."""
    from sglang.train.reference_dspark import ReferenceDSparkDraft

    usable = [s for s in train if s.num_generated >= 2]
    if not usable:
        raise SystemExit("no training sequence has two generated tokens; raise --max-new-tokens")
    train_seed = args.seed if args.train_seed is None else args.train_seed
    draft = ReferenceDSparkDraft(config, seed=train_seed).to(device)
    with torch.no_grad():
        # The Markov head starts neutral (bias 0): the backbone alone gives the first drafts.
        draft.markov_head.markov_w2.weight.zero_()
    draft.train()
    weights = LossWeights(args.alpha_ce, args.alpha_tv, args.alpha_conf, args.alpha_accept,
                          args.loss_decay_gamma)
    gamma = draft.config.gamma
    embed, head = embed.to(device), head.to(device)
    params = list(draft.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay, fused=device.type == "cuda")
    eval_batch = heldout_blocks(held, args.eval_anchors, gamma)
    gen = torch.Generator().manual_seed(train_seed + 1)
    clock = ProgressClock(args.steps, args.time_budget_s)
    keys = ("loss", "ce", "tv", "conf", "accept", "tau")
    log: Dict[str, Any] = {"steps": [], "lr": [], "eval": [], **{k: [] for k in keys}}
    order: List[int] = []
    step = blocks = 0
    while step == 0 or clock.progress(step) < 1.0:
        lr = lr_at(clock.progress(step), args.lr, args.warmup, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        if len(order) < args.batch_seqs:  # a fresh shuffle per epoch
            order += torch.randperm(len(usable), generator=gen).tolist()
        picked, order = order[:args.batch_seqs], order[args.batch_seqs:]
        batch = sample_blocks([usable[i] for i in picked], args.anchors_per_seq, gamma, gen)
        logits, target, conf = teacher_forced_outputs(draft, batch, embed, head)
        terms = dspark_loss(logits, target, batch.labels.to(device), batch.valid.to(device),
                            conf, weights)
        if not torch.isfinite(terms["loss"]):
            raise FloatingPointError(f"DSpark loss became {float(terms['loss'])} at step {step}")
        opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        step += 1
        blocks += batch.num_blocks
        log["steps"].append(step)
        log["lr"].append(lr)
        for k in keys:
            log[k].append(float(terms[k].detach()))
        done = clock.progress(step) >= 1.0
        if step % args.eval_interval == 0 or done or step == 1:
            ev = dict(step=step, seconds=clock.elapsed(),
                      **periodic_eval(draft, eval_batch, embed, head, weights))
            log["eval"].append(ev)
            print(f"[dspark] step {step} ({clock.elapsed():.0f} s) loss {terms['loss']:.4f} "
                  f"held-out: tv {ev['tv']:.3f} accept length {ev['accept_length']:.3f} "
                  f"tau(T=1) {ev['tau_sampling']:.3f}", flush=True)
    log.update(num_steps=step, blocks=blocks, seconds=clock.elapsed(),
               stopped_by="time" if step < args.steps else "steps",
               final_alpha=[float(x) for x in terms["alpha"]])
    return draft, log


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the whole pipeline; returns the log (also written to ``OUTPUT_DIR/train_log.json``)."""
    from sglang.srt.configs.dspark import DSparkDraftConfig, default_target_layer_ids
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.train.dspark_eval import (dspark_spec_kwargs, evaluate_folder,
                                          nextn_spec_kwargs, serve_held_out)
    from sglang.train.eval import engine_dtype, resolve_device
    from sglang.train.tokenizer import MASK_TOKEN, load_tokenizer

    args = build_argparser().parse_args(argv)
    check_args(args)
    t_start = time.perf_counter()
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    dtype = engine_dtype(device, args.dtype)
    if not Path(args.target_path, "config.json").is_file():
        raise SystemExit(f"--target-path {args.target_path!r} has no config.json")
    hf_config = ModelConfig.from_path(args.target_path).hf_config
    tokenizer = load_tokenizer(args.target_path)
    mask = args.mask_token_id if args.mask_token_id is not None else tokenizer.token_to_id(
        MASK_TOKEN)
    if mask is None:
        raise SystemExit(f"the target's tokenizer has no {MASK_TOKEN} token; pass "
                         "--mask-token-id")
    layer_ids = (list(args.target_layer_ids) if args.target_layer_ids is not None else
                 default_target_layer_ids(hf_config.num_hidden_layers, args.num_draft_layers))
    config = draft_config(hf_config, num_layers=args.num_draft_layers, num_heads=args.num_heads,
                          num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                          intermediate_size=args.intermediate_size, block_size=args.block_size,
                          markov_rank=args.markov_rank, target_layer_ids=layer_ids,
                          mask_token_id=mask, num_anchors=args.anchors_per_seq,
                          dtype_name=args.save_dtype)
    DSparkDraftConfig.from_dict(config, hf_config)  # refuses a bad choice before any work
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--output-dir {args.output_dir!r} exists and is not a folder")
    log: Dict[str, Any] = {"command": "python -m sglang.train.dspark " + " ".join(
        sys.argv[1:] if argv is None else list(argv)), "args": vars(args), "config": config,
        "device": str(device), "torch": torch.__version__, "python": platform.python_version()}

    train, held, embed, head = prepare_data(args, tokenizer, layer_ids, device, dtype, log)
    draft, log["train"] = train_draft(args, config, train, held, embed, head, device)
    save_dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    draft.save_pretrained(str(out), dtype=save_dtype)  # creates the folder
    log["parameters"] = sum(p.numel() for p in draft.parameters())

    # The saved folder, loaded with the serving loader, scored on the held-out data.
    log["eval"] = evaluate_folder(str(out), hf_config, held, embed, head, device)
    spec_runs = []
    gamma = draft.config.gamma
    if args.compare_nextn is not None:  # the log's key: "nextn" at gamma, "nextn<N>" else
        for steps in dict.fromkeys(args.compare_nextn or [gamma]):
            spec_runs.append(("nextn" if steps == gamma else f"nextn{steps}",
                              nextn_spec_kwargs(steps)))
    if args.eval_served:
        spec_runs.append(("served", dspark_spec_kwargs(str(out))))
    drafts = max([gamma] + [spec.get("speculative_num_steps", 0) for _, spec in spec_runs])
    log["eval"].update(serve_held_out(args.target_path, held, spec_runs,
                                      _engine_kwargs(args, device, dtype), 2 * drafts + 2))
    ev = log["eval"]
    log["plot"] = "loss_curve.png" if plot_losses(log, out / "loss_curve.png") else None
    log["total_seconds"] = time.perf_counter() - t_start
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_readme(out / "README.md", log)
    log["folder_bytes"] = _dir_bytes(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    extra = "".join(f", {key} {ev[key]['accept_length']:.3f}" for key, _ in spec_runs)
    print(f"[dspark] done in {log['total_seconds']:.0f} s: held-out greedy accept length "
          f"{ev['accept_length']:.3f} (gamma {ev['gamma']}){extra}"
          + (f", mean ECE {ev['mean_ece']:.3f}" if not math.isnan(ev.get("mean_ece", math.nan))
             else "") + f"; folder {log['folder_bytes'] / 1e6:.1f} MB in {out}")
    if log["folder_bytes"] > SIZE_LIMIT_BYTES:
        print(f"[dspark] WARNING: {out} holds {log['folder_bytes'] / 1e6:.1f} MB, over "
              f"{SIZE_LIMIT_BYTES / 1e6:.0f} MB", file=sys.stderr)
    return log


if __name__ == "__main__":
    main()
