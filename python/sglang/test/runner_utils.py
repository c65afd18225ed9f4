"""Driving a bare :class:`~sglang.srt.model_executor.model_runner.ModelRunner` in tests."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch

__all__ = ["greedy_logits", "draft_runner_on"]


def greedy_logits(runner, ids: Sequence[int], decode_steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One fresh request on ``runner``: the prefill logits of every position of ``ids``
    ``[T, V]`` and the logits of ``decode_steps`` greedy decode steps after it ``[steps, V]``."""
    req = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req])
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(req, 0, loc)
    input_ids = torch.tensor(list(ids), dtype=torch.int64, device=runner.device)
    fb = ForwardBatch.for_extend(input_ids, [req], [0], [len(ids)], loc, return_full_logits=True)
    prefill = runner.forward(fb).next_token_logits
    steps = []
    token = prefill[-1:].argmax(-1)
    for i in range(decode_steps):
        seq_len = len(ids) + i + 1
        loc = runner.token_to_kv_pool_allocator.alloc(1)
        runner.req_to_token_pool.write(req, seq_len - 1, loc)
        fb = ForwardBatch.for_decode(token, torch.tensor([req]), torch.tensor([seq_len]), loc)
        logits = runner.forward(fb).next_token_logits
        steps.append(logits)
        token = logits.argmax(-1)
    return prefill, torch.cat(steps) if steps else prefill[:0]


def draft_runner_on(target, model_config, **kwargs):
    """The NEXTN draft (MTP layer) runner of ``model_config`` on ``target``'s pools (the target
    built with ``draft_extra_mla_layers=True``), sharing its embedding and LM head, as the
    NEXTN worker sets it up; fp32 on CPU unless ``kwargs`` say otherwise."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    opts = dict(device="cpu", dtype=torch.float32, **kwargs)
    draft = ModelRunner(model_config, is_draft=True,
                        req_to_token_pool=target.req_to_token_pool,
                        token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
                        token_to_kv_pool=target.token_to_kv_pool,
                        kda_state_pool=target.kda_state_pool, **opts)
    draft.model.set_embed_and_head(*target.model.get_embed_and_head())
    return draft
