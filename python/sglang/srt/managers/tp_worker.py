"""TpModelWorker: one TP rank's ModelRunner plus the sampler.

The scheduler hands it a :class:`ForwardBatch` and the sampling state of the rows that need a
token; it runs the forward and samples. Every TP rank runs the same forward and the same
sampling (identical logits after the vocab all-gather and identically seeded generators), so the
ranks' schedulers stay in lockstep without exchanging tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput, last_token_indices
from sglang.srt.layers.sampler import Sampler, SamplerOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner, runner_kwargs_from_server_args
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


class TpModelWorker:
    """Owns the :class:`ModelRunner` of one TP rank (built from the server args)."""

    def __init__(self, server_args: Any, tp_rank: int = 0, nccl_port: Any = None,
                 model_config: Optional[ModelConfig] = None):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.model_config = model_config or ModelConfig.from_path(
            server_args.model_path, server_args.json_model_override_args
        )
        kwargs = runner_kwargs_from_server_args(server_args, tp_rank, nccl_port)
        if getattr(server_args, "speculative_algorithm", None) == "NEXTN":
            # The NEXTN draft shares this runner's pools: reserve the MTP layer's latent cache
            # and the KDA stage-then-commit scratch for one chain.
            kwargs["draft_extra_mla_layers"] = True
            kwargs["spec_num_draft_tokens"] = int(server_args.speculative_num_draft_tokens)
            # The draft's own layers (~6 GB for Ling-3.0-flash's MTP layer) load after the pools:
            # the memory plan keeps room for them.
            from sglang.srt.speculative.nextn_worker import nextn_draft_model_config

            kwargs["draft_model_config"] = nextn_draft_model_config(server_args, self.model_config)
        self.model_runner = ModelRunner(self.model_config, **kwargs)
        self.device = self.model_runner.device
        self.vocab_size = self.model_config.vocab_size
        # Unseeded rows draw from the global generator, seeded by ModelRunner with random_seed on
        # every rank, so all ranks draw the same numbers.
        self.sampler = Sampler()

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
