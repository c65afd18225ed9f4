"""Retrain the MTP (NextN) layer of a BailingMoeV3 checkpoint with an acceptance-aware loss:
``python -m sglang.train.mtp --model-path P --output-dir D``.

The folder ``P`` is copied to ``D`` and only ``model.layers.{N}`` (the MTP block) trains; the
target stays frozen, so ``D`` serves exactly the target of ``P`` with another draft layer.

* **Data**: the training corpus of the bundled model (:mod:`sglang.train.data`: the standard
  library sources, tokenized with ``P``'s tokenizer, packed into windows of ``--seq-len``); the
  held-out files give the evaluation windows and prompts.
* **Loss**: the MTP phase's loss of :mod:`sglang.train.target` (:func:`mtp_distill_loss`:
  CE on ``x_{t+2}`` mixed with KL to the target's distribution, over every pair
  ``(h_t, x_{t+1})``) plus ``--alpha-accept`` times the acceptance-aware loss of
  :mod:`sglang.train.dspark_losses` over a ``--chain K`` step MTP chain. At an anchor ``t`` the
  chain runs as NEXTN drafts: step 1 reads ``(h_t, x_{t+1})``; step ``k > 1`` reads
  ``(g_{k-1}, x_{t+k})`` at position ``t + k - 1``, where ``g`` is the previous step's output
  (``final_layernorm``) and the token is teacher-forced. Its attention sees the MTP keys of the
  positions ``<= t`` computed from the target's real hidden states (the cache a NEXTN round
  drafts on) and the keys of the anchor's own earlier chain steps. ``alpha_k = 1 - 0.5 *
  ||p_mtp,k - p_target||_1`` with the target's distribution at ``t + k``; the loss is
  ``-sum_k prod_{i<=k} alpha_i / K`` (:func:`acceptance_loss`), averaged over
  ``--chain-anchors`` random anchors per window. With ``--alpha-accept 0`` the chain is not
  run and the loss is the MTP phase's loss exactly.
* **Schedule**: :func:`sglang.train.target.run_phase` (AdamW, warm-up + cosine on the progress
  clock ``max(step / --steps, elapsed / --time-budget-s)``, aux-loss-free balancing of the MTP
  layer's experts). ``--init checkpoint`` continues from ``P``'s MTP weights, ``fresh``
  re-initialises them. ``--steps 0`` copies ``P`` unchanged (a baseline for the evaluation).
* **Evaluation** (``D/mtp_train_log.json``): the teacher-forced chain on held-out windows
  before and after training (:func:`chain_eval`), and the NEXTN accept length of ``D`` served by
  ``sglang.Engine`` on held-out greedy prompts (:func:`nextn_accept_length`).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from sglang.train.dspark_losses import expected_accept_length
from sglang.train.mtp_chain import (RealPass, chain_alpha, chain_target_logits,
                                    mtp_accept_loss, mtp_chain, mtp_real_pass, sample_anchors)

__all__ = ["RealPass", "mtp_real_pass", "mtp_chain", "chain_target_logits", "chain_alpha",
           "sample_anchors", "mtp_accept_loss", "chain_eval", "nextn_accept_length",
           "build_argparser", "main"]

LOG_NAME = "mtp_train_log.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# ------------------------------------------------------------------ evaluation
@torch.no_grad()
def chain_eval(model: Any, stream: torch.Tensor, seq_len: int, windows: int, chain: int,
               batch_size: int, device: torch.device) -> Dict[str, Any]:
    """The teacher-forced chain at every anchor of the first ``windows`` windows of ``stream``.

    Per step: mean ``alpha`` and greedy agreement (MTP argmax = target argmax); per anchor whose
    whole chain is valid: the greedy accepted prefix (``greedy_accept_length`` = 1 + its mean,
    the tokens a greedy round would commit on this text) and ``expected_accept_length``
    (``1 + sum_k prod_{i<=k} alpha_i``, the same under speculative sampling at T = 1)."""
    from sglang.train.data import PackedSequences
    from sglang.train.eval import autocast_for

    data = PackedSequences(stream, seq_len)
    n_win = min(windows, data.num_sequences)
    was_training = model.training
    model.eval()
    alpha_sum = torch.zeros(chain, dtype=torch.float64)
    agree_sum = torch.zeros(chain, dtype=torch.float64)
    slots = torch.zeros(chain, dtype=torch.float64)
    greedy = expected = 0.0
    full = 0
    for start in range(0, n_win, batch_size):
        w = data.window(torch.arange(start, min(start + batch_size, n_win))).to(device)
        with autocast_for(device):
            logits, hidden = model(w[:, :-1])
            real = mtp_real_pass(model, hidden[:, :seq_len - 1], w[:, 1:seq_len])
            anchors = sample_anchors(w.shape[0], seq_len - 1, 0).to(device)
            draft, valid = mtp_chain(model, real, w[:, :-1], anchors, chain)
        target = chain_target_logits(logits, anchors, chain)
        alpha = chain_alpha(draft, target)
        match = (draft.argmax(-1) == target.argmax(-1)) & valid
        v = valid.flatten(0, 1).double().cpu()
        alpha_sum += (alpha.flatten(0, 1).double().cpu() * v).sum(0)
        agree_sum += match.flatten(0, 1).double().cpu().sum(0)
        slots += v.sum(0)
        whole = valid.all(-1)
        full += int(whole.sum())
        greedy += float(torch.cumprod(match.long(), dim=-1).sum(-1)[whole].sum())
        expected += float(expected_accept_length(alpha, valid)[whole].sum())
    model.pop_expert_counts()  # evaluation must not steer the expert balancing
    model.train(was_training)
    per = slots.clamp_min(1)
    return {"windows": n_win, "anchors": full, "chain": chain,
            "alpha": (alpha_sum / per).tolist(), "agreement": (agree_sum / per).tolist(),
            "greedy_accept_length": 1 + greedy / max(full, 1),
            "expected_accept_length": 1 + expected / max(full, 1)}


def nextn_accept_length(model_path: str, prompts: Sequence[List[int]], max_new_tokens: int,
                        gamma: int, device: torch.device, num_threads: Optional[int],
                        seed: int) -> Dict[str, Any]:
    """NEXTN with ``gamma`` chained drafts through ``sglang.Engine`` on ``prompts`` (greedy):
    the server-wide accept length (committed tokens per verify round)."""
    from sglang.train.dspark_eval import engine_accept_length, nextn_spec_kwargs
    from sglang.train.eval import engine_dtype

    batch = max(1, min(len(prompts), 16))
    per_req = max(map(len, prompts), default=0) + max_new_tokens + 2 * gamma + 2
    kw: Dict[str, Any] = dict(device=device.type,
                              dtype=engine_dtype(device),
                              random_seed=seed, max_running_requests=batch,
                              max_total_tokens=batch * per_req + 64, log_level="warning")
    if num_threads is not None:
        kw["cpu_num_threads"] = num_threads
    return engine_accept_length(model_path, prompts, max_new_tokens, nextn_spec_kwargs(gamma), kw)


# ------------------------------------------------------------------ the folder
def check_output_dir(src: Path, dst: Path) -> None:
    """Refuse an output folder that overlaps the source (the source is never overwritten) or
    is a file."""
    a, b = src.resolve(), dst.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise SystemExit(f"--output-dir {str(dst)!r} and --model-path {str(src)!r} overlap; "
                         "the output must be a separate folder")
    if dst.exists() and not dst.is_dir():
        raise SystemExit(f"--output-dir {str(dst)!r} exists and is not a folder")


def copy_model_folder(src: Path, dst: Path) -> None:
    """Copy ``src`` into ``dst`` except the weight files (written after training) and an old
    retraining log."""
    from sglang.train.reference_io import INDEX_FILE

    check_output_dir(src, dst)
    a = src.resolve()

    def skip(folder: str, names: List[str]) -> List[str]:
        if Path(folder).resolve() != a:
            return []
        return [n for n in names if n.endswith(".safetensors") or n in (INDEX_FILE, LOG_NAME)]

    shutil.copytree(src, dst, ignore=skip, dirs_exist_ok=True)


def _save_dtype(config: Dict[str, Any]) -> torch.dtype:
    name = config.get("torch_dtype") or "bfloat16"  # the checkpoint's own dtype
    if name not in _DTYPES:
        raise SystemExit(f"config.json torch_dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


# ------------------------------------------------------------------ command line
def build_argparser() -> argparse.ArgumentParser:
    """Command-line options (defaults: a fine-tune of the bundled model's MTP layer)."""
    ap = argparse.ArgumentParser(prog="python -m sglang.train.mtp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="checkpoint folder with an MTP layer")
    ap.add_argument("--output-dir", required=True, help="the retrained, servable copy")
    g = ap.add_argument_group("loss")
    g.add_argument("--alpha-accept", type=float, default=3.0,
                   help="weight of the acceptance-aware chain loss (0: the MTP phase's loss)")
    g.add_argument("--chain", type=int, default=3, help="K: chained MTP steps per anchor")
    g.add_argument("--chain-anchors", type=int, default=64,
                   help="anchors per window for the chain loss (0: every position)")
    g.add_argument("--mtp-distill", type=float, default=0.5,
                   help="weight of KL(target || mtp) in the MTP loss (rest: CE on x_{t+2})")
    g = ap.add_argument_group("training")
    g.add_argument("--init", choices=("checkpoint", "fresh"), default="checkpoint",
                   help="start from the checkpoint's MTP weights or a fresh initialisation")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps (0: copy only)")
    g.add_argument("--time-budget-s", type=float, default=600.0,
                   help="wall-clock budget of the training phase")
    g.add_argument("--batch-size", type=int, default=4)
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 2e-4 from the checkpoint, the rate the "
                        "bundled MTP phase ended at; 2e-3 fresh, its peak)")
    g.add_argument("--warmup", type=float, default=0.05)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--bias-rate", type=float, default=1e-3,
                   help="aux-loss-free balancing step of the MTP layer's experts")
    g.add_argument("--max-train-files", type=int, default=None,
                   help="train on a deterministic slice of the corpus (smoke tests)")
    g = ap.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-windows", type=int, default=16, help="held-out windows scored")
    g.add_argument("--eval-prompts", type=int, default=32,
                   help="held-out prompts for the NEXTN engine run (0: skip it)")
    g.add_argument("--eval-prompt-len", type=int, default=64)
    g.add_argument("--eval-max-new-tokens", type=int, default=128)
    g.add_argument("--eval-gamma", type=int, default=None,
                   help="NEXTN drafts per round in the engine run (default: --chain)")
    g.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out prompts")
    g = ap.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of this process and of the engine's scheduler")
    g.add_argument("--kda-mode", default="auto", choices=("auto", "chunk", "fla"))
    g.add_argument("--seed", type=int, default=0)
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse nonsensical values with the flag's name."""
    for name in ("chain", "batch_size", "eval_interval", "eval_windows", "eval_prompt_len",
                 "eval_max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len < 2:
        raise SystemExit("--seq-len must be >= 2 (an MTP pair needs two tokens and a label)")
    for name in ("steps", "chain_anchors", "eval_prompts"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0")
    if not (math.isfinite(args.alpha_accept) and args.alpha_accept >= 0):
        raise SystemExit("--alpha-accept must be a finite number >= 0")
    if not 0 <= args.mtp_distill <= 1:
        raise SystemExit("--mtp-distill must be in [0, 1]")
    if not args.time_budget_s > 0 or (args.lr is not None and not args.lr > 0):
        raise SystemExit("--time-budget-s and --lr must be > 0")
    if not 0 <= args.warmup < 1 or not 0 <= args.min_lr_ratio <= 1:
        raise SystemExit("--warmup must be in [0, 1), --min-lr-ratio in [0, 1]")
    for name in ("eval_gamma", "num_threads"):  # optional ones
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")


def _load(args: argparse.Namespace, device: torch.device) -> Any:
    """The checkpoint as a fp32 reference model, with ``--init`` applied to its MTP layer."""
    from sglang.train.reference import ReferenceBailingMoeV3

    src = Path(args.model_path)
    if not (src / "config.json").is_file():
        raise SystemExit(f"--model-path {args.model_path!r} has no config.json")
    model = ReferenceBailingMoeV3.from_pretrained(str(src), dtype=torch.float32, device=device,
                                                  kda_mode="chunk")
    if model.config.num_nextn_predict_layers < 1:
        raise SystemExit(f"{args.model_path!r} has no MTP layer (num_nextn_predict_layers = 0)")
    if args.init == "fresh":
        fresh = ReferenceBailingMoeV3(model.config_dict, seed=args.seed)
        model.mtp_layer.load_state_dict(fresh.mtp_layer.state_dict())
    return model


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Copy, retrain, save and evaluate; returns the log (``OUTPUT_DIR/mtp_train_log.json``)."""
    from sglang.train.data import (PackedSequences, corpus_fingerprint, load_corpus,
                                   pack_token_stream, slice_corpus)
    from sglang.train.dspark_data import draw_prompts, target_fingerprint
    from sglang.train.eval import resolve_device
    from sglang.train.target import pick_kda_mode, run_phase
    from sglang.train.tokenizer import EOT_TOKEN, encode_batch, load_tokenizer

    args = build_argparser().parse_args(argv)
    check_args(args)
    t_start = time.perf_counter()
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    src, out = Path(args.model_path), Path(args.output_dir)
    check_output_dir(src, out)
    model = _load(args, device)
    tok = load_tokenizer(src)
    eos = tok.token_to_id(EOT_TOKEN)
    if eos is None:
        raise SystemExit(f"the tokenizer of {args.model_path!r} has no {EOT_TOKEN} token")
    corpus = load_corpus()
    fingerprint = corpus_fingerprint(corpus)
    if args.max_train_files is not None:
        corpus = slice_corpus(corpus, args.max_train_files, len(corpus.held_out))
    train_stream = pack_token_stream(encode_batch(tok, corpus.train_texts()), eos)
    held_stream = pack_token_stream(encode_batch(tok, corpus.held_out_texts()), eos)
    lr = args.lr if args.lr is not None else (2e-4 if args.init == "checkpoint" else 2e-3)
    mtp_layer = model.config.num_hidden_layers
    prefix = f"model.layers.{mtp_layer}."
    cmd = " ".join(sys.argv[1:] if argv is None else list(argv))
    log: Dict[str, Any] = {
        "command": f"python -m sglang.train.mtp {cmd}", "args": {**vars(args), "lr": lr},
        "source": {"path": str(src), "fingerprint": target_fingerprint(str(src))},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "corpus": {"fingerprint": fingerprint, "train_files": len(corpus.train),
                   "train_tokens": int(train_stream.numel()),
                   "held_out_tokens": int(held_stream.numel())}}
    print(f"[mtp] {args.model_path} -> {args.output_dir}: corpus {train_stream.numel()} train / "
          f"{held_stream.numel()} held-out tokens; device {device}", flush=True)

    def chain_report(when: str) -> None:
        ev = chain_eval(model, held_stream, args.seq_len, args.eval_windows, args.chain,
                        args.batch_size, device)
        log[f"heldout_chain_{when}"] = ev
        print(f"[mtp] held-out chain ({when}): greedy accept length "
              f"{ev['greedy_accept_length']:.3f}, expected {ev['expected_accept_length']:.3f}, "
              f"agreement {', '.join(f'{a:.3f}' for a in ev['agreement'])}", flush=True)

    chain_report("before")
    if args.steps > 0:
        model.kda_mode = (pick_kda_mode(model, device, model.config.vocab_size, args.seq_len)
                          if args.kda_mode == "auto" else args.kda_mode)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(prefix))  # the target stays frozen
        params = [(n, p) for n, p in model.named_parameters() if n.startswith(prefix)]
        gen = torch.Generator().manual_seed(args.seed + 2)
        terms_log: Dict[str, List[float]] = {"mtp": [], "accept": [], "expected_accept": []}

        def loss_fn(batch: torch.Tensor) -> torch.Tensor:
            terms = mtp_accept_loss(model, batch, args.mtp_distill, args.alpha_accept,
                                    args.chain, args.chain_anchors, gen)
            for key, values in terms_log.items():
                if key in terms:
                    values.append(float(terms[key].detach()))
            return terms["loss"]

        phase = run_phase("mtp", model, loss_fn, params,
                          PackedSequences(train_stream, args.seq_len), held_stream, args,
                          args.steps, args.time_budget_s, lr, {mtp_layer}, device)
        log["train"] = {**phase, **{k: v for k, v in terms_log.items() if v},
                        "kda_mode": model.kda_mode}
        chain_report("after")
    else:
        log["train"] = {"num_steps": 0, "seconds": 0.0}
    copy_model_folder(src, out)
    model.save_pretrained(str(out), dtype=_save_dtype(model.config_dict))

    gamma = args.eval_gamma or args.chain
    if args.eval_prompts > 0:
        prompts = draw_prompts(corpus.held_out_texts(), tok, args.eval_prompts,
                               args.eval_prompt_len, torch.Generator().manual_seed(args.eval_seed))
        print(f"[mtp] NEXTN-{gamma} through the engine: {len(prompts)} held-out prompts x "
              f"{args.eval_max_new_tokens} tokens", flush=True)
        log["nextn"] = nextn_accept_length(str(out), prompts, args.eval_max_new_tokens, gamma,
                                           device, args.num_threads, args.seed)
    log["total_seconds"] = time.perf_counter() - t_start
    (out / LOG_NAME).write_text(json.dumps(log, indent=1) + "\n")
    nextn = f", NEXTN-{gamma} accept length {log['nextn']['accept_length']:.3f}" \
        if "nextn" in log else ""
    print(f"[mtp] done in {log['total_seconds']:.0f} s ({log['train']['num_steps']} steps){nextn}"
          f"; saved {out}", flush=True)
    return log


if __name__ == "__main__":
    main()
