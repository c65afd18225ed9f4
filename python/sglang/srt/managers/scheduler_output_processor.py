"""Scheduler half that consumes forward results: new tokens, logprobs, hidden states, finish,
outputs.

Split out of ``scheduler.py`` (as upstream's ``SchedulerOutputProcessorMixin``) to keep files
short. Methods read scheduler state (``self.running_batch``, pools, tokenizer, counters) and are
mixed into :class:`~sglang.srt.managers.scheduler.Scheduler`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

import torch

from sglang.srt.layers.sampler import compute_input_token_logprobs
from sglang.srt.managers.io_struct import BatchTokenIDOutput
from sglang.srt.managers.schedule_batch import (
    FINISH_LENGTH,
    Req,
    ScheduleBatch,
    release_kv_cache,
)

if TYPE_CHECKING:
    from sglang.srt.rounds.plain import GenerationBatchResult


class SchedulerOutputProcessorMixin:
    """Turns a prefill's :class:`GenerationBatchResult` into request state changes and outputs
    (decode rounds: :class:`~sglang.srt.managers.scheduler_round.SchedulerRoundMixin`)."""

    # ------------------------------------------------------------------ prefill
    def process_batch_result_prefill(self, batch: ScheduleBatch,
                                     result: "GenerationBatchResult") -> None:
        """After an extend: record input logprobs, append first tokens, move requests on."""
        chunk_starts = list(batch.prefix_lens)
        batch.commit_forward()
        if any(r.wants_input_logprobs() for r in batch.reqs):
            self._add_input_logprobs(batch, chunk_starts, result.logits_output.next_token_logits)
        if any(r.return_hidden_states for r in batch.reqs):
            self._add_prefill_hidden_states(batch, result.logits_output.hidden_states)

        rows = batch.sample_rows or []
        if rows:  # (the round worker's prefill advanced the sampling state on the device)
            self._append_tokens([batch.reqs[i] for i in rows], result)
        for r in batch.reqs:
            if r.prefill_done and r.sampling_params.max_new_tokens == 0:
                r.finished_reason = FINISH_LENGTH(length=0)  # prefill-only (e.g. input logprobs)

        # Requests whose prompt is complete and which go on decoding join the running batch.
        keep = [j for j, i in enumerate(rows) if not batch.reqs[i].finished()]
        if keep:
            joining = ScheduleBatch.init_new(
                [batch.reqs[rows[j]] for j in keep], self.req_to_token_pool,
                self.token_to_kv_pool_allocator, self.device)
            joining.sampling_info = batch.sampling_info if len(keep) == len(rows) \
                else batch.sampling_info.filter(keep)
            if self.running_batch is None:
                self.running_batch = joining
            else:
                self.running_batch.merge_batch(joining)
        self._finish_and_stream(batch.reqs)

    def _add_input_logprobs(self, batch: ScheduleBatch, chunk_starts: List[int],
                            logits: torch.Tensor) -> None:
        """Input logprobs of the tokens this chunk's rows predict (see Req.logprob_start_len)."""
        offset = 0
        for r, p, n in zip(batch.reqs, chunk_starts, batch.extend_lens):
            rows = logits[offset: offset + n]
            offset += n
            if not r.wants_input_logprobs():
                continue
            n_prompt = len(r.origin_input_ids)
            n_in = min(p + n + 1, n_prompt)  # this chunk's rows predict tokens up to p + n
            start = r.logprob_start_len if p == 0 else max(r.logprob_start_len, p + 1)
            if start >= n_in:
                continue
            lp = compute_input_token_logprobs(rows, r.origin_input_ids[:n_in], start,
                                              r.top_logprobs_num, logits_start=p)
            r.input_token_logprobs_val.extend(lp.token_logprobs)
            r.input_token_logprobs_idx.extend(lp.token_ids)
            if r.top_logprobs_num > 0:
                for entry in lp.top_logprobs:
                    r.input_top_logprobs_val.append([v for v, _ in entry] if entry else [])
                    r.input_top_logprobs_idx.append([i for _, i in entry] if entry else [])

    # ------------------------------------------------------------------ hidden states
    def _add_prefill_hidden_states(self, batch: ScheduleBatch,
                                   hidden: Optional[torch.Tensor]) -> None:
        """This chunk's rows ``[n, H]`` of the requests that asked, in one device-to-host copy
        (a prefill is read on the host anyway); every chunk of a prompt adds its rows."""
        if self.tp_rank != 0:
            return  # only rank 0 reports outputs: the others would only pile them up
        if hidden is None:
            raise RuntimeError("the prefill asked for hidden states but the forward returned "
                               "none (capture_hidden_mode lost on the way)")
        spans, offset = [], 0
        for r, n in zip(batch.reqs, batch.extend_lens):
            if r.return_hidden_states:
                spans.append((r, offset, n))
            offset += n
        host = torch.cat([hidden[o:o + n] for _, o, n in spans]).cpu()
        for (r, _, _), rows in zip(spans, torch.split(host, [n for _, _, n in spans])):
            # Its own storage: a pickled view would carry the whole batch's rows along.
            r.hidden_states.append(rows.clone() if len(spans) > 1 else rows)

    def _append_round_hidden_states(self, r: Req, out: Any, b: int) -> None:
        """Request ``b``'s row of a decode round (its input token's hidden state), if it asked
        (``out.hidden_states``: per request a host row or None; only the plain worker's rounds
        that were given hidden rows carry it)."""
        rows = out.hidden_states
        if r.return_hidden_states and self.tp_rank == 0 and rows is not None and \
                rows[b] is not None:
            r.hidden_states.append(rows[b])

    # ------------------------------------------------------------------ shared
    def _append_tokens(self, reqs: List[Req], result: "GenerationBatchResult") -> None:
        out = result.sampler_output
        next_ids = out.next_token_ids.tolist()  # a prefill is consumed at once: a host sync
        want_lp = out.next_token_logprobs is not None
        lp_vals = out.next_token_logprobs.tolist() if want_lp else None
        top_vals = out.top_logprobs_val.tolist() if out.top_logprobs_val is not None else None
        top_idx = out.top_logprobs_idx.tolist() if out.top_logprobs_idx is not None else None
        for i, r in enumerate(reqs):
            r.output_ids.append(next_ids[i])
            if r.return_logprob and want_lp:
                r.output_token_logprobs_val.append(lp_vals[i])
                r.output_token_logprobs_idx.append(next_ids[i])
                if r.top_logprobs_num > 0 and top_vals is not None:
                    r.output_top_logprobs_val.append(top_vals[i][: r.top_logprobs_num])
                    r.output_top_logprobs_idx.append(top_idx[i][: r.top_logprobs_num])
            r.check_finished(self.tokenizer)
        self.num_generated_tokens += len(reqs)

    def _finish_and_stream(self, reqs: List[Req]) -> None:
        """Free finished requests' slots, then report what is due to the detokenizer."""
        for r in reqs:
            if r.finished() and r.req_pool_idx is not None:
                release_kv_cache(r, self.req_to_token_pool, self.token_to_kv_pool_allocator)
        self.stream_output(reqs)

    def stream_output(self, reqs: List[Req]) -> None:
        """Send new tokens of finished requests and of streaming requests whose interval is due.

        Only TP rank 0 talks to the detokenizer; the other ranks keep identical state silently.
        """
        if self.tp_rank != 0:
            return
        due = [r for r in reqs if self._output_due(r)]
        if not due:
            return
        spec = self.spec_metrics_message(due)
        if spec is not None:  # same ordered path, so it arrives before the finishing tokens
            self.send_to_detokenizer(spec)
        out = BatchTokenIDOutput(
            rids=[], finished_reasons=[], decode_ids=[], prompt_tokens=[], completion_tokens=[],
            cached_tokens=[], skip_special_tokens=[], spaces_between_special_tokens=[],
            no_stop_trim=[], stop_strs=[],
        )
        for r in due:
            sp, start = r.sampling_params, r.sent_output_len
            out.rids.append(r.rid)
            out.finished_reasons.append(r.finished_reason.to_json() if r.finished() else None)
            out.decode_ids.append(r.output_ids[start:])
            out.prompt_tokens.append(len(r.origin_input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached_tokens)
            out.skip_special_tokens.append(sp.skip_special_tokens)
            out.spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
            out.no_stop_trim.append(sp.no_stop_trim)
            out.stop_strs.append(list(sp.stop_strs))
            out.output_token_logprobs_val.append(r.output_token_logprobs_val[start:])
            out.output_token_logprobs_idx.append(r.output_token_logprobs_idx[start:])
            out.output_top_logprobs_val.append(r.output_top_logprobs_val[start:])
            out.output_top_logprobs_idx.append(r.output_top_logprobs_idx[start:])
            send_input = r.wants_input_logprobs() and not r.sent_input_logprobs and \
                (r.prefill_done or r.finished())
            out.input_token_logprobs_val.append(r.input_token_logprobs_val if send_input else [])
            out.input_token_logprobs_idx.append(r.input_token_logprobs_idx if send_input else [])
            out.input_top_logprobs_val.append(r.input_top_logprobs_val if send_input else [])
            out.input_top_logprobs_idx.append(r.input_top_logprobs_idx if send_input else [])
            r.sent_input_logprobs = r.sent_input_logprobs or send_input
            out.output_hidden_states.append(r.hidden_states)
            r.hidden_states = []  # sent: the scheduler keeps no copy
            r.sent_output_len = len(r.output_ids)
        self.send_to_detokenizer(out)

    def _output_due(self, r: Req) -> bool:
        if r.finished():
            return True
        if not r.stream or len(r.output_ids) == r.sent_output_len:
            return False
        interval = r.sampling_params.stream_interval or self.stream_interval
        # The first token goes out at once (time to first token), then every `interval` tokens.
        return r.sent_output_len == 0 or len(r.output_ids) - r.sent_output_len >= interval
