"""Evaluate a trained tiny BailingMoeV3: ``python -m sglang.train.eval --model DIR``.

Reports, on the held-out split of :mod:`sglang.train.data`:

* held-out loss (nats/token) and bits per byte = total nats / ln 2 / UTF-8 bytes of the held-out
  text (every token of the packed held-out stream is predicted once, with up to ``seq_len``
  tokens of context; the end-of-text separators are predicted too and carry no bytes);
* a unigram baseline on the same tokens: the train split's token frequencies with add-one
  smoothing;
* the MTP layer, teacher-forced on the held-out text: at position t it reads ``(h_t, x_{t+1})``;
  ``mtp_agreement`` is how often its argmax equals the target's greedy token at t+1 (the target's
  argmax given ``x_{<=t+1}``), ``mtp_accuracy`` how often it equals the true ``x_{t+2}``;
* greedy completions of a few Python prompts, and along them the exact greedy-decoding rate at
  which the MTP draft equals the target's next greedy token (``mtp_greedy_acceptance``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from sglang.train.data import Corpus, corpus_fingerprint, load_corpus, pack_token_stream
from tokenizers import Tokenizer

from sglang.train.tokenizer import EOT_TOKEN, SPECIAL_TOKENS, encode_batch, load_tokenizer

PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(path):\n",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def engine_dtype(device: torch.device, dtype: str = "auto") -> str:
    """The ``dtype`` an engine or model runner gets for an offline tool: ``auto`` is float32
    on CPU (the reference precision) and the checkpoint's dtype (``auto``) on CUDA."""
    if dtype != "auto":
        return dtype
    return "float32" if device.type == "cpu" else "auto"


def autocast_for(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; a disabled autocast (plain fp32) elsewhere."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                          enabled=device.type == "cuda")


@dataclass
class StreamScore:
    """Sums over the scored positions of a token stream."""

    nats: float = 0.0
    tokens: int = 0
    mtp_nats: float = 0.0
    mtp_tokens: int = 0
    mtp_agree: int = 0
    mtp_correct: int = 0

    @property
    def loss(self) -> float:
        return self.nats / max(self.tokens, 1)

    @property
    def mtp_loss(self) -> float:
        return self.mtp_nats / max(self.mtp_tokens, 1)


def _windows(stream: torch.Tensor, seq_len: int) -> List[torch.Tensor]:
    """Windows of ``seq_len + 1`` tokens overlapping by one (the last may be shorter) such that
    every token but the first is predicted exactly once."""
    out = []
    for start in range(0, stream.numel() - 1, seq_len):
        w = stream[start:start + seq_len + 1]
        if w.numel() >= 2:
            out.append(w)
    return out


@torch.no_grad()
def score_windows(model: torch.nn.Module, windows: torch.Tensor, device: torch.device,
                  with_mtp: bool) -> StreamScore:
    """Score a ``[B, L]`` batch of windows: next-token nats and (optionally) MTP statistics."""
    s = StreamScore()
    w = windows.to(device)
    with autocast_for(device):
        logits, hidden = model(w[:, :-1])
        s.nats = float(F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(),
                                       reduction="sum"))
        s.tokens = w[:, 1:].numel()
        t = w.shape[1] - 1
        if with_mtp and t >= 2:
            mtp_logits, _ = model.mtp_forward(hidden[:, :t - 1], w[:, 1:t])
            target_next = logits[:, 1:t].argmax(-1)
            draft = mtp_logits.argmax(-1)
            truth = w[:, 2:t + 1]
            s.mtp_nats = float(F.cross_entropy(mtp_logits.flatten(0, 1).float(), truth.flatten(),
                                               reduction="sum"))
            s.mtp_tokens = truth.numel()
            s.mtp_agree = int((draft == target_next).sum())
            s.mtp_correct = int((draft == truth).sum())
    return s


def score_stream(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, batch_size: int,
                 device: torch.device, with_mtp: bool = True,
                 max_windows: Optional[int] = None) -> StreamScore:
    """Score every token of ``stream`` (or of its first ``max_windows`` windows)."""
    wins = _windows(stream, seq_len)
    if max_windows is not None:
        wins = wins[:max_windows]
    total = StreamScore()
    i = 0
    while i < len(wins):
        # Windows of one length are batched; only the tail window differs.
        group = [wins[i]]
        while (i + len(group) < len(wins) and len(group) < batch_size
               and wins[i + len(group)].numel() == wins[i].numel()):
            group.append(wins[i + len(group)])
        part = score_windows(model, torch.stack(group), device, with_mtp)
        for field in ("nats", "tokens", "mtp_nats", "mtp_tokens", "mtp_agree", "mtp_correct"):
            setattr(total, field, getattr(total, field) + getattr(part, field))
        i += len(group)
    return total


def token_byte_lengths(tok: Tokenizer) -> torch.Tensor:
    """UTF-8 bytes each token id stands for (special tokens: 0). Byte-level BPE spells every
    byte as one character of its token string, so the length of that string is the count."""
    specials = set(SPECIAL_TOKENS)
    lengths = torch.zeros(tok.get_vocab_size(), dtype=torch.long)
    for piece, i in tok.get_vocab().items():
        lengths[i] = 0 if piece in specials else len(piece)
    return lengths


def unigram_nats(train_stream: torch.Tensor, eval_tokens: torch.Tensor, vocab_size: int) -> float:
    """Total nats of ``eval_tokens`` under the add-one-smoothed unigram of ``train_stream``."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(-logp[eval_tokens].sum())


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_id: int, device: torch.device) -> List[int]:
    """Greedy continuation (full recompute per token: the reference model has no cache)."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    new: List[int] = []
    for _ in range(max_new_tokens):
        with autocast_for(device):
            logits, _ = model(ids)
        nxt = int(logits[0, -1].argmax())
        new.append(nxt)
        if nxt == eos_id:
            break
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    return new


@torch.no_grad()
def mtp_greedy_acceptance(model: torch.nn.Module, prompt_ids: Sequence[int],
                          generated: Sequence[int], device: torch.device) -> tuple:
    """(hits, trials): at each position t whose next two tokens were generated greedily, does the
    MTP draft from ``(h_t, s_{t+1})`` equal ``s_{t+2}`` (the target's greedy choice)?"""
    seq = list(prompt_ids) + list(generated)
    p = len(prompt_ids)
    if len(generated) < 2:
        return 0, 0
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    with autocast_for(device):
        _, hidden = model(ids)
        mtp_logits, _ = model.mtp_forward(hidden[:, :-1], ids[:, 1:])
    draft = mtp_logits[0].argmax(-1)  # draft[t] predicts seq[t + 2]
    ts = torch.arange(p - 1, len(seq) - 2, device=device)
    hits = int((draft[ts] == ids[0, ts + 2]).sum())
    return hits, int(ts.numel())


def evaluate_model(model_dir: str, device_name: str = "auto", seq_len: Optional[int] = None,
                   batch_size: int = 8, max_windows: Optional[int] = None,
                   max_new_tokens: int = 64, corpus: Optional[Corpus] = None) -> Dict[str, object]:
    """Run every metric of this module on the model in ``model_dir``; returns a JSON-able dict.

    ``corpus`` defaults to the full corpus of :func:`load_corpus` (tests pass a slice)."""
    from sglang.train.reference import ReferenceBailingMoeV3

    device = resolve_device(device_name)
    model = ReferenceBailingMoeV3.from_pretrained(model_dir, dtype=torch.float32, device=device,
                                                  kda_mode="auto")
    model.eval()
    tok = load_tokenizer(model_dir)
    eos_id = tok.token_to_id(EOT_TOKEN)
    log_path = Path(model_dir) / "train_log.json"
    train_log = json.loads(log_path.read_text()) if log_path.is_file() else {}
    if seq_len is None:
        seq_len = int(train_log.get("args", {}).get("seq_len", 1024))
    corpus = corpus if corpus is not None else load_corpus()
    held = corpus.held_out_texts()
    held_stream = pack_token_stream(encode_batch(tok, held), eos_id)
    n_bytes = sum(len(t.encode("utf-8")) for t in held)
    has_mtp = model.config.num_nextn_predict_layers > 0
    score = score_stream(model, held_stream, seq_len, batch_size, device, has_mtp, max_windows)
    # The unigram baseline scores exactly the tokens the model scored.
    scored = torch.cat([w[1:] for w in _windows(held_stream, seq_len)[:max_windows]])
    train_stream = pack_token_stream(encode_batch(tok, corpus.train_texts()), eos_id)
    uni = unigram_nats(train_stream, scored, model.config.vocab_size)
    if max_windows is not None:  # a prefix was scored: count the bytes of its tokens
        n_bytes = int(token_byte_lengths(tok)[scored].sum())
    ln2 = math.log(2.0)
    samples, hits, trials = [], 0, 0
    for prompt in PROMPTS:
        pids = tok.encode(prompt, add_special_tokens=False).ids
        gen = greedy_generate(model, pids, max_new_tokens, eos_id, device)
        if has_mtp:
            h, n = mtp_greedy_acceptance(model, pids, gen, device)
            hits, trials = hits + h, trials + n
        samples.append({"prompt": prompt, "completion": tok.decode(gen, skip_special_tokens=False)})
    result: Dict[str, object] = {
        "model": str(model_dir),
        "device": str(device),
        "python": sys.version.split()[0],
        "corpus_fingerprint": corpus_fingerprint(corpus),
        "trained_on_corpus": train_log.get("corpus", {}).get("fingerprint"),
        "seq_len": seq_len,
        "heldout_tokens": score.tokens,
        "heldout_bytes": n_bytes,
        "heldout_loss_nats_per_token": score.loss,
        "heldout_bits_per_byte": score.nats / ln2 / n_bytes,
        "unigram_loss_nats_per_token": uni / scored.numel(),
        "unigram_bits_per_byte": uni / ln2 / n_bytes,
        "samples": samples,
    }
    if has_mtp:
        result.update({
            "mtp_loss_nats_per_token": score.mtp_loss,
            "mtp_agreement": score.mtp_agree / max(score.mtp_tokens, 1),
            "mtp_accuracy": score.mtp_correct / max(score.mtp_tokens, 1),
            "mtp_greedy_acceptance": hits / trials if trials else None,
        })
    return result


def format_table(result: Dict[str, object]) -> str:
    """Human-readable summary of :func:`evaluate_model`'s result."""
    rows = [
        ("held-out loss (nats/token)", "heldout_loss_nats_per_token"),
        ("held-out bits/byte", "heldout_bits_per_byte"),
        ("unigram loss (nats/token)", "unigram_loss_nats_per_token"),
        ("unigram bits/byte", "unigram_bits_per_byte"),
        ("MTP loss (nats/token, x_{t+2})", "mtp_loss_nats_per_token"),
        ("MTP top-1 agreement w/ target", "mtp_agreement"),
        ("MTP top-1 accuracy (true x_{t+2})", "mtp_accuracy"),
        ("MTP greedy acceptance", "mtp_greedy_acceptance"),
    ]
    lines = [f"model {result['model']}  device {result['device']}  "
             f"held-out tokens {result['heldout_tokens']}"]
    for label, key in rows:
        v = result.get(key)
        if v is not None:
            lines.append(f"  {label:<36} {v:.4f}")
    if result.get("trained_on_corpus") and result["trained_on_corpus"] != result[
            "corpus_fingerprint"]:
        lines.append("  note: this Python's stdlib differs from the training corpus "
                     "(held-out texts may differ slightly)")
    for s in result["samples"]:  # type: ignore[union-attr]
        lines.append("-" * 60)
        lines.append(s["prompt"] + "\u2502" + s["completion"])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """CLI entry point: print the table and optionally write the JSON result."""
    ap = argparse.ArgumentParser(prog="python -m sglang.train.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config + tokenizer)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="context window (default: the training seq_len from train_log.json)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-windows", type=int, default=None,
                    help="score only the first N held-out windows (quick runs)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if not Path(args.model).is_dir():
        ap.error(f"--model {args.model!r} is not a directory")
    if args.seq_len is not None and args.seq_len < 2:
        ap.error("--seq-len must be >= 2")
    result = evaluate_model(args.model, args.device, args.seq_len, args.batch_size,
                            args.max_windows, args.max_new_tokens)
    print(format_table(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
