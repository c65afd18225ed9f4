"""Offline evaluation of a saved DSpark draft against its target, on held-out greedy sequences.

The draft is loaded from its folder with :func:`sglang.srt.models.dspark.load_dspark_draft`
(the serving model and the shipped, e.g. bf16, weights), its context cache filled with the
target features of each sequence, and every anchor ``p`` of the generation is drafted the way
serving drafts it: context rows ``< p``, the greedy Markov loop over the draft's own tokens, the
confidence head on ``[h_k ; W1[x_{k-1}]]``.

Verification is simulated with the plain greedy rule: draft ``k`` is accepted while every draft
``j <= k`` equals the target's argmax at ``p + j`` (from the target's final hidden states over
the same sequence). Because the held-out sequences are the target's own greedy output, the
accepted count ``a(p)`` of a round anchored at ``p`` does not depend on earlier rounds, so:

* ``accept_length``: a greedy speculative decode walked along each sequence: the first anchor is
  the first generated token, each round commits ``1 + a(p)`` tokens (accepted drafts plus the
  target's bonus token, capped at the sequence end) and the next anchor is the bonus token;
  reported as committed tokens per verify round (what ``avg_spec_accept_length`` counts);
* ``accept_length_all_anchors``: ``1 + a(p)`` averaged over every anchor;
* ``slot_accept``: per slot, the fraction of anchors whose first ``k + 1`` drafts were accepted;
* ``round_anchor_slot1_accept``: slot 1's acceptance over the anchors the walk's rounds start
  at only (those right after a rejected draft or a full block);
* ``ece`` per slot: expected calibration error (20 equal-width bins) of the predicted prefix
  survival ``prod_{i<=k} sigmoid(conf_i)`` against the observed prefix acceptance, and its mean.

:func:`confidence_rounds` returns the same rounds with the confidence head's raw logits, the
input of the STS calibration (``python -m sglang.benchmark.dspark_sts_fit``).

:func:`engine_accept_length` measures the same prompts through ``sglang.Engine``: the target's
NEXTN (MTP) layer for comparison, and the saved draft served by the DSPARK worker (the number the
offline walk predicts).

Command line: saved drafts scored on the held-out sequences of a ``--data-cache`` file written
by ``python -m sglang.train.dspark`` (e.g. a draft trained elsewhere, or on other data, against
the bundled one on the same sequences)::

    python -m sglang.train.dspark_eval --target-path T --data-cache C DRAFT [DRAFT ...] \
        [--served] [--compare-nextn STEPS ...] [--result-filename OUT.jsonl]

``--served`` also serves each draft through ``sglang.Engine`` on the same prompts, and
``--compare-nextn`` the target's NEXTN layer at each number of chained drafts given.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang.train.dspark_data import FeatureSequence

__all__ = ["draft_sequence", "ConfidenceRounds", "confidence_rounds",
           "expected_calibration_error", "evaluate_draft",
           "engine_accept_length", "nextn_spec_kwargs", "dspark_spec_kwargs", "ECE_BINS"]

ECE_BINS = 20


class ConfidenceRounds(NamedTuple):
    """The simulated rounds of every anchor of some held-out sequences, concatenated."""

    accepted: torch.Tensor  # [N] int64: greedy accepted drafts of the round anchored there
    confidence_logits: torch.Tensor  # [N, g] float: the confidence head's raw logits
    verify_lens: torch.Tensor  # [N] int64: slots with a label inside the sequence (<= g)


@torch.no_grad()
def _draft_anchors(model: Any, seq: FeatureSequence, head: torch.Tensor, chunk: int
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(accepted [N], confidence logits [N, g] or None, valid [N, g])`` on the CPU for the
    anchors ``p = prompt_len .. T-2`` of ``seq`` (see :func:`draft_sequence`)."""
    g = model.gamma
    tokens = seq.tokens.long()
    t = int(tokens.numel())
    dev = model.fc.weight.device
    cache = model.new_context_cache(1, t, dev)
    model.write_context(seq.aux.to(dev), torch.arange(t, device=dev),
                        torch.zeros(t, dtype=torch.long, device=dev), cache)
    target_next = (seq.final.to(dev, head.dtype) @ head.to(dev).t()).argmax(-1)  # [T]
    anchors = torch.arange(seq.prompt_len, t - 1, device=dev)
    accepted, logits, valid_all = [], [], []
    for start in range(0, anchors.numel(), chunk):
        p = anchors[start:start + chunk]
        n = p.numel()
        zeros = torch.zeros(n, dtype=torch.long, device=dev)
        prop = model.propose(tokens.to(dev)[p], p, cache, zeros, p, ctx_width=t)
        pos = p.unsqueeze(1) + torch.arange(g, device=dev)  # the target position of slot k
        valid = pos + 1 < t
        match = (prop.draft.tokens == target_next[pos.clamp_max(t - 1)]) & valid
        accepted.append(torch.cumprod(match.long(), dim=1).sum(1))
        valid_all.append(valid)
        if prop.confidence_logits is not None:
            logits.append(prop.confidence_logits)
    acc = torch.cat(accepted).cpu() if accepted else torch.zeros(0, dtype=torch.long)
    val = torch.cat(valid_all).cpu() if valid_all else torch.zeros(0, g, dtype=torch.bool)
    conf = torch.cat(logits).cpu() if logits else None
    if conf is None and model.has_confidence_head:
        conf = torch.zeros(0, g)  # a sequence without anchors
    return acc, conf, val


@torch.no_grad()
def draft_sequence(model: Any, seq: FeatureSequence, head: torch.Tensor, chunk: int = 128
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft every anchor of ``seq`` with the serving draft ``model``.

    Returns ``(accepted [N], survival [N, g] or an empty tensor without a confidence head,
    valid [N, g])`` for the anchors ``p = prompt_len .. T-2``: the greedy accepted count, the
    predicted prefix survival and which slots have a label inside the sequence.
    """
    acc, conf, val = _draft_anchors(model, seq, head, chunk)
    surv = torch.cumprod(torch.sigmoid(conf), dim=1) if conf is not None and conf.numel() \
        else torch.zeros(0)
    return acc, surv, val


@torch.no_grad()
def confidence_rounds(model: Any, seqs: Sequence[FeatureSequence], head: torch.Tensor,
                      chunk: int = 128) -> ConfidenceRounds:
    """The greedy rounds of every anchor of ``seqs`` with the confidence head's raw logits, in
    the form :func:`sglang.srt.rounds.dspark.sts.fit_sts` takes (``verify_lens``: slot
    ``k`` counts as verified when the sequence has a label for it). The draft needs a
    confidence head."""
    if not model.has_confidence_head:
        raise ValueError("the draft has no confidence head (enable_confidence_head is false): "
                         "there is nothing to calibrate")
    g = model.gamma
    accepted, logits, lens = [], [], []
    for seq in seqs:
        acc, conf, val = _draft_anchors(model, seq, head, chunk)
        accepted.append(acc)
        logits.append(conf.float())
        lens.append(val.sum(1))
    if not accepted:
        return ConfidenceRounds(torch.zeros(0, dtype=torch.long), torch.zeros(0, g),
                                torch.zeros(0, dtype=torch.long))
    return ConfidenceRounds(torch.cat(accepted), torch.cat(logits), torch.cat(lens))


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor,
                               bins: int = ECE_BINS) -> float:
    """``sum_b (n_b / N) |mean(predicted_b) - mean(observed_b)|`` over equal-width bins of
    ``predicted`` in [0, 1] (NaN when there is nothing to score)."""
    if predicted.shape != observed.shape:
        raise ValueError(f"predicted {tuple(predicted.shape)} and observed "
                         f"{tuple(observed.shape)} differ")
    n = predicted.numel()
    if n == 0:
        return float("nan")
    idx = (predicted.clamp(0, 1) * bins).long().clamp_max(bins - 1)
    # sum_b (n_b / N) |mean_b(pred) - mean_b(obs)| = sum_b |sum_b(pred) - sum_b(obs)| / N
    pred_sum = torch.bincount(idx, weights=predicted.double(), minlength=bins)
    obs_sum = torch.bincount(idx, weights=observed.double(), minlength=bins)
    return float((pred_sum - obs_sum).abs().sum() / n)


def _walk(accepted: torch.Tensor, num_anchors: int) -> Tuple[int, int]:
    """(committed tokens, rounds) of a greedy decode along one sequence whose anchor ``i``
    (0-based from the first generated token) accepts ``accepted[i]`` drafts."""
    committed = 0
    visited = _round_anchors(accepted, num_anchors)
    for i in visited:
        committed += min(1 + int(accepted[i]), num_anchors - i)  # tokens left after anchor i
    return committed, len(visited)


def _round_anchors(accepted: torch.Tensor, num_anchors: int) -> List[int]:
    """The anchors the greedy decode of :func:`_walk` starts its rounds at: the first generated
    token, then each round's bonus token."""
    visited, i = [], 0
    while i < num_anchors:
        visited.append(i)
        i += 1 + int(accepted[i])
    return visited


@torch.no_grad()
def evaluate_draft(model: Any, seqs: Sequence[FeatureSequence], head: torch.Tensor
                   ) -> Dict[str, Any]:
    """All metrics of the module docstring over ``seqs`` (held-out greedy sequences)."""
    g = model.gamma
    committed = rounds = 0
    all_acc: List[torch.Tensor] = []
    all_surv: List[torch.Tensor] = []
    all_valid: List[torch.Tensor] = []
    round_acc: List[torch.Tensor] = []
    for seq in seqs:
        acc, surv, valid = draft_sequence(model, seq, head)
        c, r = _walk(acc, acc.numel())
        committed, rounds = committed + c, rounds + r
        round_acc.append(acc[_round_anchors(acc, acc.numel())])
        all_acc.append(acc)
        all_valid.append(valid)
        if surv.numel():
            all_surv.append(surv)
    acc = torch.cat(all_acc) if all_acc else torch.zeros(0, dtype=torch.long)
    valid = torch.cat(all_valid) if all_valid else torch.zeros(0, g, dtype=torch.bool)
    observed = torch.arange(g).unsqueeze(0) < acc.unsqueeze(1)  # prefix of k+1 accepted
    slot_accept = [float(observed[valid[:, k], k].float().mean()) if valid[:, k].any()
                   else float("nan") for k in range(g)]
    result: Dict[str, Any] = {
        "sequences": len(seqs),
        "anchors": int(acc.numel()),
        "gamma": g,
        "accept_length": committed / rounds if rounds else float("nan"),
        "verify_rounds": rounds,
        "accept_length_all_anchors": float(1 + acc.float().mean()) if acc.numel() else
        float("nan"),
        "slot_accept": slot_accept,
        # Slot 1 at the anchors the rounds start at (after a rejection, or a full block):
        # against slot_accept[0] it says whether those anchors are harder to draft from.
        "round_anchor_slot1_accept": float((torch.cat(round_acc) > 0).float().mean())
        if round_acc and sum(x.numel() for x in round_acc) else float("nan"),
    }
    if all_surv:
        surv = torch.cat(all_surv)
        ece = [expected_calibration_error(surv[valid[:, k], k], observed[valid[:, k], k].float())
               for k in range(g)]
        result["ece"] = ece
        result["mean_ece"] = float(torch.tensor(ece).nanmean())
        result["mean_predicted_survival"] = [float(surv[valid[:, k], k].mean())
                                             if valid[:, k].any() else float("nan")
                                             for k in range(g)]
    return result


def engine_accept_length(target_path: str, prompts: Sequence[List[int]], max_new_tokens: int,
                         spec_kwargs: Dict[str, Any], engine_kwargs: Dict[str, Any],
                         reference_outputs: Sequence[List[int]] = ()) -> Dict[str, Any]:
    """Greedy speculative decoding of ``prompts`` through ``sglang.Engine`` with the
    speculative ``spec_kwargs`` (``ServerArgs`` fields, e.g. NEXTN with ``gamma`` chained MTP
    drafts, or DSPARK with a draft folder); returns the server-wide ``avg_spec_accept_length``
    (committed tokens per verify round) and, when ``reference_outputs`` are given, the fraction
    of requests whose output equals them (greedy speculative decoding is lossless, so this
    should be 1)."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import MAX_BATCH_SIZE

    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    with Engine(model_path=target_path, **spec_kwargs, **engine_kwargs) as engine:
        engine.flush_cache()  # the counters start at zero
        outs = []
        for i in range(0, len(prompts), MAX_BATCH_SIZE):  # the per-request cap of io_struct
            chunk = [list(p) for p in prompts[i:i + MAX_BATCH_SIZE]]
            outs += engine.generate(input_ids=chunk, sampling_params=[params] * len(chunk))
        states = engine.get_server_info()["internal_states"]
    result: Dict[str, Any] = {**{k: v for k, v in spec_kwargs.items()
                                 if isinstance(v, (int, str))},
                              "requests": len(prompts),
                              "accept_length": float(states[0]["avg_spec_accept_length"])}
    if reference_outputs:
        same = sum(list(o["output_ids"]) == list(r) for o, r in zip(outs, reference_outputs))
        result["matches_plain_greedy"] = same / max(len(outs), 1)
    return result


def engine_base_kwargs(device: str, dtype: str, seed: int = 0,
                       num_threads: Optional[int] = None) -> Dict[str, Any]:
    """The engine flags every evaluation engine shares: device, dtype, seed, quiet logs and, on
    CPU, the threads (``None``: the engine's default). Sizes are the caller's."""
    kw: Dict[str, Any] = dict(device=device, dtype=dtype, random_seed=seed, log_level="warning")
    if num_threads is not None:
        kw["cpu_num_threads"] = num_threads
    return kw


def serve_held_out(target_path: str, seqs: Sequence[FeatureSequence],
                   specs: Sequence[Tuple[str, Dict[str, Any]]], engine_kwargs: Dict[str, Any],
                   extra_tokens: int = 0) -> Dict[str, Dict[str, Any]]:
    """:func:`engine_accept_length` of each ``(key, spec)`` on the prompts of the held-out
    greedy ``seqs``, their continuations the reference outputs (the lossless check), one engine
    each. ``engine_kwargs``: :func:`engine_base_kwargs`; its request slots and token pool are
    sized here for every sequence plus ``extra_tokens`` (a round's drafts).
    Returns ``{key: result}``."""
    prompts = [s.tokens[:s.prompt_len].tolist() for s in seqs]
    outputs = [s.tokens[s.prompt_len:].tolist() for s in seqs]
    per_request = max(len(s.tokens) for s in seqs) + extra_tokens
    sized = {**engine_kwargs, "max_running_requests": len(seqs),
             "max_total_tokens": len(seqs) * per_request + 64}
    results = {}
    for key, spec in specs:
        print(f"[dspark] {spec['speculative_algorithm']} through the engine on the held-out "
              "prompts", flush=True)
        results[key] = engine_accept_length(target_path, prompts, max(map(len, outputs)), spec,
                                            sized, reference_outputs=outputs)
    return results


def nextn_spec_kwargs(gamma: int) -> Dict[str, Any]:
    """Engine flags of NEXTN with ``gamma`` chained MTP drafts per round (verify width
    ``gamma + 1``), the NEXTN configuration comparable with a gamma-token DSpark block."""
    return {"speculative_algorithm": "NEXTN", "speculative_num_steps": gamma,
            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": gamma + 1}


def dspark_spec_kwargs(draft_path: str) -> Dict[str, Any]:
    """Engine flags serving the DSpark draft folder ``draft_path``."""
    return {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": draft_path}


def evaluate_folder(path: str, hf_config: Any, seqs: Sequence[FeatureSequence],
                    embed: torch.Tensor, head: torch.Tensor, device: Any) -> Dict[str, Any]:
    """:func:`evaluate_draft` of the draft folder ``path``, loaded with the serving loader in
    float32 and given the target's ``embed`` and ``head``, on ``seqs``."""
    from sglang.srt.models.dspark import load_dspark_draft

    model = load_dspark_draft(path, hf_config, dtype=torch.float32, device=device)
    model.set_embed_and_head(embed.to(device), head.to(device))
    return evaluate_draft(model, seqs, head.to(device))


def score_drafts(target_path: str, seqs: Sequence[FeatureSequence], drafts: Sequence[str],
                 device: str = "cpu") -> List[Dict[str, Any]]:
    """:func:`evaluate_folder` of each saved draft folder on ``seqs`` (held-out sequences of a
    cache of ``target_path``) with the target's embedding and LM head, as ``python -m
    sglang.train.dspark`` scores the draft it trains. One dict per draft: ``draft`` (its path)
    and the evaluation."""
    from sglang.srt.configs.dspark import DSparkDraftConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.train.dspark_data import TargetFeatureRunner

    hf_config = ModelConfig.from_path(target_path).hf_config
    layers = DSparkDraftConfig.from_path(drafts[0], hf_config).target_layer_ids
    embed, head = TargetFeatureRunner(target_path, layers, device=device).embed_and_head()
    return [{"draft": path, **evaluate_folder(path, hf_config, seqs, embed, head, device)}
            for path in drafts]


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Command line of :func:`score_drafts` (module docstring); prints one line per draft."""
    ap = argparse.ArgumentParser(prog="python -m sglang.train.dspark_eval",
                                 description="score saved DSpark drafts on a data cache's "
                                             "held-out sequences (offline greedy walk)")
    ap.add_argument("drafts", nargs="+", help="draft folders")
    ap.add_argument("--target-path", required=True, help="the target checkpoint folder")
    ap.add_argument("--data-cache", required=True,
                    help="a --data-cache file of python -m sglang.train.dspark for that target")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--served", action="store_true",
                    help="also serve each draft (DSPARK) through sglang.Engine on the held-out "
                         "prompts: accept length and outputs equal to the cache's greedy ones")
    ap.add_argument("--compare-nextn", type=int, nargs="+", default=[], metavar="STEPS",
                    help="also the target's NEXTN layer through the engine on the same prompts, "
                         "at each number of chained drafts given")
    ap.add_argument("--dtype", default="auto",
                    help="the engines' dtype (auto: float32 on CPU, the checkpoint's on CUDA; "
                         "use the one the cache was made in)")
    ap.add_argument("--num-threads", type=int, default=None, help="CPU threads of the engines")
    ap.add_argument("--result-filename", default=None,
                    help="append one JSON line per draft (and per NEXTN setting)")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.compare_nextn):
        ap.error(f"--compare-nextn takes draft counts >= 1, got {args.compare_nextn}")
    from sglang.train.dspark_data import load_feature_cache, target_fingerprint

    try:  # another target's cache is refused
        _, held = load_feature_cache(args.data_cache,
                                     {"target": target_fingerprint(args.target_path)})
        rows = score_drafts(args.target_path, held, args.drafts, args.device)
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    if args.served or args.compare_nextn:
        rows += _served_rows(args, held, rows)
    for r in rows:
        if "accept_length_all_anchors" in r:  # an offline row
            print(f"{r['draft']}: accept length {r['accept_length']:.3f} over "
                  f"{r['verify_rounds']} rounds (gamma {r['gamma']}); prefix acceptance "
                  + ", ".join(f"{a:.3f}" for a in r["slot_accept"])
                  + f"; mean ECE {r['mean_ece']:.3f}")
        else:
            print(f"{r['draft']} served: accept length {r['accept_length']:.3f}; outputs equal "
                  f"to the cache's greedy ones: {r['matches_plain_greedy']:.0%}")
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps(r) + "\n")
    return rows


def _served_rows(args: argparse.Namespace, held: Sequence[FeatureSequence],
                 offline: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The engine rows of :func:`main`: each draft served (``--served``) and NEXTN at each
    ``--compare-nextn``; ``draft`` names the folder, or ``NEXTN-<steps>``."""
    from sglang.train.eval import engine_dtype

    specs = [(f"NEXTN-{n}", nextn_spec_kwargs(n)) for n in args.compare_nextn]
    if args.served:
        specs += [(r["draft"], dspark_spec_kwargs(r["draft"])) for r in offline]
    drafts = max([r["gamma"] for r in offline] + args.compare_nextn)
    base = engine_base_kwargs(args.device, engine_dtype(torch.device(args.device), args.dtype),
                              num_threads=args.num_threads)
    served = serve_held_out(args.target_path, held, specs, base, 2 * drafts + 2)
    return [{"draft": key, **result} for key, result in served.items()]


if __name__ == "__main__":
    main()
