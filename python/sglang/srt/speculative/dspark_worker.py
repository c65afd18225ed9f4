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
2. **Plan.** Verify lengths ``l`` in ``0 .. g`` per request (:mod:`dspark_planner`). Without
   ``--speculative-dspark-sps-table-path`` every draft is verified (``l = g``). With a table and
   ``--disable-overlap-schedule``: greedy admission with early stop on this round's confidences.
   With the overlap schedule: a token budget from the request's confidences *two rounds old*
   (relayed in the future map; unconstrained search), then the budget's best candidates by this
   round's confidences (top-K), as the paper's production scheduler does.
3. **Verify.** One ``TARGET_VERIFY`` target forward over the fixed window
   ``[anchor, d_1 .. d_g]`` (``g + 1`` tokens, KDA states staged) that also returns the target's
   hidden states after the draft's ``target_layer_ids``; acceptance by
   :func:`~sglang.srt.speculative.dspark_verify.verify_block` capped at ``l`` (greedy rows by
   argmax match, sampled rows by exact rejection sampling against the Markov-corrected draft
   distribution); the KDA commit of window index ``accept_len - 1``; the next anchor (the bonus /
   residual token) and the committed length into the relay; the committed tokens into the
   sampling history.
4. **Context.** The context K/V of the committed window positions (anchor + accepted drafts,
   ``accept_len`` rows) from the verify's hidden states: all ``g + 1`` rows are written, the
   rejected ones into the padding slot (:mod:`dspark_paged_context`).

After a prefill (or each prefill chunk) the prompt tokens' hidden states become context.

What the plan buys here: the verify window keeps its fixed width so that a round is one
fixed-shape device program (capturable in a CUDA graph, no host reads), i.e. upstream's
``cap-accept`` ragged mode: ``l`` caps acceptance but does not shrink the target forward, so an
SPS table changes which tokens a round commits (never their distribution) and not its cost. A
compact verify would need the round's token count on the host before the forward is enqueued;
under overlap the host could only know it from confidences two rounds old, which is why the
budget uses exactly those (here it is computed on the device, from the relay) and the top-K rule
keeps the admission lossless. Without a table nothing is capped.

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
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.dspark import DSparkDraftConfig, find_dspark_draft
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.environ import envs
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.managers.overlap_utils import FutureMap, PendingRound, RoundOutput, host_to_device
from sglang.srt.managers.tp_worker import GenerationBatchResult, TpModelWorker
from sglang.srt.model_executor.cuda_graph_runner import GraphedRoundMixin
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.dspark import DSparkDraftModel, MarkovDraft, load_dspark_draft
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker, SpecRequirements
from sglang.srt.speculative.dspark_paged_context import PagedDSparkContext
from sglang.srt.speculative.dspark_planner import DSparkPlanner
from sglang.srt.speculative.dspark_sps import SPSTable
from sglang.srt.speculative.dspark_sts import load_sts_temperatures
from sglang.srt.speculative.dspark_verify import DSparkVerifyResult, verify_block
from sglang.srt.speculative.spec_sampling import (
    chain_uniforms,
    draft_lane,
    expand_for_chain,
    processed_logits,
    transformed_probs,
    verify_lanes,
)
from sglang.srt.speculative.spec_utils import (
    build_verify_forward_batch,
    chain_commit_layout,
    sample_from_probs,
)

logger = logging.getLogger(__name__)

__all__ = ["DSparkSetup", "check_nextn_only_flags", "dspark_setup", "load_dspark_tables",
           "DSparkWorker"]

# Confidence logit a request starts with in the lagged planner's relay (sigmoid ~ 1): before it
# has two rounds of history its budget assumes every draft survives. Any value works for
# losslessness; it only has to be independent of the current drafts.
_LAG_INIT_LOGIT = 20.0
# Flags that size a NEXTN chain; DSPARK's window comes from the block size.
_NEXTN_ONLY = (("--speculative-num-steps", "speculative_num_steps"),
               ("--speculative-num-draft-tokens", "speculative_num_draft_tokens"))


@dataclass(frozen=True)
class DSparkSetup:
    """A validated DSPARK configuration: where the draft is, its config, the planner tables."""

    draft_path: str
    config: DSparkDraftConfig
    sps_table: Optional[SPSTable] = None
    sts_temperatures: Optional[List[float]] = None

    @property
    def gamma(self) -> int:
        """Draft tokens per round."""
        return self.config.gamma


def check_nextn_only_flags(server_args: Any) -> None:
    """``ValueError`` naming a NEXTN-only flag set with DSPARK (the chain-sizing flags, and an
    EAGLE top-k other than 1)."""
    for flag, name in _NEXTN_ONLY:
        if getattr(server_args, name, None) is not None:
            raise ValueError(f"{flag} is NEXTN-only; DSPARK's verify window is the draft's block "
                             "size + 1 (--speculative-dspark-block-size)")
    topk = getattr(server_args, "speculative_eagle_topk", None)
    if topk is not None and topk != 1:
        raise ValueError(f"--speculative-eagle-topk {topk}: NEXTN-only (DSPARK drafts one "
                         "block, a single chain)")


def dspark_setup(server_args: Any, target_config: ModelConfig) -> DSparkSetup:
    """Validate the DSPARK flags and the draft for ``target_config``; every problem is a
    ``ValueError`` naming the flag (or the draft file) it is about."""
    check_nextn_only_flags(server_args)
    draft_flag = getattr(server_args, "speculative_draft_model_path", None)
    try:
        path = find_dspark_draft(target_config.model_path, draft_flag)
    except ConfigError as e:
        raise ValueError(f"--speculative-draft-model-path: {e}") from e
    block = getattr(server_args, "speculative_dspark_block_size", None)
    try:
        config = DSparkDraftConfig.from_path(path, target_config.hf_config, block)
    except ConfigError as e:
        where = " (--speculative-dspark-block-size)" if block is not None else ""
        raise ValueError(f"DSpark draft {path!r}{where}: {e}") from e
    sps_path = getattr(server_args, "speculative_dspark_sps_table_path", None)
    if sps_path is not None and not config.enable_confidence_head:
        raise ValueError(f"--speculative-dspark-sps-table-path: the confidence scheduler needs a "
                         f"draft with a confidence head; {path!r} has none "
                         "(enable_confidence_head is false)")
    table, temps = load_dspark_tables(
        sps_path, getattr(server_args, "speculative_dspark_confidence_sts_path", None),
        config.gamma)
    return DSparkSetup(path, config, table, temps)


def load_dspark_tables(sps_path: Optional[str], sts_path: Optional[str],
                       gamma: Optional[int] = None
                       ) -> Tuple[Optional[SPSTable], Optional[List[float]]]:
    """The planner's SPS table and STS temperatures (``gamma`` of them when given) from
    ``--speculative-dspark-sps-table-path`` / ``--speculative-dspark-confidence-sts-path``;
    a missing or malformed file is a ``ValueError`` naming its flag."""
    if sts_path is not None and sps_path is None:
        raise ValueError("--speculative-dspark-confidence-sts-path calibrates the confidence "
                         "scheduler, which runs only with --speculative-dspark-sps-table-path")
    out: List[Any] = []
    for flag, path, load in (
            ("--speculative-dspark-sps-table-path", sps_path, SPSTable.load),
            ("--speculative-dspark-confidence-sts-path", sts_path,
             lambda p: load_sts_temperatures(p, gamma))):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
        try:
            out.append(None if path is None else load(path))
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from e
    return out[0], out[1]


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
                 on_current_stream: bool = False):
        super().__init__(tensors, on_current_stream)
        self._stats: Optional[_RoundStats] = stats

    def wait(self) -> RoundOutput:
        """As :meth:`PendingRound.wait`, with ``cap_lens``; the first call updates the stats."""
        out = super().wait()
        out.cap_lens = self.host_copy.wait()["verify_len"].tolist()
        if self._stats is not None:
            self._stats.add(out.cap_lens, out.accept_lens)
            self._stats = None
        return out


class DSparkWorker(GraphedRoundMixin, BaseSpecWorker):
    """Owns the DSpark draft (beside the target's pools) and runs DSpark rounds."""

    @classmethod
    def requirements(cls, server_args: Any, target_config: ModelConfig) -> SpecRequirements:
        """``g + 1`` KV slots and KDA scratch positions per round; two windows of headroom (the
        host sees a finish one round late, after the device committed up to ``g + 1`` tokens
        past it and launched one more round). The draft has no MLA layer; its weights and its
        context store are allocated after the target's pools, which reserve room for both."""
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
            * cfg.head_dim)

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
        self.planner = None if setup.sps_table is None else DSparkPlanner(
            self.gamma, setup.sps_table, setup.sts_temperatures, self.device)
        lagged = self.planner is not None and self.overlap
        payload = {f"conf_lag{i}": ((self.gamma,), torch.float32) for i in (1, 2)} if lagged \
            else {}
        self.future_map = FutureMap(pool.size, self.device, payload=payload,
                                    lazy={name: _LAG_INIT_LOGIT for name in payload})
        self.stats = _RoundStats()
        logger.info("DSPARK: draft %s (%d layers), block size %d, verify window %d, planner %s, "
                    "context store %.1f MiB", setup.draft_path, cfg.num_hidden_layers,
                    self.gamma, self.gamma + 1, self.planner_mode, self.context.nbytes / 2**20)

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

    def internal_state(self) -> Dict[str, Any]:
        """DSpark entries for ``/server_info``'s ``internal_states``: counters since start over
        every (request, round) pair launched (a round launched after its request finished
        included), so the averages are the planner's and the draft's, not the output's."""
        s = self.stats
        return {
            "speculative_dspark_block_size": self.gamma,
            "speculative_num_draft_tokens": self.gamma + 1,
            "dspark_planner": self.planner_mode,
            "dspark_num_verify_reqs": s.request_rounds,
            "dspark_avg_planned_verify_len": s.planned_drafts / max(s.request_rounds, 1),
            "dspark_avg_correct_drafts": s.correct_drafts / max(s.request_rounds, 1),
        }

    # ------------------------------------------------------------------ prefill
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
            verify_len = self._plan(slots, h, draft)
        out = {"prefix": prefix, "anchor": anchor, "drafts": draft.tokens,
               "verify_len": verify_len}
        if draft.probs is not None:
            out["draft_probs"] = draft.probs  # [B, g, V]
        return out

    def _verify_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                      loc: torch.Tensor, info: SamplingBatchInfo, seq_lens_bound: int,
                      return_logprob: bool) -> Dict[str, torch.Tensor]:
        """Target verify of the window, capped acceptance, KDA commit, the relay's new lengths
        and anchors, the committed tokens into the sampling history."""
        drafts, prefix = prev["drafts"], prev["prefix"]
        window = torch.cat([prev["anchor"].unsqueeze(1), drafts], dim=1)  # [B, g + 1]
        b, n = window.shape
        batch = build_verify_forward_batch(window, slots, prefix, loc,
                                           capture_hidden_mode=CaptureHiddenMode.NULL,
                                           seq_lens_upper_bound=seq_lens_bound)
        target_out = self.target_runner.forward(batch)
        verdict, processed, rows_info = self._verify(
            target_out.next_token_logits, drafts, info, prev.get("draft_probs"),
            prev["verify_len"])
        layout = chain_commit_layout(prefix, verdict.accept_len, loc)
        kda_pool = self.target_runner.kda_state_pool
        if kda_pool is not None and kda_pool.layer_ids:
            kda_pool.commit_after_verify(slots, layout.last_accepted_index)
        self.future_map.scatter(slots, seq_lens=layout.new_seq_lens, tokens=verdict.next_seed)
        info.append_tokens(verdict.accepted_tokens.clamp(min=0), valid=layout.keep_mask)
        out = {"accept_len": verdict.accept_len, "tokens": verdict.accepted_tokens,
               "target_aux": target_out.aux_hidden_states.view(b, n, -1)}
        if return_logprob:
            # As the sampler: the penalised logits over the temperature at each position (raw
            # logits with SGLANG_RETURN_ORIGINAL_LOGPROB).
            if envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get():
                source = target_out.next_token_logits[:, :self.vocab_size].float()
            else:
                source = processed / rows_info.temperatures.unsqueeze(1)
            out["lp_source"] = source.view(b, n, -1)
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
        copies = {"accept_len": out["accept_len"], "tokens": out["tokens"], "loc": loc,
                  "verify_len": out["verify_len"]}
        if return_logprob:
            lp = torch.log_softmax(out["lp_source"], dim=-1)  # [B, g + 1, V]
            committed = out["tokens"].clamp(min=0)
            copies["logprobs"] = lp.gather(2, committed.unsqueeze(-1)).squeeze(-1)
            if top_logprobs_num > 0:
                k = min(top_logprobs_num, self.vocab_size)
                copies["top_val"], copies["top_idx"] = lp.topk(k, -1)
        return _DSparkPendingRound(copies, self.stats, on_current_stream=on_current_stream)

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

    def _plan(self, slots: torch.Tensor, h: torch.Tensor, draft: MarkovDraft) -> torch.Tensor:
        """Verify lengths ``[B]`` (module docstring, step 2); padding rows (slot 0) are
        inactive, so they take no share of the budget."""
        b = slots.shape[0]
        if self.planner is None:
            return torch.full((b,), self.gamma, dtype=torch.int64, device=self.device)
        conf = self.draft.confidence(h, draft.prev_tokens)  # [B, g] logits
        active = slots != 0
        if not self.overlap:
            return self.planner.plan(conf, active)
        lag1, lag2 = self.future_map.gather(slots, "conf_lag1", "conf_lag2")
        budget = self.planner.capacity(lag2, active)
        self.future_map.scatter(slots, conf_lag1=conf, conf_lag2=lag1)
        return self.planner.plan_top_k(conf, budget, active)

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
