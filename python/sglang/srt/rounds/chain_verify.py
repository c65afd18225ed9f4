"""The verify step of a chain round, shared by every drafter that proposes one chain per request.

A chain round writes ``N`` tokens per request: chain position 0 is the seed (the last committed
token, whose KV this round writes), positions ``1 .. N-1`` are drafts. :func:`verify_chain`
runs one ``TARGET_VERIFY`` target forward over the chain (KDA states staged, not committed),
decides acceptance on the device (:func:`accept_chain`), commits the KDA state of the last
accepted position, writes the new committed lengths and the next seeds into the relay and
appends the committed tokens to the sampling history. :func:`chain_pending_round` starts the
host copies of such a round. Neither reads a device value on the host, so a CUDA graph can
capture them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from sglang.srt.environ import envs
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.rounds.chain import (
    ChainCommitLayout,
    ChainVerifyResult,
    build_verify_forward_batch,
    chain_commit_layout,
    greedy_verify_chain,
    rejection_sample_chain,
)
from sglang.srt.rounds.chain_sampling import (
    chain_uniforms,
    expand_for_chain,
    processed_logits,
    transformed_probs,
    verify_lanes,
)
from sglang.srt.rounds.relay import FutureMap, PendingRound
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

__all__ = ["ChainVerifyOutput", "accept_chain", "commit_chain", "logprob_source", "verify_chain",
           "chain_round_copies", "chain_pending_round"]


@dataclass
class ChainVerifyOutput:
    """What :func:`verify_chain` decided and what later phases may reuse."""

    verdict: ChainVerifyResult  # accept_len [B], accepted_tokens [B, N] (-1 pads), next_seed [B]
    layout: ChainCommitLayout  # new lengths, keep mask, last accepted index
    committed: torch.Tensor  # accepted_tokens with the pads replaced by a valid id, [B, N]
    target_hidden: torch.Tensor  # the target's hidden states of the chain, [B, N, H]
    lp_source: Optional[torch.Tensor]  # [B, N, V] to log-softmax for logprobs (when asked)


def accept_chain(logits: torch.Tensor, tokens: torch.Tensor, info: SamplingBatchInfo,
                 draft_probs: Optional[torch.Tensor]
                 ) -> Tuple[ChainVerifyResult, torch.Tensor, SamplingBatchInfo]:
    """Acceptance per row of the chain ``tokens [B, N]`` from the target's ``logits [B * N, V]``:
    greedy rows against the target argmax, sampled rows by exact rejection sampling against
    ``draft_probs [B, N - 1, V]`` (the distributions drafts ``1 .. N-1`` were drawn from; None
    for a drafter whose drafts are deterministic, which is a one-hot distribution); both under
    the per-position sampling transform. Also returns the penalised logits ``[B * N, V]`` and
    the per-position sampling rows."""
    b, n = tokens.shape
    rows_info = expand_for_chain(info, tokens[:, 1:], n)
    processed = processed_logits(logits, rows_info)
    greedy = greedy_verify_chain(tokens, processed.argmax(dim=-1).view(b, n))
    if info.is_all_greedy:
        return greedy, processed, rows_info
    p = transformed_probs(processed, rows_info).view(b, n, -1)
    q = draft_probs
    if q is None:
        q = torch.zeros(b, n - 1, p.shape[-1], dtype=p.dtype, device=p.device)
        q.scatter_(2, tokens[:, 1:].unsqueeze(-1), 1.0)
    u = chain_uniforms(info, verify_lanes(n))
    sampled = rejection_sample_chain(tokens, q, p, uniforms=u)
    g = info.greedy_mask
    verdict = ChainVerifyResult(
        accept_len=torch.where(g, greedy.accept_len, sampled.accept_len),
        accepted_tokens=torch.where(g.unsqueeze(1), greedy.accepted_tokens,
                                    sampled.accepted_tokens),
        next_seed=torch.where(g, greedy.next_seed, sampled.next_seed))
    return verdict, processed, rows_info


def commit_chain(target_runner: ModelRunner, future_map: FutureMap, verdict: ChainVerifyResult,
                 prefix: torch.Tensor, slots: torch.Tensor, loc: torch.Tensor,
                 info: SamplingBatchInfo) -> Tuple[ChainCommitLayout, torch.Tensor]:
    """After acceptance: the KDA commit of the last accepted position, the relay's new lengths
    and seeds, the committed tokens into the sampling history. Returns the commit layout and
    the accepted tokens with their pads replaced by a valid id."""
    layout = chain_commit_layout(prefix, verdict.accept_len, loc)
    kda_pool = target_runner.kda_state_pool
    if kda_pool is not None and kda_pool.layer_ids:
        kda_pool.commit_after_verify(slots, layout.last_accepted_index)
    future_map.scatter(slots, seq_lens=layout.new_seq_lens, tokens=verdict.next_seed)
    committed = verdict.accepted_tokens.clamp(min=0)  # pad (-1) -> a valid id
    info.append_tokens(committed, valid=layout.keep_mask)
    return layout, committed


def logprob_source(logits: torch.Tensor, processed: torch.Tensor, rows_info: SamplingBatchInfo,
                   vocab_size: int, b: int, n: int) -> torch.Tensor:
    """``[B, N, V]`` to log-softmax for a chain's logprobs. As the sampler: the penalised logits
    over the temperature at each position (the raw ``logits`` with
    SGLANG_RETURN_ORIGINAL_LOGPROB)."""
    if envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get():
        source = logits[:, :vocab_size].float()
    else:
        source = processed / rows_info.temperatures.unsqueeze(1)
    return source.view(b, n, -1)


def verify_chain(target_runner: ModelRunner, future_map: FutureMap, chain: torch.Tensor,
                 prefix: torch.Tensor, slots: torch.Tensor, loc: torch.Tensor,
                 info: SamplingBatchInfo, seq_lens_bound: int, return_logprob: bool,
                 draft_probs: Optional[torch.Tensor] = None) -> ChainVerifyOutput:
    """Target verify of ``chain [B, N]`` (committed lengths ``prefix [B]``, request slots
    ``slots [B]``, KV slots ``loc [B, N]``), acceptance (:func:`accept_chain`) and the commit
    (:func:`commit_chain`)."""
    b, n = chain.shape
    verify_batch = build_verify_forward_batch(chain, slots, prefix, loc,
                                              seq_lens_upper_bound=seq_lens_bound)
    target_out = target_runner.forward(verify_batch)
    logits = target_out.next_token_logits
    verdict, processed, rows_info = accept_chain(logits, chain, info, draft_probs)
    layout, committed = commit_chain(target_runner, future_map, verdict, prefix, slots, loc,
                                     info)
    lp_source = None
    if return_logprob:
        lp_source = logprob_source(logits, processed, rows_info,
                                   target_runner.model_config.vocab_size, b, n)
    return ChainVerifyOutput(verdict, layout, committed,
                             target_out.hidden_states.view(b, n, -1), lp_source)


def chain_round_copies(out: dict, loc: torch.Tensor, return_logprob: bool,
                       top_logprobs_num: int, vocab_size: int) -> Dict[str, torch.Tensor]:
    """The device tensors a chain round's host copy reads: ``out["accept_len"] [B]``,
    ``out["tokens"] [B, N]``, the KV slots and, for logprobs, the chosen and top logprobs from
    ``out["lp_source"] [B, N, V]`` (log-softmaxed here, after the body, so a graph holds only
    the source)."""
    copies = {"accept_len": out["accept_len"], "tokens": out["tokens"], "loc": loc}
    if return_logprob:
        lp = torch.log_softmax(out["lp_source"], dim=-1)  # [B, N, V]
        committed = out["tokens"].clamp(min=0)
        copies["logprobs"] = lp.gather(2, committed.unsqueeze(-1)).squeeze(-1)
        if top_logprobs_num > 0:
            k = min(top_logprobs_num, vocab_size)
            copies["top_val"], copies["top_idx"] = lp.topk(k, -1)
    return copies


def chain_pending_round(out: dict, loc: torch.Tensor, return_logprob: bool,
                        top_logprobs_num: int, vocab_size: int,
                        on_current_stream: bool = False) -> PendingRound:
    """Start the host copies of a chain round (:func:`chain_round_copies`)."""
    return PendingRound(chain_round_copies(out, loc, return_logprob, top_logprobs_num,
                                           vocab_size), on_current_stream=on_current_stream)
