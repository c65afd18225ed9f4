"""NEXTN (MTP) speculative decoding: the draft -> verify -> draft-extend relay of one round.

Chain layout and acceptance are in :mod:`sglang.srt.rounds.chain`; the verify step is
:mod:`sglang.srt.rounds.chain_verify`'s. With
``N = --speculative-num-draft-tokens`` (``= num_steps + 1``) and ``P`` committed tokens, a round
over a batch of requests:

1. **Draft.** Chain position 0 is the seed (the last committed token; its KV is written by this
   round), position 1 the draft the previous round's extend already picked. The MTP layer then
   runs autoregressively on its own hidden states: forward ``j = 1 .. N-2`` feeds ``(g, d_j)`` at
   position ``P + j - 1`` (standing in for the target's unknown hidden state there) and picks
   ``d_{j+1}``. So ``N - 1`` draft tokens cost ``N - 2`` one-token forwards; their MTP cache
   entries are provisional and rewritten in step 3.
2. **Verify.** One ``TARGET_VERIFY`` target forward over the ``N`` chain positions (KDA states are
   staged, not committed) with every hidden state captured; acceptance on the device (greedy:
   target argmax; sampled: exact rejection sampling against the distribution each draft was drawn
   from, both under the request's sampling transform at that position). Then the KDA commit of
   position ``accept_len - 1``, the new lengths and seeds into the relay, and the accepted tokens
   into the sampling history.
3. **Draft extend.** The MTP layer over the same fixed ``N`` rows per request with the target's
   real hidden states and the committed tokens (``DRAFT_EXTEND``): it overwrites the MTP cache of
   the accepted positions, and its row ``accept_len - 1`` gives the next round's first draft and
   draft hidden state.

Every accept-dependent value (lengths, seeds, the KDA commit index, positions, req->token writes)
stays a device tensor, relayed from round to round by the worker's
:class:`~sglang.srt.rounds.relay.FutureMap` (``tokens`` = the seed, ``seq_lens`` = the
committed length, and the payload ``draft_token`` / ``hidden`` / ``draft_probs``: the first draft
of the next chain, the draft hidden state that continues it, and the distribution that draft was
sampled from). The host gets the accept lengths, committed tokens and the round's KV slots through
a :class:`~sglang.srt.rounds.relay.PendingRound` that it waits on one round later.

The round itself (:meth:`NEXTNWorker.round_phases`: draft, verify, draft extend) is fixed-shape
device work over its inputs, so a CUDA graph can capture it whole (or one graph per phase).

After a prefill (or any prefill chunk) the MTP layer runs over the chunk with the pairs
``(h_t, x_{t+1})``; the last pair of a completed prompt uses the sampled first token, and its
output is the first draft.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import last_token_indices
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.rounds.chain import build_verify_forward_batch, sample_from_probs
from sglang.srt.rounds.chain_sampling import (
    chain_uniforms,
    draft_lane,
    expand_for_chain,
    processed_logits,
    transformed_probs,
)
from sglang.srt.rounds.chain_verify import chain_pending_round, verify_chain
from sglang.srt.rounds.contract import BaseSpecWorker, SpecRequirements
from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker
from sglang.srt.rounds.relay import FutureMap, PendingRound, host_to_device
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

__all__ = ["NEXTNWorker", "nextn_draft_model_config", "nextn_request_slot_state",
           "nextn_token_headroom"]


def nextn_token_headroom(num_draft_tokens: int) -> int:
    """Tokens a NEXTN request may hold beyond ``prompt + max_new_tokens``: two chains.

    The host learns a round's outcome one round late, so when it sees a request finish, the
    device has already committed up to ``N - 1`` tokens past the finish point and launched one
    more round of ``N`` chain slots. KV-slot reservations and the request->token map's width
    (and so the largest position RoPE sees) carry this much slack.
    """
    return 2 * int(num_draft_tokens)


def nextn_draft_model_config(server_args: Any, target_config: ModelConfig) -> ModelConfig:
    """The draft's config: ``--speculative-draft-model-path``, else the target checkpoint (whose
    MTP layer is the draft, with the same ``--json-model-override-args``). Raises ``ValueError``
    when it has no MTP layer or does not fit the target."""
    path = server_args.speculative_draft_model_path
    if path:
        cfg = ModelConfig.from_path(path)
        where = f"--speculative-draft-model-path {path!r}"
    else:
        cfg = ModelConfig.from_path(server_args.model_path, server_args.json_model_override_args)
        where = f"the target checkpoint {cfg.model_path!r}"
    if cfg.hf_config.num_nextn_predict_layers < 1:
        raise ValueError(
            f"--speculative-algorithm NEXTN: {where} has no MTP layer (num_nextn_predict_layers "
            "= 0), so there is no NEXTN draft; use a checkpoint with an MTP layer or pass "
            "--speculative-draft-model-path")
    t, d = target_config.hf_config, cfg.hf_config
    for name in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if getattr(t, name) != getattr(d, name):
            raise ValueError(f"--speculative-draft-model-path: the draft's {name} "
                             f"{getattr(d, name)} differs from the target's {getattr(t, name)}")
    return cfg


def nextn_request_slot_state(draft_config: ModelConfig, num_draft_tokens: int
                             ) -> Tuple[int, int]:
    """What :class:`NEXTNWorker` keeps per request slot, as ``(elements in the target's dtype,
    bytes)``: the relay's draft hidden state (``hidden_size`` elements), its next draft token
    (int64) and the distribution that draft came from (``vocab_size`` fp32, allocated once a
    sampled request runs), and the chain buffer's row (``N`` int64)."""
    cfg = draft_config.hf_config
    return cfg.hidden_size, 8 + 4 * cfg.vocab_size + 8 * int(num_draft_tokens)


class NEXTNWorker(BaseSpecWorker):
    """Owns the draft runner (the MTP layer over the target's pools) and runs NEXTN rounds."""

    @classmethod
    def requirements(cls, server_args: Any, target_config: ModelConfig) -> SpecRequirements:
        """The chain's KV slots and KDA scratch (``N`` positions), two chains of headroom (see
        :func:`nextn_token_headroom`), the MTP layer's latent cache in the target's MLA pool,
        its weights loading after the pools, and this worker's per-slot relay and chain buffer
        (:func:`nextn_request_slot_state`)."""
        n = int(server_args.speculative_num_draft_tokens)
        draft = nextn_draft_model_config(server_args, target_config)
        elems, nbytes = nextn_request_slot_state(draft, n)
        return SpecRequirements(
            kda_scratch_depth=n, position_headroom=nextn_token_headroom(n),
            token_headroom=nextn_token_headroom(n), draft_extra_mla_layers=True,
            draft_model_config=draft, draft_elems_per_request_slot=elems,
            draft_bytes_per_request_slot=nbytes)

    def __init__(self, server_args: Any, target_worker: TpModelWorker,
                 requirements: Optional[SpecRequirements] = None):
        n = server_args.speculative_num_draft_tokens
        if server_args.speculative_eagle_topk != 1 or n != server_args.speculative_num_steps + 1:
            raise ValueError("NEXTNWorker drafts a chain: needs --speculative-eagle-topk 1 and "
                             "--speculative-num-draft-tokens = --speculative-num-steps + 1")
        self.target_worker = target_worker
        self.target_runner: ModelRunner = target_worker.model_runner
        if self.target_runner.spec_num_draft_tokens != n:
            raise ValueError(f"the target runner was built for {self.target_runner.spec_num_draft_tokens}"
                             f" draft tokens, the worker needs {n}")
        self.num_steps = server_args.speculative_num_steps
        self.num_draft_tokens = n
        self.device = self.target_runner.device
        self.vocab_size = self.target_runner.model_config.vocab_size
        cfg = requirements.draft_model_config if requirements is not None else None
        cfg = cfg or nextn_draft_model_config(server_args, target_worker.model_config)
        t = self.target_runner
        self.draft_runner = ModelRunner(
            cfg, device=t.device, dtype=t.dtype, tp_rank=t.tp_rank, tp_size=t.tp_size,
            load_format=server_args.load_format, attention_backend=server_args.attention_backend,
            kda_prefill_impl=server_args.kda_prefill_impl,
            linear_attn_decode_backend=server_args.linear_attn_decode_backend,
            moe_runner_backend=server_args.moe_runner_backend, random_seed=server_args.random_seed,
            # The target's forced choices, unresolved: the draft's quantization may differ.
            kernel_choices=t.requested_kernel_choices,
            enable_deterministic_inference=t.enable_deterministic_inference,
            is_draft=True, req_to_token_pool=t.req_to_token_pool,
            token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
            token_to_kv_pool=t.token_to_kv_pool,
            # --speculative-draft-model-quantization, else the target's (upstream's rule).
            quantization=(server_args.speculative_draft_model_quantization
                          or server_args.quantization))
        self.draft_runner.model.set_embed_and_head(*t.model.get_embed_and_head())
        max_bs = t.req_to_token_pool.size
        # The relay: tokens = the seed, seq_lens = committed tokens; draft_probs (sampled rows
        # only) starts uniform so that even a never-written slot holds a valid distribution.
        self.future_map = FutureMap(
            max_bs, self.device,
            payload={"draft_token": ((), torch.int64),
                     "hidden": ((cfg.hf_config.hidden_size,), t.dtype),
                     "draft_probs": ((self.vocab_size,), torch.float32)},
            lazy={"draft_probs": 1.0 / self.vocab_size})
        # Persistent chain buffer (fixed width N; a round of B requests uses rows 0..B-1).
        self._chain_tokens = torch.zeros(max_bs, n, dtype=torch.int64, device=self.device)
        logger.info("NEXTN: draft = MTP layer %d of %s, %d steps, %d draft tokens",
                    cfg.hf_config.mtp_layer_id, cfg.model_path, self.num_steps, n)

    @property
    def round_tokens(self) -> int:
        """The chain width ``N``: every request of a round gets ``N`` KV slots."""
        return self.num_draft_tokens

    @property
    def proposed_per_round(self) -> int:
        """``N - 1`` drafts per request per round."""
        return self.num_draft_tokens - 1

    # ------------------------------------------------------------------ prefill
    def prefill(
        self,
        forward_batch: ForwardBatch,
        sampling_info: Optional[SamplingBatchInfo],
        sample_rows: Optional[Sequence[int]] = None,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[Sequence[int]] = None,
        next_prompt_tokens: Optional[Sequence[int]] = None,
    ) -> GenerationBatchResult:
        """Target prefill (or chunk) + sampling, then the draft extend over the same tokens.

        ``next_prompt_tokens[b]``: the prompt token after request ``b``'s chunk, or ``-1`` when
        the chunk completes the prompt (then the sampled first token follows). Sampled rows get
        their first draft in the future map. The sampling history of the sampled rows is advanced
        on the device here (in speculative mode the worker owns it).
        """
        if forward_batch.forward_mode != ForwardMode.EXTEND:
            raise ValueError(f"NEXTNWorker.prefill runs prefills; got "
                             f"{forward_batch.forward_mode.name}")
        b = forward_batch.batch_size
        if next_prompt_tokens is None or len(next_prompt_tokens) != b:
            raise ValueError(f"next_prompt_tokens needs one entry per request ({b})")
        forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        result = self.target_worker.forward_batch_generation(
            forward_batch, sampling_info, sample_rows, return_logprob, top_logprobs_nums)
        rows = list(range(b)) if sample_rows is None else list(sample_rows)
        next_ids = result.next_token_ids
        if sampling_info is not None and next_ids is not None:
            sampling_info.append_tokens(next_ids)

        # MTP over the chunk: row t pairs the target's h_t with token t + 1.
        ids = forward_batch.input_ids
        shifted = torch.empty_like(ids)
        shifted[:-1] = ids[1:]
        tail = host_to_device([max(int(t), 0) for t in next_prompt_tokens], self.device,
                              ids.dtype)
        sel = host_to_device(rows, self.device)
        if next_ids is not None and rows:
            tail[sel] = next_ids.to(tail.dtype)
        shifted[last_token_indices(forward_batch)] = tail
        draft_batch = dataclasses.replace(
            forward_batch, forward_mode=ForwardMode.DRAFT_EXTEND, input_ids=shifted,
            return_full_logits=False, capture_hidden_mode=CaptureHiddenMode.LAST,
            spec_info=None, attn_metadata=None)
        out = self.draft_runner.forward(draft_batch,
                                        hidden_states=result.logits_output.hidden_states)
        if next_ids is None or not rows:
            return result
        draft, probs = self._pick_draft(out.next_token_logits[sel], sampling_info, None, 0)
        self.future_map.scatter(forward_batch.req_pool_indices[sel],
                                seq_lens=forward_batch.seq_lens[sel], tokens=next_ids,
                                draft_token=draft, hidden=out.hidden_states[sel],
                                draft_probs=probs)
        return result

    def prefill_graph_plan(self) -> List[Tuple[ModelRunner, Dict[str, Any]]]:
        """The prefill above as two graphs: the target's forward returning every prompt row's
        hidden state, and the MTP layer's extend over them (its per-token input), its last
        row's logits and hidden state."""
        hidden = self.target_runner.model_config.hf_config.hidden_size
        return [(self.target_runner, dict(capture_modes=(CaptureHiddenMode.FULL,))),
                (self.draft_runner, dict(
                    capture_modes=(CaptureHiddenMode.LAST,),
                    forward_mode=ForwardMode.DRAFT_EXTEND,
                    token_inputs={"hidden_states": ((hidden,), self.target_runner.dtype)}))]

    # ------------------------------------------------------------------ decode round
    def graph_setup(self) -> dict:
        """The whole round in one graph: the draft's decodes, the target's ``N``-token verify
        with acceptance and KDA commit, and the draft extend."""
        return dict(tokens_per_request=self.num_draft_tokens,
                    backends=[self.target_runner.attn_backend, self.draft_runner.attn_backend],
                    runners=[self.target_runner, self.draft_runner])

    def round_phases(self) -> List[Any]:
        """The round as three phases (each fixed-shape device work without host reads; a CUDA
        graph captures the three together, or one each): draft, verify, draft extend. Every
        output is batch-major (first dim = request). The verify's outputs are the round's:
        ``accept_len [B]``, ``tokens [B, N]`` (committed, then -1) and, with logprobs, the
        log-softmax source ``lp_source [B, N, V]``."""
        return [self._draft_phase, self._verify_phase, self._extend_phase]

    def _draft_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor, loc: torch.Tensor,
                     info: SamplingBatchInfo, seq_lens_bound: int,
                     return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Gather the relay, place the chain's KV slots, draft the chain ``[B, N]``."""
        sampled = not info.is_all_greedy
        prefix, seed = self.future_map.assign_round(
            self.target_runner.req_to_token_pool.req_to_token, slots, loc, with_tokens=True)
        names = ("draft_token", "hidden") + (("draft_probs",) if sampled else ())
        first_draft, hidden, *probs = self.future_map.gather(slots, *names)
        chain, draft_probs = self._draft(slots, loc, prefix, seed, first_draft, hidden,
                                         probs[0] if probs else None, info, seq_lens_bound)
        out = {"chain": chain, "prefix": prefix}
        if draft_probs:
            out["draft_probs"] = torch.stack(draft_probs, dim=1)  # [B, N - 1, V]
        return out

    def _verify_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                      loc: torch.Tensor, info: SamplingBatchInfo, seq_lens_bound: int,
                      return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Target verify of the chain with acceptance and commit (:func:`verify_chain`)."""
        v = verify_chain(self.target_runner, self.future_map, prev["chain"], prev["prefix"],
                         slots, loc, info, seq_lens_bound, return_logprob,
                         prev.get("draft_probs"))
        out = {"accept_len": v.verdict.accept_len, "tokens": v.verdict.accepted_tokens,
               "committed": v.committed, "last_index": v.layout.last_accepted_index,
               "target_hidden": v.target_hidden}
        if v.lp_source is not None:
            out["lp_source"] = v.lp_source
        return out

    def _extend_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                      loc: torch.Tensor, info: SamplingBatchInfo, seq_lens_bound: int,
                      return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Draft extend over the chain with the target's hidden states: the next round's first
        draft and draft hidden state into the relay."""
        chain = prev["chain"]
        b, n = chain.shape
        verify_batch = build_verify_forward_batch(chain, slots, prev["prefix"], loc,
                                                  seq_lens_upper_bound=seq_lens_bound)
        last_row = torch.arange(b, device=chain.device) * n + prev["last_index"]
        self._draft_extend(verify_batch, prev["committed"], prev["target_hidden"].reshape(b * n, -1),
                           last_row, slots, info)
        return {}

    def pending_round(self, out: Dict[str, torch.Tensor], loc: torch.Tensor,
                      return_logprob: bool, top_logprobs_num: int,
                      on_current_stream: bool = False) -> PendingRound:
        """Start the host copies of a round's outputs (:func:`chain_pending_round`)."""
        return chain_pending_round(out, loc, return_logprob, top_logprobs_num, self.vocab_size,
                                   on_current_stream)

    def _draft(self, slots: torch.Tensor, loc: torch.Tensor, prefix: torch.Tensor,
               seed: torch.Tensor, first_draft: torch.Tensor, hidden: torch.Tensor,
               first_probs: Optional[torch.Tensor], info: SamplingBatchInfo,
               seq_lens_bound: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The chain ``[B, N]`` and the distributions drafts 1..N-1 were drawn from (sampled
        batches only)."""
        n, b = self.num_draft_tokens, int(slots.shape[0])
        tokens = self._chain_tokens[:b]
        tokens[:, 0] = seed
        tokens[:, 1] = first_draft
        draft_probs = [first_probs] if first_probs is not None else []
        for pos in range(1, n - 1):
            # MTP at sequence position P + pos - 1 (chain slot pos - 1) reads d_pos.
            fb = ForwardBatch.for_decode(tokens[:, pos].contiguous(), slots,
                                         prefix + pos, loc[:, pos - 1],
                                         capture_hidden_mode=CaptureHiddenMode.LAST,
                                         seq_lens_upper_bound=seq_lens_bound)
            out = self.draft_runner.forward(fb, hidden_states=hidden)
            hidden = out.hidden_states
            token, probs = self._pick_draft(out.next_token_logits, info, tokens[:, 1:], pos)
            tokens[:, pos + 1] = token
            if probs is not None:
                draft_probs.append(probs)
        return tokens, draft_probs

    def _draft_extend(self, verify_batch: ForwardBatch, committed: torch.Tensor,
                      target_hidden: torch.Tensor, last_row: torch.Tensor, slots: torch.Tensor,
                      info: SamplingBatchInfo) -> None:
        """MTP over the chain with the target's hidden states (fixed N rows per request); the
        row of the last accepted position seeds the next round."""
        extend_batch = dataclasses.replace(
            verify_batch, forward_mode=ForwardMode.DRAFT_EXTEND, input_ids=committed.reshape(-1),
            attn_metadata=None)
        out = self.draft_runner.forward(extend_batch, hidden_states=target_hidden)
        # info already holds the committed tokens, so this is chain position 0 of next round.
        draft, probs = self._pick_draft(out.next_token_logits[last_row], info, None, 0)
        self.future_map.scatter(slots, draft_token=draft, hidden=out.hidden_states[last_row],
                                draft_probs=probs)

    # ------------------------------------------------------------------ token choices
    def _pick_draft(self, logits: torch.Tensor, info: SamplingBatchInfo,
                    history: Optional[torch.Tensor], pos: int
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The draft for chain position ``pos + 1`` from draft logits ``[B, V]`` that follow
        chain position ``pos`` (``history [B, >= pos]`` = drafts 1..pos). Greedy rows take the
        argmax of the transformed logits; sampled rows draw from the transformed distribution,
        which is returned for the rejection test (``None`` for all-greedy batches)."""
        rows_info = expand_for_chain(info, history, 1, start=pos)
        processed = processed_logits(logits, rows_info)
        greedy = processed.argmax(dim=-1)
        if info.is_all_greedy:
            return greedy, None
        probs = transformed_probs(processed, rows_info)
        u = chain_uniforms(info, draft_lane(self.num_draft_tokens, pos + 1))[:, 0]
        return torch.where(info.greedy_mask, greedy, sample_from_probs(probs, u)), probs
