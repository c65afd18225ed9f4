"""TpModelWorker: one TP rank's ModelRunner plus the sampler.

The scheduler hands it a :class:`ForwardBatch` and the sampling state of the rows that need a
token; it runs the forward and samples. Every TP rank runs the same forward and the same
sampling (identical logits after the vocab all-gather and identically seeded generators), so the
ranks' schedulers stay in lockstep without exchanging tokens.

Plain decoding runs as one-token "rounds" with the same interface as a speculative worker
(:meth:`TpModelWorker.prefill`, :meth:`TpModelWorker.forward_round`): each step reads its input
token and position from the worker's :class:`~sglang.srt.rounds.relay.FutureMap` on the
device and writes its sampled token back there, so the scheduler can launch step ``k + 1``
before it has read step ``k``'s token.

Hidden states (``return_hidden_states``): a round given ``hidden_state_rows`` also returns
those requests' final-normed hidden states (the LM head's input, one row per request: its input
token's). Such a round runs eagerly, never as a graph replay: the graphs are captured without
that output, and a round nobody asked for keeps its graph and gains no copy or host read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput, last_token_indices
from sglang.srt.layers.sampler import Sampler, SamplerOutput
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner, runner_kwargs_from_server_args
from sglang.srt.rounds.contract import RoundWorker, SpecRequirements
from sglang.srt.rounds.relay import FutureMap, PendingRound, RoundOutput, host_to_device
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class GenerationBatchResult:
    """Output of one forward: the logits and, for the sampled rows, the new tokens."""

    logits_output: LogitsProcessorOutput
    # Rows of the batch that were sampled (None: all of them); index into the batch's requests.
    sample_rows: Optional[List[int]]
    sampler_output: Optional[SamplerOutput]

    @property
    def next_token_ids(self) -> Optional[torch.Tensor]:
        """Sampled ids ``[rows]`` (None when nothing was sampled)."""
        return None if self.sampler_output is None else self.sampler_output.next_token_ids


class HiddenStatesPendingRound(PendingRound):
    """A :class:`PendingRound` that also copies the hidden states of the round's rows
    ``rows`` (``tensors["hidden_states"] [len(rows), H]``) into
    :attr:`RoundOutput.hidden_states`."""

    def __init__(self, tensors: Dict[str, torch.Tensor], rows: Sequence[int],
                 on_current_stream: bool = False):
        super().__init__(tensors, on_current_stream)
        self.rows = list(rows)

    def wait(self) -> RoundOutput:
        """:meth:`PendingRound.wait`, plus the hidden rows by request."""
        out = super().wait()
        host = self.host_copy.wait()["hidden_states"]
        per_req: List[Optional[torch.Tensor]] = [None] * len(out.accept_lens)
        for j, b in enumerate(self.rows):
            per_req[b] = host[j].clone()  # own storage: not the round's whole pinned buffer
        out.hidden_states = per_req
        return out


class TpModelWorker(RoundWorker):
    """Owns the :class:`ModelRunner` of one TP rank (built from the server args).

    ``spec_requirements`` (from a speculative worker class) sizes the runner's pools for the
    draft that will share them (its caches, KDA scratch, position headroom, later weights).
    """

    # Plain decoding: one KV slot and one token per request per round, no proposals.
    round_tokens = 1
    returns_hidden_states = True
    proposed_per_round = 0

    def __init__(self, server_args: Any, tp_rank: int = 0, nccl_port: Any = None,
                 model_config: Optional[ModelConfig] = None,
                 spec_requirements: Optional[SpecRequirements] = None):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.model_config = model_config or ModelConfig.from_path(
            server_args.model_path, server_args.json_model_override_args
        )
        kwargs = runner_kwargs_from_server_args(server_args, tp_rank, nccl_port)
        if spec_requirements is not None:
            kwargs.update(spec_requirements.runner_kwargs())
        self.model_runner = ModelRunner(self.model_config, **kwargs)
        self.device = self.model_runner.device
        self.vocab_size = self.model_config.vocab_size
        # Unseeded rows draw from the global generator, seeded by ModelRunner with random_seed on
        # every rank, so all ranks draw the same numbers.
        self.sampler = Sampler()
        # Plain decode's relay: the next input token and the committed length per slot.
        self.future_map = FutureMap(self.model_runner.req_to_token_pool.size, self.device)
        # (host rows, device rows) of the round being launched that returns hidden states.
        self._hidden_rows: Optional[Tuple[List[int], torch.Tensor]] = None

    # Pool handles (the scheduler does the slot bookkeeping).
    @property
    def req_to_token_pool(self):
        """The runner's request->token map."""
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool_allocator(self):
        """The runner's KV slot allocator."""
        return self.model_runner.token_to_kv_pool_allocator

    @property
    def kda_state_pool(self):
        """The runner's KDA state pool (one slot per request row)."""
        return self.model_runner.kda_state_pool

    def forward_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: Optional[SamplingBatchInfo],
        sample_rows: Optional[Sequence[int]] = None,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[Sequence[int]] = None,
    ) -> GenerationBatchResult:
        """Run the forward, then sample one token for each row in ``sample_rows`` (all rows when
        None; no sampling when ``sampling_info`` is None, e.g. a middle prefill chunk)."""
        logits_output = self.model_runner.forward(forward_batch)
        if sampling_info is None:
            return GenerationBatchResult(logits_output, [], None)
        logits = logits_output.next_token_logits
        if forward_batch.return_full_logits and forward_batch.forward_mode.is_extend():
            logits = logits[last_token_indices(forward_batch)]  # full rows were for logprobs
        if sample_rows is not None:
            logits = logits[torch.as_tensor(list(sample_rows), device=logits.device)]
        out = self.sampler(logits, sampling_info, return_logprob=return_logprob,
                           top_logprobs_nums=top_logprobs_nums)
        rows = None if sample_rows is None else list(sample_rows)
        return GenerationBatchResult(logits_output, rows, out)

    # ------------------------------------------------------------------ plain decode rounds
    def prefill(self, forward_batch: ForwardBatch, sampling_info: Optional[SamplingBatchInfo],
                sample_rows: Optional[Sequence[int]] = None, return_logprob: bool = False,
                top_logprobs_nums: Optional[Sequence[int]] = None,
                next_prompt_tokens: Optional[Sequence[int]] = None) -> GenerationBatchResult:
        """:meth:`forward_batch_generation`, then the sampled rows' first token and length into
        the future map (``next_prompt_tokens`` is for speculative drafters; unused here)."""
        result = self.forward_batch_generation(forward_batch, sampling_info, sample_rows,
                                               return_logprob, top_logprobs_nums)
        next_ids = result.next_token_ids
        if next_ids is not None and next_ids.numel():
            slots, lens = forward_batch.req_pool_indices, forward_batch.seq_lens
            if sample_rows is not None:
                sel = host_to_device(list(sample_rows), self.device)
                slots, lens = slots[sel], lens[sel]
            self.future_map.scatter(slots, tokens=next_ids, seq_lens=lens)
            if sampling_info is not None:
                sampling_info.append_tokens(next_ids)
        return result

    def prefill_graph_plan(self) -> List[Tuple[ModelRunner, Dict[str, Any]]]:
        """This worker's runner, its prefills as they are (logits only)."""
        return [(self.model_runner, {})]

    def graph_setup(self) -> dict:
        """A decode step: one token and one KV slot per request, the target's backend."""
        return dict(tokens_per_request=1,
                    backends=[self.model_runner.attn_backend], runners=[self.model_runner])

    def round_phases(self) -> List[Any]:
        """A decode step is one phase (:meth:`_decode_phase`)."""
        return [self._decode_phase]

    def _decode_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                      loc: torch.Tensor, sampling_info: SamplingBatchInfo, seq_lens_bound: int,
                      return_logprob: bool = False,
                      hidden_rows: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """The device work of one decode step (fixed shapes, no host reads: a CUDA graph
        captures it): input token and position from the future map, the KV slot into the
        request->token map, forward, sampling, the new token and length back into the map.
        Returns ``accept_len [B]`` (ones), ``tokens [B, 1]`` and, for logprobs, the sampler's
        ``logprobs [B, V]`` (of the logits before this step's tokens enter the penalties);
        with ``hidden_rows [R]`` (eager rounds only) also those rows' ``hidden_states [R, H]``."""
        prefix, tokens = self.future_map.assign_round(
            self.model_runner.req_to_token_pool.req_to_token, slots, loc, with_tokens=True)
        batch = ForwardBatch.for_decode(tokens, slots, prefix + 1, loc[:, 0],
                                        seq_lens_upper_bound=seq_lens_bound)
        if hidden_rows is not None:
            batch.capture_hidden_mode = CaptureHiddenMode.LAST
        logits_output = self.model_runner.forward(batch)
        logits = logits_output.next_token_logits
        sampled = self.sampler(logits, sampling_info, return_logprob=return_logprob)
        next_ids = sampled.next_token_ids
        sampling_info.append_tokens(next_ids)
        self.future_map.scatter(slots, tokens=next_ids, seq_lens=prefix + 1)
        out = {"accept_len": torch.ones_like(next_ids), "tokens": next_ids.unsqueeze(1)}
        if return_logprob:
            out["logprobs"] = sampled.logprobs
        if hidden_rows is not None:
            out["hidden_states"] = logits_output.hidden_states[hidden_rows]
        return out

    def forward_round(self, req_pool_indices: torch.Tensor, round_cache_loc: torch.Tensor,
                      sampling_info: SamplingBatchInfo, seq_lens_bound: Optional[int] = None,
                      return_logprob: bool = False, top_logprobs_num: int = 0,
                      hidden_state_rows: Optional[Sequence[int]] = None) -> PendingRound:
        """:meth:`RoundWorker.forward_round`; with ``hidden_state_rows`` (indices into
        the round's requests) the round runs eagerly and its :meth:`PendingRound.wait` gives a
        :attr:`RoundOutput.hidden_states` with those rows' hidden states."""
        rows = sorted(set(hidden_state_rows or ()))
        b = int(req_pool_indices.shape[0])
        if rows and not 0 <= rows[0] <= rows[-1] < b:
            raise ValueError(f"forward_round: hidden_state_rows {rows} outside the round's "
                             f"{b} requests")
        if rows:
            self._hidden_rows = (rows, host_to_device(rows, self.device))
        try:
            return super().forward_round(req_pool_indices, round_cache_loc, sampling_info,
                                         seq_lens_bound, return_logprob, top_logprobs_num)
        finally:
            self._hidden_rows = None

    def round_needs_eager(self) -> bool:
        """A round returning hidden states runs eagerly: no graph holds that output (nor is
        one captured with it)."""
        return self._hidden_rows is not None

    def round_body(self, slots: torch.Tensor, loc: torch.Tensor, info: SamplingBatchInfo,
                   bound: int, return_logprob: bool = False) -> Dict[str, torch.Tensor]:
        """The decode step; with the hidden-state rows of the round being launched (eager
        only) the step also returns those rows' hidden states."""
        if self._hidden_rows is None:
            return super().round_body(slots, loc, info, bound, return_logprob)
        return self._decode_phase({}, slots, loc, info, bound, return_logprob,
                                  hidden_rows=self._hidden_rows[1])

    def pending_round(self, out: Dict[str, torch.Tensor], loc: torch.Tensor,
                      return_logprob: bool, top_logprobs_num: int,
                      on_current_stream: bool = False) -> PendingRound:
        """Start the host copies of a step's outputs; the chosen tokens' logprobs and the top
        ones are picked here from the body's ``logprobs`` (after a graph replay, too); the
        hidden states ``out["hidden_states"]`` of the round being launched with hidden-state
        rows (an eager round, :meth:`round_needs_eager`)."""
        copies = {"accept_len": out["accept_len"], "tokens": out["tokens"], "loc": loc}
        if return_logprob:
            lp = out["logprobs"]
            copies["logprobs"] = lp.gather(1, out["tokens"])
            if top_logprobs_num > 0:
                k = min(top_logprobs_num, self.vocab_size)
                val, idx = lp.topk(k, dim=-1)
                copies["top_val"], copies["top_idx"] = val.unsqueeze(1), idx.unsqueeze(1)
        if "hidden_states" in out:
            copies["hidden_states"] = out["hidden_states"]
            return HiddenStatesPendingRound(copies, self._hidden_rows[0], on_current_stream)
        return PendingRound(copies, on_current_stream=on_current_stream)
