"""Train the bundled tiny BailingMoeV3 and its MTP layer.

Usage: ``python -m sglang.train.target --out DIR`` (see ``docs/bundled_model.md``).

Pipeline (every step seeded):

1. corpus = the running Python's stdlib sources (:mod:`sglang.train.data`), byte-level BPE
   tokenizer trained on the train split (:mod:`sglang.train.tokenizer`);
2. **target phase**: the reference model (:class:`ReferenceBailingMoeV3`) learns next-token
   prediction with AdamW and a warm-up + cosine learning rate; MoE balance is aux-loss-free: after
   each step every router's ``expert_bias`` moves by ``bias_rate * sign(mean_load - load)``;
3. **MTP phase** (sequential, not joint, so the target is exactly what phase 2 left): the target is
   frozen, only ``model.layers.{N}`` (the MTP block) trains. At position t it reads
   ``(h_t, x_{t+1})`` (docs/model.md §6.1) and predicts ``x_{t+2}``; the loss mixes cross-entropy on
   the true ``x_{t+2}`` (the Bailing recipe) with KL to the target's own distribution at t+1
   (weight ``--mtp-distill``), because drafts are accepted when they match the target.

Both phases follow a *progress clock*: progress = max(step / steps, elapsed / time share), so a
run cut short by ``--time-budget-s`` still completes its cosine decay and saves normally.
Outputs (``--out``): config.json, model.safetensors (bf16), generation_config.json, tokenizer
files, train_log.json, loss_curve.png (when matplotlib is importable).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from sglang.train.data import (PackedSequences, corpus_fingerprint, infinite_batches,
                               load_corpus, pack_token_stream, slice_corpus)
from sglang.train.eval import autocast_for, resolve_device, score_stream
from sglang.train.tokenizer import (EOT_TOKEN, MAX_VOCAB, PAD_TOKEN, encode_batch,
                                    save_tokenizer, train_tokenizer)

# The bf16 checkpoint plus tokenizer must stay under 32 MB (it lives in git).
SIZE_LIMIT_BYTES = 32 * 10 ** 6


def tiny_config(vocab_size: int, eos_token_id: int, pad_token_id: int, hidden_size: int = 256,
                num_layers: int = 6, layer_group_size: int = 6, num_heads: int = 4,
                head_dim: int = 64, num_experts: int = 16, top_k: int = 4,
                moe_intermediate_size: int = 96, intermediate_size: int = 512,
                max_position_embeddings: int = 4096) -> Dict[str, Any]:
    """config.json of the bundled model: Ling-3.0 field names, shrunk.

    Defaults: 6 layers = 5 KDA + 1 MLA (layer 5), layer 0 dense, 16 routed experts (4 groups,
    top-2 groups, top-4 experts) + 1 shared, q_lora_rank null as in Flash; about 14.5 M
    parameters = 29 MB in bf16.
    """
    return {
        "architectures": ["BailingMoeV3ForCausalLM"],
        "model_type": "bailing_hybrid",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "layer_group_size": layer_group_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": head_dim,
        "short_conv_kernel_size": 4,
        "no_kda_lora": True,
        "kda_safe_gate": True,
        "kda_lower_bound": -5.0,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "qk_head_dim": 48,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
        "rope_interleave": True,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "gated_attention_proj_granularity_type": "head_wise",
        "intermediate_size": intermediate_size,
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "num_shared_experts": 1,
        "moe_intermediate_size": moe_intermediate_size,
        "moe_shared_expert_intermediate_size": moe_intermediate_size,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_qkv_bias": False,
        "use_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": "bfloat16",
    }


class ProgressClock:
    """Fraction done of a phase: the larger of the step fraction and the time fraction."""

    def __init__(self, steps: int, seconds: float) -> None:
        self.steps, self.seconds = steps, max(seconds, 1e-9)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def progress(self, step: int) -> float:
        return min(1.0, max(step / self.steps, self.elapsed() / self.seconds))


def lr_at(progress: float, peak: float, warmup: float, min_ratio: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine down to ``min_ratio*peak``."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    x = (progress - warmup) / max(1.0 - warmup, 1e-9)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(x, 1.0))))


def make_optimizer(params: Sequence[tuple], lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not embeddings, norms, gate scalars)."""
    decay = [p for n, p in params if p.ndim >= 2 and "embeddings" not in n]
    rest = [p for n, p in params if not (p.ndim >= 2 and "embeddings" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def target_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a ``[B, T + 1]`` batch."""
    logits, _ = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def mtp_loss(model: torch.nn.Module, batch: torch.Tensor, distill: float) -> torch.Tensor:
    """MTP loss on ``[B, T + 1]``: pairs ``(h_t, x_{t+1})`` for t < T-1 predict ``x_{t+2}``.

    ``(1 - distill) * CE(x_{t+2}) + distill * KL(target(. | x_{<=t+1}) || mtp)``; the target runs
    without gradients (it is frozen in this phase).
    """
    t = batch.shape[1] - 1
    with torch.no_grad():
        logits, hidden = model(batch[:, :-1])
    mtp_logits, _ = model.mtp_forward(hidden[:, :t - 1], batch[:, 1:t])
    return mtp_distill_loss(mtp_logits, logits[:, 1:t], batch[:, 2:], distill)


def mtp_distill_loss(mtp_logits: torch.Tensor, target_logits: torch.Tensor,
                     labels: torch.Tensor, distill: float) -> torch.Tensor:
    """The terms of :func:`mtp_loss` from its tensors: ``mtp_logits, target_logits [B, T', V]``
    (the MTP's and the target's distributions of the same next token) and ``labels [B, T']``
    (the true tokens): ``(1 - distill) * CE + distill * KL(target || mtp)``."""
    logq = F.log_softmax(mtp_logits.float(), dim=-1).flatten(0, 1)
    loss = (1 - distill) * F.nll_loss(logq, labels.flatten())
    if distill > 0:
        logp = F.log_softmax(target_logits.float(), dim=-1).flatten(0, 1)
        loss = loss + distill * F.kl_div(logq, logp, log_target=True, reduction="batchmean")
    return loss


def pick_kda_mode(model: torch.nn.Module, device: torch.device, vocab: int, seq_len: int) -> str:
    """``fla`` when fla-core's ``chunk_kda`` imports *and* survives a forward+backward of one
    training-length sequence on this device, otherwise the chunked plain-torch form (``chunk``)."""
    from sglang.train.reference_kda import fla_available

    if not fla_available(device):
        return "chunk"
    model.kda_mode = "fla"
    try:
        probe = torch.randint(0, vocab, (1, seq_len + 1), device=device)
        with autocast_for(device):
            target_loss(model, probe).backward()
        return "fla"
    except Exception as exc:  # any failure of an optional kernel means: use plain torch
        print(f"[train] fla chunk_kda unusable ({type(exc).__name__}: {exc}); using 'chunk'")
        return "chunk"
    finally:
        model.zero_grad(set_to_none=True)
        model.pop_expert_counts()


def _progress_bar(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)
    except ImportError:  # tqdm is optional: a plain line every 50 steps instead
        class _Plain:
            n = 0

            def update(self, k: int) -> None:
                self.n += k

            def set_postfix(self, d: Dict[str, Any]) -> None:
                if self.n % 50 == 0:
                    print(f"{desc} {self.n}/{total} {d}", flush=True)

            def close(self) -> None:
                pass

        return _Plain()


def run_phase(name: str, model: torch.nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor],
              params: List[tuple], data: PackedSequences, held: torch.Tensor,
              args: argparse.Namespace, steps: int, seconds: float, peak_lr: float,
              balance_layers: Optional[set], device: torch.device) -> Dict[str, Any]:
    """One training phase; returns its log (per-step losses, held-out evals, timing)."""
    opt = make_optimizer(params, peak_lr, args.weight_decay, device)
    trainable = [p for _, p in params]
    clock = ProgressClock(steps, seconds)
    batches = infinite_batches(data, args.batch_size, args.seed + (0 if name == "target" else 1))
    log: Dict[str, Any] = {"steps": [], "loss": [], "lr": [], "eval": [], "max_load_ratio": []}
    bar = _progress_bar(steps, name)
    step, tokens = 0, 0
    model.pop_expert_counts()
    while step == 0 or clock.progress(step) < 1.0:  # at least one step, so there is a log
        lr = lr_at(clock.progress(step), peak_lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next(batches).to(device, non_blocking=True)
        with autocast_for(device):
            loss = loss_fn(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name} loss became {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, args.grad_clip)
        opt.step()
        counts = model.pop_expert_counts()
        if balance_layers is not None:
            counts = {i: c for i, c in counts.items() if i in balance_layers}
        model.update_expert_bias(counts, args.bias_rate)
        step += 1
        tokens += batch[:, 1:].numel()
        loss_v = loss.item()
        log["steps"].append(step)
        log["loss"].append(loss_v)
        log["lr"].append(lr)
        if counts and step % 10 == 0:
            ratio = max(float(c.max()) / max(float(c.float().mean()), 1e-9)
                        for c in counts.values())
            log["max_load_ratio"].append([step, ratio])
        bar.update(1)
        bar.set_postfix({"loss": f"{loss_v:.3f}", "lr": f"{lr:.2e}",
                         "tok/s": f"{tokens / max(clock.elapsed(), 1e-9):.0f}"})
        done = clock.progress(step) >= 1.0
        if step % args.eval_interval == 0 or done:
            log["eval"].append(dict(step=step, **heldout_eval(model, held, args, device)))
    bar.close()
    log.update(num_steps=step, tokens=tokens, seconds=clock.elapsed(),
               tokens_per_s=tokens / max(clock.elapsed(), 1e-9),
               stopped_by="time" if step < steps else "steps")
    return log


def heldout_eval(model: torch.nn.Module, held: torch.Tensor, args: argparse.Namespace,
                 device: torch.device) -> Dict[str, float]:
    """Held-out loss (and MTP loss/agreement) on the first ``--eval-windows`` windows."""
    was_training = model.training
    model.eval()
    s = score_stream(model, held, args.seq_len, args.batch_size, device, with_mtp=True,
                     max_windows=args.eval_windows)
    model.pop_expert_counts()  # evaluation must not steer the balancing
    model.train(was_training)
    return {"heldout_loss": s.loss, "mtp_loss": s.mtp_loss,
            "mtp_agreement": s.mtp_agree / max(s.mtp_tokens, 1)}


def plot_losses(log: Dict[str, Any], path: Path) -> bool:
    """Save the loss curves (train + held-out, both phases); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase, key in ((axes[0], "target", "heldout_loss"), (axes[1], "mtp", "mtp_loss")):
        ph = log["phases"].get(phase)
        if not ph:
            continue
        label = "train batch (CE)" if phase == "target" else "train batch (CE/KL mix)"
        ax.plot(ph["steps"], ph["loss"], lw=0.6, alpha=0.6, label=label)
        ev = ph["eval"]
        ax.plot([e["step"] for e in ev], [e[key] for e in ev], "o-", label="held-out (CE)")
        ax.set_title(f"{phase} phase")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def build_argparser() -> argparse.ArgumentParser:
    """Command-line options (defaults = the bundled model's recipe)."""
    ap = argparse.ArgumentParser(prog="python -m sglang.train.target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output checkpoint directory")
    ap.add_argument("--replot", action="store_true",
                    help="only re-render OUT/loss_curve.png from OUT/train_log.json (e.g. on a "
                         "machine that has matplotlib when the training host did not)")
    ap.add_argument("--steps", type=int, default=1000, help="target-phase optimizer steps")
    ap.add_argument("--mtp-steps", type=int, default=300, help="MTP-phase optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3, help="target-phase peak learning rate")
    ap.add_argument("--mtp-lr", type=float, default=2e-3, help="MTP-phase peak learning rate")
    ap.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of a phase")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3,
                    help="aux-loss-free balancing step u: bias += u * sign(mean_load - load)")
    ap.add_argument("--mtp-distill", type=float, default=0.5,
                    help="weight of KL(target || mtp) in the MTP loss (rest: CE on x_{t+2})")
    ap.add_argument("--vocab-size", type=int, default=MAX_VOCAB)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--layer-group-size", type=int, default=6)
    ap.add_argument("--num-heads", type=int, default=4, help="KDA and MLA heads")
    ap.add_argument("--head-dim", type=int, default=64, help="KDA head dim")
    ap.add_argument("--intermediate-size", type=int, default=512, help="dense MLP width")
    ap.add_argument("--num-experts", type=int, default=16)
    ap.add_argument("--moe-intermediate-size", type=int, default=96)
    ap.add_argument("--eval-interval", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=16,
                    help="held-out windows scored at each periodic evaluation")
    ap.add_argument("--time-budget-s", type=float, default=600.0,
                    help="wall-clock budget of both training phases together")
    ap.add_argument("--mtp-time-share", type=float, default=0.15,
                    help="fraction of the time budget reserved for the MTP phase")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train-files", type=int, default=None,
                    help="train on a deterministic slice of the corpus (smoke tests)")
    ap.add_argument("--kda-mode", default="auto", choices=("auto", "chunk", "fla"))
    return ap


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the whole pipeline; returns the train log (also written to ``--out/train_log.json``)."""
    from sglang.train.reference import ReferenceBailingMoeV3

    args = build_argparser().parse_args(argv)
    if args.replot:
        log_path = Path(args.out) / "train_log.json"
        if not log_path.is_file():
            raise SystemExit(f"--replot: no train_log.json in {args.out!r}")
        log = json.loads(log_path.read_text())
        if not plot_losses(log, Path(args.out) / "loss_curve.png"):
            raise SystemExit("--replot needs matplotlib (pip install matplotlib)")
        return log
    for name in ("steps", "batch_size", "seq_len", "eval_interval", "eval_windows"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.mtp_steps < 0 or not 0 <= args.mtp_distill <= 1 or not 0 < args.mtp_time_share < 1:
        raise SystemExit("--mtp-steps must be >= 0, --mtp-distill in [0, 1], "
                         "--mtp-time-share in (0, 1)")
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls left
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus()
    fingerprint = corpus_fingerprint(corpus)  # of the full corpus, also for sliced runs
    if args.max_train_files is not None:
        corpus = slice_corpus(corpus, args.max_train_files, len(corpus.held_out))
    tok = train_tokenizer(corpus.train_texts(), vocab_size=args.vocab_size)
    eos_id, pad_id = tok.token_to_id(EOT_TOKEN), tok.token_to_id(PAD_TOKEN)
    train_stream = pack_token_stream(encode_batch(tok, corpus.train_texts()), eos_id)
    held_stream = pack_token_stream(encode_batch(tok, corpus.held_out_texts()), eos_id)
    data = PackedSequences(train_stream, args.seq_len)
    print(f"[train] corpus: {len(corpus.train)} train files ({train_stream.numel()} tokens), "
          f"{len(corpus.held_out)} held-out ({held_stream.numel()} tokens); device {device}")

    config = tiny_config(tok.get_vocab_size(), eos_id, pad_id, hidden_size=args.hidden_size,
                         num_layers=args.num_layers, layer_group_size=args.layer_group_size,
                         num_heads=args.num_heads, head_dim=args.head_dim,
                         intermediate_size=args.intermediate_size, num_experts=args.num_experts,
                         moe_intermediate_size=args.moe_intermediate_size)
    model = ReferenceBailingMoeV3(config, kda_mode="chunk", seed=args.seed).to(device)
    model.train()
    if args.kda_mode == "auto":
        model.kda_mode = pick_kda_mode(model, device, tok.get_vocab_size(), args.seq_len)
    else:
        model.kda_mode = args.kda_mode
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] model: {n_params / 1e6:.2f} M parameters, kda_mode={model.kda_mode}")

    budget = args.time_budget_s - (time.perf_counter() - t_start)
    mtp_layer = config["num_hidden_layers"]

    def is_mtp(name: str) -> bool:
        return name.startswith(f"model.layers.{mtp_layer}.")

    target_params = [(n, p) for n, p in model.named_parameters() if not is_mtp(n)]
    phases: Dict[str, Any] = {}
    phases["target"] = run_phase(
        "target", model, lambda b: target_loss(model, b), target_params, data, held_stream,
        args, args.steps, budget * (1 - args.mtp_time_share), args.lr, None, device)
    if args.mtp_steps > 0:
        for n, p in model.named_parameters():
            p.requires_grad_(is_mtp(n))
        mtp_params = [(n, p) for n, p in model.named_parameters() if is_mtp(n)]
        remaining = args.time_budget_s - (time.perf_counter() - t_start)
        phases["mtp"] = run_phase(
            "mtp", model, lambda b: mtp_loss(model, b, args.mtp_distill), mtp_params, data,
            held_stream, args, args.mtp_steps, remaining, args.mtp_lr, {mtp_layer}, device)
        for p in model.parameters():
            p.requires_grad_(True)

    model.save_pretrained(str(out), dtype=torch.bfloat16)
    save_tokenizer(tok, out, model_max_length=config["max_position_embeddings"])
    log: Dict[str, Any] = {
        "args": vars(args),
        "config": config,
        "parameters": n_params,
        "kda_mode": model.kda_mode,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "corpus": {"fingerprint": fingerprint, "root": corpus.root,
                   "max_train_files": args.max_train_files,
                   "train_files": len(corpus.train), "held_out_files": len(corpus.held_out),
                   "train_tokens": int(train_stream.numel()),
                   "held_out_tokens": int(held_stream.numel())},
        "phases": phases,
    }
    if device.type == "cuda":
        log["cuda_max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    log["plot"] = "loss_curve.png" if plot_losses(log, out / "loss_curve.png") else None
    log["total_seconds"] = time.perf_counter() - t_start
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    size = _dir_bytes(out)
    log["checkpoint_bytes"] = size
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    final = phases["target"]["eval"][-1]
    mtp_final = phases["mtp"]["eval"][-1] if "mtp" in phases else {}
    print(f"[train] done in {log['total_seconds']:.0f} s "
          f"({phases['target']['tokens_per_s']:.0f} target tokens/s): held-out loss "
          f"{final['heldout_loss']:.3f}, MTP agreement {mtp_final.get('mtp_agreement', 0):.3f}; "
          f"checkpoint {size / 1e6:.1f} MB in {out}")
    if size > SIZE_LIMIT_BYTES:
        print(f"[train] WARNING: {out} holds {size / 1e6:.1f} MB, over the "
              f"{SIZE_LIMIT_BYTES / 1e6:.0f} MB limit for the bundled model", file=sys.stderr)
    return log


if __name__ == "__main__":
    main()
