"""Bit-exact speculation in bf16: with ``--enable-deterministic-inference`` the dense GEMMs of
decode and verify batches run the batch-invariant small-M GEMM (``KernelChoices.small_m_gemm``)
and the Triton MLA kernel splits the keys at fixed boundaries, so a token's logits do not depend
on how many rows share the launch (a 1-token decode, an ``N``-token verify, a batch of
requests). Greedy NEXTN-3 and DSPARK must then equal plain
decoding byte for byte on the bundled model, at batch 1 and at batch 4 with staggered arrivals,
10 held-out prompts x 256 tokens (the GPU gate of the deterministic path).

On CPU the flag changes nothing (the torch paths run either way); what it selects is checked
here, the equality itself needs CUDA.
"""
from __future__ import annotations

import os
from typing import Dict, List

import pytest

from engine_test_utils import (make_scheduler, request, server_args, submit_staggered,
                               take_token_ids)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.layers.kernel_choices import KernelChoices
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import prepare_server_args
from sglang.train.data import HELD_OUT_FILES, stdlib_root

MODEL = str(BUNDLED_MODEL_DIR)
GEN = 256
PROMPTS = 10
PROMPT_LEN = 64


def _prompts(tokenizer) -> List[List[int]]:
    out = []
    for name in HELD_OUT_FILES[:PROMPTS]:
        text = (stdlib_root() / name).read_text(encoding="utf-8")
        start = text.find("\ndef ", len(text) // 3) + 1
        out.append(tokenizer.encode(text[start:start + 2000])[:PROMPT_LEN])
    return out


def _greedy(sched, prompts: List[List[int]], stagger: int = 0,
            gen: int = GEN) -> Dict[str, List[int]]:
    reqs = [request(f"p{i}", p, max_new_tokens=gen, temperature=0, ignore_eos=True)
            for i, p in enumerate(prompts)]
    submit_staggered(sched, reqs, stagger)
    return take_token_ids(sched)


def test_flag_reaches_the_runner_and_the_draft():
    args = prepare_server_args(["--enable-deterministic-inference", "--device", "cpu"])
    assert args.enable_deterministic_inference
    sched = make_scheduler(MODEL, max_total_tokens=4096, max_running_requests=2,
                           enable_deterministic_inference=True, speculative_algorithm="NEXTN")
    target = sched.tp_worker.model_runner
    assert target.enable_deterministic_inference
    assert sched.draft_worker.draft_runner.enable_deterministic_inference
    assert not target.kernel_choices.small_m_gemm  # off CUDA the torch paths run regardless
    # The Triton MLA kernel then splits keys at fixed boundaries (test/kernels/test_mla_decode.py
    # shows a token's output bit-identical alone and in a verify chain).
    triton = make_scheduler(MODEL, max_total_tokens=4096, max_running_requests=2,
                            attention_backend="triton", enable_deterministic_inference=True)
    assert triton.tp_worker.model_runner.attn_backend.full_attn_backend.batch_invariant
    plain = make_scheduler(MODEL, max_total_tokens=4096, max_running_requests=2,
                           attention_backend="triton")
    assert not plain.tp_worker.model_runner.attn_backend.full_attn_backend.batch_invariant


@pytest.mark.parametrize("spec", [dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                                  dict(speculative_algorithm="DSPARK")], ids=["nextn3", "dspark"])
def test_speculative_target_splits_keys_as_the_plain_one(spec):
    """A speculative target's request map is wider than a plain target's (the round's position
    headroom); with the deterministic flag both MLA backends still split a request's keys at
    the same boundaries (from the context length), the condition for a verify row to round as
    the plain decode of its token (on the H100 a 64-key difference in width split the bundled
    model's keys differently and one prompt of ten left plain decoding)."""
    kw = dict(max_total_tokens=4096, max_running_requests=2, attention_backend="triton",
              enable_deterministic_inference=True)
    plans = []
    for extra in ({}, spec):
        runner = make_scheduler(MODEL, **kw, **extra).tp_worker.model_runner
        cap = runner.req_to_token_pool.req_to_token.shape[1]
        mla = runner.attn_backend.full_attn_backend
        assert mla.invariant_span == runner.context_len
        plans.append((cap, runner.context_len, mla._split_plan(1, 4, cap, 576, runner.device)))
    (plain_cap, plain_ctx, plain_plan), (spec_cap, spec_ctx, spec_plan) = plans
    assert spec_cap > plain_cap and spec_ctx == plain_ctx  # the headroom, one context length
    assert spec_plan[1] == plain_plan[1] and spec_plan[0] * spec_plan[1] >= spec_cap


@pytest.mark.slow  # plain and NEXTN schedulers with the mat-vecs in Triton's interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the grouped mat-vec on CPU needs Triton's interpreter")
def test_absorbed_mla_as_grouped_gemv_serves_the_same_tokens():
    """MLA's absorbed products as grouped mat-vecs (``KernelChoices.mla_absorb_gemv``, the
    deterministic path's) give the bundled model's greedy tokens, plain and NEXTN, as torch.bmm
    does (fp32 on CPU)."""
    kw = dict(max_total_tokens=4096, max_running_requests=4)
    base = make_scheduler(MODEL, **kw)
    prompts = _prompts(base.tokenizer)[:2]
    want = {}
    for i, p in enumerate(prompts):
        want[f"p{i}"] = _greedy(base, [p], gen=24)["p0"]
    for spec in ({}, dict(speculative_algorithm="NEXTN", speculative_num_steps=3)):
        args = server_args(MODEL, **kw, **spec)
        args.kernel_choices = KernelChoices(mla_absorb_gemv=True)  # read by the runner
        sched = Scheduler(args)
        runner = sched.tp_worker.model_runner
        assert runner.kernel_choices.mla_absorb_gemv
        got = {f"p{i}": _greedy(sched, [p], gen=24)["p0"] for i, p in enumerate(prompts)}
        assert got == want, spec


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                                  dict(speculative_algorithm="DSPARK")], ids=["nextn3", "dspark"])
def test_bf16_speculation_equals_plain_on_cuda(spec):
    # At most 4 requests run together: the batch-4 leg; every prompt also runs alone.
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=32768, max_running_requests=4,
              enable_deterministic_inference=True)
    plain = make_scheduler(MODEL, **kw)
    assert plain.tp_worker.model_runner.kernel_choices.small_m_gemm
    prompts = _prompts(plain.tokenizer)
    want1 = {f"p{p}": _greedy(plain, [prompts[p]])["p0"] for p in range(PROMPTS)}
    want4 = _greedy(plain, prompts, stagger=2)
    del plain
    sched = make_scheduler(MODEL, **kw, **spec)
    got1 = {f"p{p}": _greedy(sched, [prompts[p]])["p0"] for p in range(PROMPTS)}
    got4 = _greedy(sched, prompts, stagger=2)
    for name, got, want in (("batch 1", got1, want1), ("batch 4", got4, want4)):
        first = {rid: next((j for j, (a, b) in enumerate(zip(ids, got[rid])) if a != b), None)
                 for rid, ids in want.items()}
        print(f"{spec['speculative_algorithm']} {name}: first differing token {first}")
        assert got == want, f"{name}: first differing token per prompt {first}"
