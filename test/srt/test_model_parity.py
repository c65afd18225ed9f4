"""Serving model (ModelRunner + torch_native backend) vs the plain-PyTorch reference, fp32 on CPU.

A random checkpoint (every feature of the architecture: KDA + MLA layers, dense + MoE, clamped
SwiGLU, grouped routing with bias, MTP layer) is served and compared with
``sglang.train.reference.ReferenceBailingMoeV3`` loaded from the same files:

* prefill logits of every position of several prompts batched in one EXTEND forward;
* a prefix-cached second chunk (EXTEND with prefix) and several DECODE steps;
* the final-normed hidden states the NEXTN draft consumes;
* the NEXTN/MTP draft (extend over a prompt, then one decode step) vs ``mtp_forward``.

Tolerance: max |serving - reference| <= 1e-5 * max |reference| per compared tensor (fp32).
"""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
from sglang.train.reference import ReferenceBailingMoeV3

RTOL = 1e-5
PROMPT_LENS = (13, 1, 22)  # includes a one-token prompt and one longer than a KDA chunk of 16


def _assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= RTOL * scale, f"{name}: max abs err {err:.3e} > {RTOL:g} * {scale:.3e}"


class Served:
    """A target runner and a NEXTN draft runner on one random checkpoint."""

    def __init__(self, path: str):
        cfg = ModelConfig.from_path(path)
        self.target = ModelRunner(cfg, device="cpu", dtype=torch.float32, max_running_requests=4,
                                  max_total_tokens=256)
        self.draft = ModelRunner(cfg, device="cpu", dtype=torch.float32, max_running_requests=4,
                                 max_total_tokens=256, is_draft=True)
        self.draft.model.set_embed_and_head(*self.target.model.get_embed_and_head())

    @staticmethod
    def _alloc(runner: ModelRunner, reqs: List[int], starts: List[int], lens: List[int]
               ) -> torch.Tensor:
        locs = []
        for r, s, n in zip(reqs, starts, lens):
            loc = runner.token_to_kv_pool_allocator.alloc(n)
            runner.req_to_token_pool.write(r, s, loc)
            locs.append(loc)
        return torch.cat(locs)

    def reset(self) -> None:
        """Free every slot (each test starts clean even if an earlier one failed midway)."""
        for runner in (self.target, self.draft):
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()

    def new_reqs(self, runner: ModelRunner, n: int) -> List[int]:
        reqs = runner.req_to_token_pool.alloc(n)
        runner.kda_state_pool.clear_slots(reqs)
        return reqs

    def extend(self, runner: ModelRunner, reqs: List[int], ids: List[torch.Tensor],
               prefix: List[int], hidden: torch.Tensor = None):
        lens = [len(x) for x in ids]
        loc = self._alloc(runner, reqs, prefix, lens)
        fb = ForwardBatch.for_extend(torch.cat(ids), reqs, prefix, lens, loc,
                                     return_full_logits=True,
                                     capture_hidden_mode=CaptureHiddenMode.FULL)
        return self._run(runner, fb, hidden)

    def decode(self, runner: ModelRunner, reqs: List[int], ids: torch.Tensor,
               seq_lens: List[int], hidden: torch.Tensor = None):
        loc = self._alloc(runner, reqs, [s - 1 for s in seq_lens], [1] * len(reqs))
        fb = ForwardBatch.for_decode(ids, torch.tensor(reqs), torch.tensor(seq_lens), loc,
                                     capture_hidden_mode=CaptureHiddenMode.FULL)
        return self._run(runner, fb, hidden)

    @staticmethod
    def _run(runner: ModelRunner, fb: ForwardBatch, hidden):
        if hidden is None:
            return runner.forward(fb)
        # ModelRunner.forward has no hidden-state argument: attach the handles as it does and
        # call the draft model directly.
        fb.req_to_token_pool = runner.req_to_token_pool
        fb.token_to_kv_pool = runner.token_to_kv_pool
        fb.kda_state_pool = runner.kda_state_pool
        fb.attn_backend = runner.attn_backend
        runner.attn_backend.init_forward_metadata(fb)
        with torch.no_grad():
            return runner.model.forward(fb.input_ids, fb.positions, fb, hidden)


def _prompts(seed: int, lens=PROMPT_LENS) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen) for n in lens]


@pytest.fixture(scope="module", params=[None, 16], ids=["q_lora_null", "q_lora_16"])
def setup(request, tmp_path_factory) -> Tuple[Served, ReferenceBailingMoeV3]:
    path = str(tmp_path_factory.mktemp(f"ck_{request.param}"))
    write_random_checkpoint(path, tiny_config(q_lora_rank=request.param), seed=3,
                            max_shard_bytes=400_000)
    ref = ReferenceBailingMoeV3.from_pretrained(path, kda_mode="recurrent").eval()
    return Served(path), ref


@torch.no_grad()
def test_prefill_and_decode_logits(setup):
    served, ref = setup
    served.reset()
    prompts = _prompts(0)
    reqs = served.new_reqs(served.target, len(prompts))
    out = served.extend(served.target, reqs, prompts, [0] * len(prompts))
    start = 0
    seqs = [p.clone() for p in prompts]
    for i, p in enumerate(prompts):
        r_logits, r_hidden = ref(p[None])
        n = len(p)
        _assert_close(f"prefill logits req {i}", out.next_token_logits[start:start + n],
                      r_logits[0])
        _assert_close(f"prefill hidden req {i}", out.hidden_states[start:start + n], r_hidden[0])
        start += n
    # a few batched greedy decode steps (greedy by the reference, so both sides see equal ids)
    for step in range(3):
        nxt = torch.stack([ref(s[None])[0][0, -1].argmax() for s in seqs])
        seqs = [torch.cat([s, nxt[i:i + 1]]) for i, s in enumerate(seqs)]
        out = served.decode(served.target, reqs, nxt, [len(s) for s in seqs])
        for i, s in enumerate(seqs):
            r_logits, r_hidden = ref(s[None])
            _assert_close(f"decode {step} logits req {i}", out.next_token_logits[i],
                          r_logits[0, -1])
            _assert_close(f"decode {step} hidden req {i}", out.hidden_states[i], r_hidden[0, -1])


@torch.no_grad()
def test_extend_after_cached_prefix(setup):
    """A second chunk (EXTEND with a prefix in the MLA cache and KDA state) matches recompute."""
    served, ref = setup
    served.reset()
    first, second = _prompts(1, (9, 11)), _prompts(2, (7, 14))
    reqs = served.new_reqs(served.target, 2)
    served.extend(served.target, reqs, first, [0, 0])
    out = served.extend(served.target, reqs, second, [len(x) for x in first])
    start = 0
    for i in range(2):
        full = torch.cat([first[i], second[i]])
        r_logits, _ = ref(full[None])
        n = len(second[i])
        _assert_close(f"chunk-2 logits req {i}", out.next_token_logits[start:start + n],
                      r_logits[0, len(first[i]):])
        start += n


@torch.no_grad()
def test_nextn_draft_matches_reference_mtp(setup):
    served, ref = setup
    served.reset()
    prompts = _prompts(4, (10, 17))
    extra = _prompts(5, (1, 1))
    reqs_t = served.new_reqs(served.target, 2)
    out_t = served.extend(served.target, reqs_t, prompts, [0, 0])
    # draft rows pair the target hidden h_t with token t+1 (the last row with an extra token)
    nxt = [torch.cat([p[1:], e]) for p, e in zip(prompts, extra)]
    reqs_d = served.new_reqs(served.draft, 2)
    out_d = served.extend(served.draft, reqs_d, nxt, [0, 0], hidden=out_t.hidden_states)
    start = 0
    for i, p in enumerate(prompts):
        _, r_hidden = ref(p[None])
        m_logits, m_hidden = ref.mtp_forward(r_hidden, nxt[i][None])
        n = len(p)
        _assert_close(f"mtp logits req {i}", out_d.next_token_logits[start:start + n], m_logits[0])
        _assert_close(f"mtp hidden req {i}", out_d.hidden_states[start:start + n], m_hidden[0])
        start += n
    # one more step: the target decodes token extra (position T), the draft takes (h_T, token T+1)
    seqs = [torch.cat([p, e]) for p, e in zip(prompts, extra)]
    out_t = served.decode(served.target, reqs_t, torch.cat(extra), [len(s) for s in seqs])
    after = _prompts(6, (1, 1))
    out_d = served.decode(served.draft, reqs_d, torch.cat(after), [len(s) for s in seqs],
                          hidden=out_t.hidden_states)
    for i, s in enumerate(seqs):
        _, r_hidden = ref(s[None])
        m_logits, _ = ref.mtp_forward(r_hidden, torch.cat([s[1:], after[i]])[None])
        _assert_close(f"mtp decode logits req {i}", out_d.next_token_logits[i], m_logits[0, -1])
