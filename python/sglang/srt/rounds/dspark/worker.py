"""DSpark speculative decoding (``--speculative-algorithm DSPARK``): block draft -> plan ->
verify -> context write.

With ``g`` = gamma (``--speculative-dspark-block-size``, default the draft checkpoint's
``block_size``) and ``P`` committed tokens of a request whose *anchor* (the last committed token,
KV not written yet) sits at position ``P``, a round is:

1. **Draft.** The draft's parallel backbone over ``[anchor, MASK x (g-1)]`` at positions
   ``P .. P+g-1``, attending to the context K/V of positions ``0 .. P-1``
   (:meth:`DSparkDraftModel.forward_block`); then the sequential Markov loop picks ``d_1 .. d_g``
   through the request's sampling transform at each chain position (penalties, bias, temperature,
   top-k/p, min-p: the distribution plain decoding would use there, under which verification is
   exact), and, when a planner is configured, the confidence head.
2. **Plan.** Verify lengths ``l`` in ``0 .. g`` per request (:mod:`.planner`). Without
   ``--speculative-dspark-sps-table-path`` every draft is verified (``l = g``). With a table and
   ``--disable-overlap-schedule``: greedy admission with early stop on this round's confidences.
   With the overlap schedule: a token budget from the request's confidences *two rounds old*
   (relayed in the future map; unconstrained search), then the budget's best candidates by this
   round's confidences (top-K), as the paper's production scheduler does.
3. **Verify.** One ``TARGET_VERIFY`` target forward over the fixed window
   ``[anchor, d_1 .. d_g]`` (``g + 1`` tokens, KDA states staged) that also returns the target's
   hidden states after the draft's ``target_layer_ids``; acceptance by
   :func:`~sglang.srt.rounds.dspark.verify.verify_block` capped at ``l`` (greedy rows by
   argmax match, sampled rows by exact rejection sampling against the Markov-corrected draft
   distribution); the KDA commit of window index ``accept_len - 1``; the next anchor (the bonus /
   residual token) and the committed length into the relay; the committed tokens into the
   sampling history.
4. **Context.** The context K/V of the committed window positions (anchor + accepted drafts,
   ``accept_len`` rows) from the verify's hidden states: all ``g + 1`` rows are written, the
   rejected ones into the padding slot (:mod:`.paged_context`).

After a prefill (or each prefill chunk) the prompt tokens' hidden states become context.

What the plan buys (``--speculative-dspark-verify-mode``, :mod:`.args`):
with ``cap-accept`` (the default with a table) the verify window keeps the block's width, so a
round is one fixed-shape device program (capturable in a CUDA graph, no host reads): ``l`` caps
acceptance but does not shrink the target forward, so the table changes which tokens a round
commits (never their distribution), not its cost. ``compact`` shrinks the forward too: the
round's width must be known on the host before it is enqueued, and under overlap the host knows
the lagged planner's budget for round ``k + 1`` when it launches it (the budget comes from
round ``k - 1``'s confidences, and round ``k - 1`` has been consumed), so each round verifies
the smallest tier of :func:`~.planner.verify_tiers` that holds it — one CUDA graph per
tier — with every verify length capped at the tier (a constant of the round, so admission stays
exact). ``static`` (the default without a table) verifies every draft.

Memory: the draft's weights and its context store (one K/V row per draft layer for every KV
slot of the target's pool, :class:`PagedDSparkContext`) are allocated after the target's pools;
the target's memory plan reserves both (``SpecRequirements.draft_weight_elems`` and
``draft_elems_per_kv_slot``).

Every accept-dependent value stays on the device (:class:`FutureMap`: ``tokens`` = the anchor,
``seq_lens`` = committed tokens, payload ``conf_lag1`` / ``conf_lag2`` = the last two rounds'
confidence logits when the lagged planner runs); the host gets the accept lengths, committed
tokens and the planned lengths through a :class:`PendingRound` one round later.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.dspark import DSparkDraftModel, MarkovDraft, load_dspark_draft
from sglang.srt.rounds.chain import build_verify_forward_batch, sample_from_probs
from sglang.srt.rounds.chain_sampling import (
    chain_uniforms,
    draft_lane,
    expand_for_chain,
    processed_logits,
    transformed_probs,
    verify_lanes,
)
from sglang.srt.rounds.chain_verify import chain_round_copies, commit_chain, logprob_source
from sglang.srt.rounds.contract import BaseSpecWorker, SpecRequirements
from sglang.srt.rounds.dspark.args import resolve_verify_mode
from sglang.srt.rounds.dspark.paged_context import PagedDSparkContext
from sglang.srt.rounds.dspark.planner import DSparkPlanner, tier_for_budget, verify_tiers
from sglang.srt.rounds.dspark.setup import dspark_setup
from sglang.srt.rounds.dspark.verify import DSparkVerifyResult, verify_block
from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker
from sglang.srt.rounds.relay import FutureMap, PendingRound, RoundOutput, host_to_device
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

__all__ = ["DSparkWorker"]

# Confidence logit a request starts with in the lagged planner's relay (sigmoid ~ 1): before it
# has two rounds of history its budget assumes every draft survives. Any value works for
# losslessness; it only has to be independent of the current drafts.
_LAG_INIT_LOGIT = 20.0
class _RoundStats:
    """Host-side DSpark counters, fed by each round's host copies (one round late)."""

    def __init__(self) -> None:
        self.request_rounds = 0  # (request, round) pairs launched
        self.planned_drafts = 0  # sum of planned verify lengths
        self.correct_drafts = 0  # accepted drafts (accept_len - 1)

    def add(self, verify_lens: Sequence[int], accept_lens: Sequence[int]) -> None:
        """Count one round."""
        self.request_rounds += len(accept_lens)
        self.planned_drafts += sum(verify_lens)
        self.correct_drafts += sum(a - 1 for a in accept_lens)


class _DSparkPendingRound(PendingRound):
    """A :class:`PendingRound` whose output also has the round's planned verify lengths
    (``RoundOutput.cap_lens``, read with its other host copies), counted into the stats."""

    def __init__(self, tensors: Dict[str, torch.Tensor], stats: _RoundStats,
                 on_current_stream: bool = False, on_budget_hint=None):
        super().__init__(tensors, on_current_stream)
        self._stats: Optional[_RoundStats] = stats
        self._on_budget_hint = on_budget_hint

    def wait(self) -> RoundOutput:
        """As :meth:`PendingRound.wait`, with ``cap_lens``; the first call updates the stats
        (and hands a compact round's budget hint to the worker)."""
        out = super().wait()
        host = self.host_copy.wait()
        out.cap_lens = host["verify_len"].tolist()
        if self._stats is not None:
            self._stats.add(out.cap_lens, out.accept_lens)
            self._stats = None
            if self._on_budget_hint is not None and "budget_hint" in host:
                self._on_budget_hint(int(host["budget_hint"][0]))
        return out


class DSparkWorker(BaseSpecWorker):
    """Owns the DSpark draft (beside the target's pools) and runs DSpark rounds."""

    @classmethod
    def requirements(cls, server_args: Any, target_config: ModelConfig) -> SpecRequirements:
        """``g + 1`` KV slots and KDA scratch positions per round; two windows of headroom (the
        host sees a finish one round late, after the device committed up to ``g + 1`` tokens
        past it and launched one more round). The draft has no MLA layer; its weights, its
        context store and the relay's per-slot confidences are allocated after the target's
        pools, which reserve room for them."""
        setup = dspark_setup(server_args, target_config)
        n = setup.gamma + 1
        cfg = setup.config
        with torch.device("meta"):  # shapes only: count the weights without allocating them
            weights = sum(p.numel() for p in DSparkDraftModel(cfg).parameters())
        return SpecRequirements(
            kda_scratch_depth=n, position_headroom=2 * n, token_headroom=2 * n,
            draft_extra_mla_layers=False, draft_weight_elems=weights,
            # PagedDSparkContext: K and V per draft layer for every target KV slot.
            draft_elems_per_kv_slot=2 * cfg.num_hidden_layers * cfg.num_key_value_heads
            * cfg.head_dim,
            # The lagged planner's relay: two rounds of g fp32 confidences per request slot
            # (counted whether or not that planner runs: it is decided after the pools).
            draft_bytes_per_request_slot=2 * setup.gamma * 4)

    def __init__(self, server_args: Any, target_worker: TpModelWorker,
                 requirements: Optional[SpecRequirements] = None):
        setup = dspark_setup(server_args, target_worker.model_config)
        self.setup = setup
        self.gamma = setup.gamma
        self.target_worker = target_worker
        self.target_runner: ModelRunner = target_worker.model_runner
        t = self.target_runner
        if t.spec_num_draft_tokens != self.gamma + 1:
            raise ValueError(f"the target runner was built for {t.spec_num_draft_tokens} draft "
                             f"tokens, DSPARK with block size {self.gamma} needs {self.gamma + 1}")
        self.device = t.device
        self.vocab_size = t.model_config.vocab_size
        self.draft: DSparkDraftModel = load_dspark_draft(
            setup.draft_path, t.hf_config, dtype=t.dtype, device=t.device,
            load_format=server_args.load_format, block_size=self.gamma,
            seed=server_args.random_seed or 0)
        self.draft.set_embed_and_head(*t.model.get_embed_and_head())
        # Before any graph capture: the layers are part of the traced target forward.
        t.model.set_dspark_layers_to_capture(setup.config.target_layer_ids)
        pool = t.req_to_token_pool
        for module in self.draft.modules():  # positions reach into the speculative headroom
            if isinstance(module, RotaryEmbedding):
                module.cos_sin_cache(self.device, pool.max_context_len)
        cfg = setup.config
        self.context = PagedDSparkContext(
            pool.req_to_token, t.token_to_kv_pool.size, cfg.num_hidden_layers,
            cfg.num_key_value_heads, cfg.head_dim, t.dtype, self.device)
        self.overlap = not getattr(server_args, "disable_overlap_schedule", False)
        self.verify_mode = resolve_verify_mode(
            getattr(server_args, "speculative_dspark_verify_mode", None),
            setup.sps_table is not None, self.overlap)
        self.planner = None if self.verify_mode == "static" else DSparkPlanner(
            self.gamma, setup.sps_table, setup.sts_temperatures, self.device)
        # compact: drafts verified per request this round (a tier, host-chosen from the budget
        # hint of the latest round consumed); otherwise always the whole block.
        self.tiers = verify_tiers(self.gamma) if self.verify_mode == "compact" else [self.gamma]
        self.verify_drafts = self.gamma
        self._budget_hint: Optional[int] = None
        lagged = self.planner is not None and self.overlap
        payload = {f"conf_lag{i}": ((self.gamma,), torch.float32) for i in (1, 2)} if lagged \
            else {}
        self.future_map = FutureMap(pool.size, self.device, payload=payload,
                                    lazy={name: _LAG_INIT_LOGIT for name in payload})
        self.stats = _RoundStats()
        logger.info("DSPARK: draft %s (%d layers), block size %d, verify window %s, planner %s "
                    "(%s), context store %.1f MiB", setup.draft_path, cfg.num_hidden_layers,
                    self.gamma, "/".join(str(t + 1) for t in self.tiers), self.planner_mode,
                    self.verify_mode, self.context.nbytes / 2**20)

    @property
    def round_tokens(self) -> int:
        """The verify window ``g + 1``: every request of a round gets that many KV slots."""
        return self.gamma + 1

    @property
    def proposed_per_round(self) -> int:
        """``g`` drafts per request per round."""
        return self.gamma

    @property
    def planner_mode(self) -> str:
        """``verify-all`` (no SPS table), ``early-stop`` or ``lagged-top-k`` (overlap)."""
        if self.planner is None:
            return "verify-all"
        return "lagged-top-k" if self.overlap else "early-stop"

    def next_round_shape(self) -> Optional[int]:
        """compact: the drafts per request the next round verifies, the smallest tier that
        holds the planner's budget for it. That budget comes from the confidences of the round
        two launches earlier, which the host has consumed when it launches this one (the overlap
        schedule), so the choice reads nothing from the device; before any hint, the block."""
        if self.verify_mode != "compact":
            return None
        return tier_for_budget(self.tiers, self._budget_hint)

    def apply_round_shape(self, shape: Optional[int]) -> None:
        """Verify ``shape`` drafts per request (None: the block)."""
        self.verify_drafts = self.gamma if shape is None else int(shape)

    def _set_budget_hint(self, budget: int) -> None:
        self._budget_hint = budget

    def internal_state(self) -> Dict[str, Any]:
        """DSpark entries for ``/server_info``'s ``internal_states``: counters since start over
        every (request, round) pair launched (a round launched after its request finished
        included), so the averages are the planner's and the draft's, not the output's."""
        s = self.stats
        return {
            "speculative_dspark_block_size": self.gamma,
            "speculative_num_draft_tokens": self.gamma + 1,
            "dspark_planner": self.planner_mode,
            "dspark_verify_mode": self.verify_mode,
            "dspark_num_verify_reqs": s.request_rounds,
            "dspark_avg_planned_verify_len": s.planned_drafts / max(s.request_rounds, 1),
            "dspark_avg_correct_drafts": s.correct_drafts / max(s.request_rounds, 1),
        }

    # ------------------------------------------------------------------ prefill
    def prefill_graph_plan(self) -> List[Tuple[ModelRunner, Dict[str, Any]]]:
        """The target's prefill as the plain worker's: the draft's context comes from the
        target layers' hidden states, which the model returns per token in any mode."""
        return self.target_worker.prefill_graph_plan()

    def prefill(self, forward_batch: ForwardBatch, sampling_info: Optional[SamplingBatchInfo],
                sample_rows: Optional[Sequence[int]] = None, return_logprob: bool = False,
                top_logprobs_nums: Optional[Sequence[int]] = None,
                next_prompt_tokens: Optional[Sequence[int]] = None) -> GenerationBatchResult:
        """Target prefill (or chunk) + sampling; the chunk's hidden states become the draft's
        context; sampled rows get their first anchor and length in the relay (and their
        sampling history advanced: in speculative mode the worker owns it).
        ``next_prompt_tokens`` is not needed (the draft pairs no token with a hidden state)."""
        if forward_batch.forward_mode != ForwardMode.EXTEND:
            raise ValueError(f"DSparkWorker.prefill runs prefills; got "
                             f"{forward_batch.forward_mode.name}")
        result = self.target_worker.forward_batch_generation(
            forward_batch, sampling_info, sample_rows, return_logprob, top_logprobs_nums)
        aux = result.logits_output.aux_hidden_states
        if aux is None:
            raise RuntimeError("DSPARK: the target returned no hidden states of the draft's "
                               "target layers (set_dspark_layers_to_capture was undone)")
        token_slots = torch.repeat_interleave(
            forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
            output_size=forward_batch.num_tokens)
        with torch.no_grad():
            self.draft.write_context(aux, forward_batch.positions, token_slots, self.context)
        next_ids = result.next_token_ids
        if next_ids is None or next_ids.numel() == 0:
            return result
        slots, lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        if sample_rows is not None:
            sel = host_to_device(list(sample_rows), self.device)
            slots, lens = slots[sel], lens[sel]
        lags = {name: torch.full((slots.shape[0], self.gamma), _LAG_INIT_LOGIT,
                                 device=self.device) for name in ("conf_lag1", "conf_lag2")
                } if self.planner_mode == "lagged-top-k" else {}
        self.future_map.scatter(slots, tokens=next_ids, seq_lens=lens, **lags)
        if sampling_info is not None:
            sampling_info.append_tokens(next_ids)
        return result

    # ------------------------------------------------------------------ decode round
    def graph_setup(self) -> dict:
        """The whole round in one graph (or one per phase). The context store counts as a
        width-dependent backend: the draft reads as many context rows as the round's bound."""
        return dict(tokens_per_request=self.round_tokens,
                    backends=[self.target_runner.attn_backend, self.context],
                    runners=[self.target_runner])

    def round_phases(self) -> List[Any]:
        """Draft (with the plan), verify, context write: fixed-shape device work without host
        reads, batch-major outputs. The round's outputs: ``accept_len [B]``, ``tokens [B, g+1]``
        (committed, then -1), ``verify_len [B]`` and, with logprobs, ``lp_source [B, g+1, V]``."""
        return [self._draft_phase, self._verify_phase, self._context_phase]

    def _draft_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor, loc: torch.Tensor,
                     info: SamplingBatchInfo, seq_lens_bound: int,
                     return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Gather the relay, place the window's KV slots, draft the block, plan."""
        prefix, anchor = self.future_map.assign_round(
            self.target_runner.req_to_token_pool.req_to_token, slots, loc, with_tokens=True)
        width = min(int(seq_lens_bound), self.context.max_context)
        with torch.no_grad():
            h, base = self.draft.forward_block(anchor, prefix, self.context, slots, prefix, width)
            history = torch.zeros(slots.shape[0], self.gamma, dtype=torch.int64,
                                  device=self.device)
            draft = self.draft.markov_draft(base, anchor, pick=self._picker(info, history))
            verify_len, hint = self._plan(slots, h, draft)
        out = {"prefix": prefix, "anchor": anchor, "drafts": draft.tokens,
               "verify_len": verify_len}
        if hint is not None:
            out["budget_hint"] = hint
        if draft.probs is not None:
            out["draft_probs"] = draft.probs  # [B, g, V]
        return out

    def _verify_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                      loc: torch.Tensor, info: SamplingBatchInfo, seq_lens_bound: int,
                      return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Target verify of the window, capped acceptance, KDA commit, the relay's new lengths
        and anchors, the committed tokens into the sampling history. The window is the anchor
        and the round's first :attr:`verify_drafts` drafts (the block unless compact); outputs
        keep the block's width, padded."""
        d = self.verify_drafts
        drafts, prefix = prev["drafts"][:, :d], prev["prefix"]
        window = torch.cat([prev["anchor"].unsqueeze(1), drafts], dim=1)  # [B, d + 1]
        b, n = window.shape
        loc = loc[:, :n]
        batch = build_verify_forward_batch(window, slots, prefix, loc,
                                           capture_hidden_mode=CaptureHiddenMode.NULL,
                                           seq_lens_upper_bound=seq_lens_bound)
        target_out = self.target_runner.forward(batch)
        draft_probs = prev.get("draft_probs")
        verdict, processed, rows_info = self._verify(
            target_out.next_token_logits, drafts, info,
            None if draft_probs is None else draft_probs[:, :d], prev["verify_len"])
        commit_chain(self.target_runner, self.future_map, verdict, prefix, slots, loc, info)
        pad = self.gamma - d  # compact tiers only: no copy for a full-width window
        tokens = verdict.accepted_tokens
        out = {"accept_len": verdict.accept_len,
               "tokens": torch.nn.functional.pad(tokens, (0, pad), value=-1) if pad else tokens,
               "target_aux": target_out.aux_hidden_states.view(b, n, -1)}
        if return_logprob:
            source = logprob_source(target_out.next_token_logits, processed, rows_info,
                                    self.vocab_size, b, n)
            out["lp_source"] = torch.nn.functional.pad(source, (0, 0, 0, pad)) if pad else source
        return out

    def _context_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                       loc: torch.Tensor, info: SamplingBatchInfo, seq_lens_bound: int,
                       return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Context K/V of the committed window positions (``accept_len`` rows per request);
        the other rows are written into the padding slot, keeping the shape fixed."""
        aux, prefix = prev["target_aux"], prev["prefix"]
        b, n = aux.shape[:2]
        j = torch.arange(n, device=self.device).unsqueeze(0)
        positions = prefix.unsqueeze(1) + j
        keep = j < prev["accept_len"].unsqueeze(1)
        rows = torch.where(keep, slots.unsqueeze(1).expand(b, n), torch.full_like(positions, -1))
        with torch.no_grad():
            self.draft.write_context(aux.reshape(b * n, -1), positions.reshape(-1),
                                     rows.reshape(-1), self.context)
        return {}

    def pending_round(self, out: Dict[str, torch.Tensor], loc: torch.Tensor,
                      return_logprob: bool, top_logprobs_num: int,
                      on_current_stream: bool = False) -> PendingRound:
        """Start the host copies of a round's outputs (logprobs computed here, after the body)."""
        copies = chain_round_copies(out, loc, return_logprob, top_logprobs_num, self.vocab_size)
        copies["verify_len"] = out["verify_len"]
        if "budget_hint" in out:
            copies["budget_hint"] = out["budget_hint"]
        return _DSparkPendingRound(copies, self.stats, on_current_stream=on_current_stream,
                                   on_budget_hint=self._set_budget_hint)

    # ------------------------------------------------------------------ pieces
    def _picker(self, info: SamplingBatchInfo, history: torch.Tensor):
        """The Markov loop's ``pick``: slot ``k``'s Markov-corrected logits follow chain
        position ``k`` (the anchor is position 0, ``history [B, g]`` collects ``d_1 ..``), so
        they get the sampling transform plain decoding would apply after ``d_1 .. d_k``. Greedy
        rows take the argmax; sampled rows draw (seeded rows from their own lane) and return
        the distribution drawn from (``None`` for an all-greedy batch)."""
        n = self.round_tokens

        def pick(k: int, logits: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
            rows_info = expand_for_chain(info, history, 1, start=k)
            processed = processed_logits(logits, rows_info)
            token = processed.argmax(dim=-1)
            probs = None
            if not info.is_all_greedy:
                probs = transformed_probs(processed, rows_info)
                u = chain_uniforms(info, draft_lane(n, k + 1))[:, 0]
                token = torch.where(info.greedy_mask, token, sample_from_probs(probs, u))
            history[:, k] = token
            return token, probs

        return pick

    def _plan(self, slots: torch.Tensor, h: torch.Tensor, draft: MarkovDraft
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Verify lengths ``[B]`` (module docstring, step 2) and, compact, the budget hint
        ``[B]``; padding rows (slot 0) are inactive, so they take no share of the budget.

        compact caps every length at the round's tier, a constant of the round (chosen before
        its drafts existed): the capped length is still decided by drafts up to it, so the
        verdict stays exact. The hint is the budget of the round two launches on, whose lagged
        confidences are this round's."""
        b = slots.shape[0]
        if self.planner is None:
            return torch.full((b,), self.gamma, dtype=torch.int64, device=self.device), None
        conf = self.draft.confidence(h, draft.prev_tokens)  # [B, g] logits
        active = slots != 0
        if not self.overlap:
            return self.planner.plan(conf, active), None
        lag1, lag2 = self.future_map.gather(slots, "conf_lag1", "conf_lag2")
        budget = self.planner.capacity(lag2, active)
        self.future_map.scatter(slots, conf_lag1=conf, conf_lag2=lag1)
        if self.verify_mode != "compact":
            return self.planner.plan_top_k(conf, budget, active), None
        cap = torch.full((b,), self.verify_drafts, dtype=torch.int64, device=self.device)
        hint = self.planner.capacity(conf, active).reshape(1).expand(b).contiguous()
        return self.planner.plan_top_k(conf, budget, active, max_lens=cap), hint

    def _verify(self, logits: torch.Tensor, drafts: torch.Tensor, info: SamplingBatchInfo,
                draft_probs: Optional[torch.Tensor], verify_len: torch.Tensor
                ) -> Tuple[DSparkVerifyResult, torch.Tensor, SamplingBatchInfo]:
        """Capped acceptance per row under the per-position sampling transform; also the
        penalised logits ``[B * (g + 1), V]`` and the per-position sampling rows."""
        b, g = drafts.shape
        n = g + 1
        rows_info = expand_for_chain(info, drafts, n)
        processed = processed_logits(logits, rows_info)
        argmax = processed.argmax(dim=-1).view(b, n)
        if info.is_all_greedy:
            verdict = verify_block(drafts, None, processed.view(b, n, -1), verify_len,
                                   target_argmax=argmax)
        else:
            p = transformed_probs(processed, rows_info).view(b, n, -1)
            verdict = verify_block(drafts, draft_probs, p, verify_len,
                                   uniforms=chain_uniforms(info, verify_lanes(n)),
                                   greedy_mask=info.greedy_mask, target_argmax=argmax)
        return verdict, processed, rows_info
