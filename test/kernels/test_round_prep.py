"""sgl_kernel.round_prep (the round's index chain in one launch) against its torch reference and
through FutureMap.assign_round. Without CUDA the kernel runs in Triton's CPU interpreter."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, needs_triton

pytestmark = needs_triton


def _state(seed: int, slots: int = 6, context: int = 32):
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, 1000, (slots + 1, context), generator=g,
                                 dtype=torch.int32).to(DEVICE)
    seq_lens = torch.randint(0, context - 8, (slots + 1,), generator=g).to(DEVICE)
    seq_lens[0] = 0  # the padding slot
    tokens = torch.randint(0, 5000, (slots + 1,), generator=g).to(DEVICE)
    return req_to_token, seq_lens, tokens


@pytest.mark.parametrize("n", [1, 4, 6])  # plain decode; NEXTN-3 chain; a non-power-of-2 width
def test_kernel_equals_the_torch_reference(n):
    from sgl_kernel.round_prep import assign_round_cache_locs, assign_round_cache_locs_ref

    r2t, seq_lens, tokens = _state(n)
    slots = torch.tensor([3, 1, 0, 5], device=DEVICE)  # a padding row (slot 0) among them
    loc = torch.arange(100, 100 + 4 * n, device=DEVICE).view(4, n)
    ref_map = r2t.clone()
    ref_prefix, ref_tokens = assign_round_cache_locs_ref(ref_map, seq_lens, slots, loc, tokens)
    prefix, got_tokens = assign_round_cache_locs(r2t, seq_lens, slots, loc, tokens)
    assert torch.equal(prefix, ref_prefix) and prefix.dtype == torch.int64
    assert torch.equal(got_tokens, ref_tokens)
    assert torch.equal(r2t, ref_map)  # the same entries written, nothing else touched
    # What the reference promises, spelled out for one row.
    s = 3
    assert torch.equal(r2t[s, seq_lens[s]:seq_lens[s] + n].long(), loc[0])
    # Without tokens only the lengths come back.
    p2, t2 = assign_round_cache_locs(r2t, seq_lens, slots, loc)
    assert t2 is None and torch.equal(p2, ref_prefix)


def test_bad_shapes_are_refused():
    from sgl_kernel.round_prep import assign_round_cache_locs

    r2t, seq_lens, _ = _state(0)
    with pytest.raises(ValueError, match=r"loc \[B, N\]"):
        assign_round_cache_locs(r2t, seq_lens, torch.tensor([1, 2], device=DEVICE),
                                torch.zeros(3, 1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        loc = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)[:, :1]
        assign_round_cache_locs(r2t, seq_lens, torch.tensor([1, 2, 3, 4], device=DEVICE), loc)


def test_future_map_assign_round_uses_either_path_alike(monkeypatch):
    from sglang.srt.rounds.relay import FutureMap

    r2t, seq_lens, tokens = _state(7)
    maps = []
    for fused in (False, True):
        # fused: the CUDA default; the interpreter runs the same kernel here
        fm = FutureMap(6, DEVICE, fused_prep=fused)
        assert fm.fused_prep is fused
        fm.seq_lens.copy_(seq_lens)
        fm.tokens.copy_(tokens)
        out_map = r2t.clone()
        prefix, toks = fm.assign_round(out_map, torch.tensor([2, 4], device=DEVICE),
                                       torch.tensor([[7, 8], [9, 10]], device=DEVICE),
                                       with_tokens=True)
        maps.append((prefix, toks, out_map))
    for a, b in zip(*maps):
        assert torch.equal(a, b)


def test_pdl_switch_leaves_results_unchanged():
    """With set_pdl(True) the kernel still equals the reference (under the interpreter the
    switch stays off: the PDL code path is inert there)."""
    from sgl_kernel import pdl
    from sgl_kernel.round_prep import assign_round_cache_locs, assign_round_cache_locs_ref

    r2t, seq_lens, tokens = _state(11)
    slots = torch.tensor([2, 5, 0], device=DEVICE)
    loc = torch.arange(200, 209, device=DEVICE).view(3, 3)
    ref_map = r2t.clone()
    ref = assign_round_cache_locs_ref(ref_map, seq_lens, slots, loc, tokens)
    try:
        pdl.set_pdl(True)
        got = assign_round_cache_locs(r2t, seq_lens, slots, loc, tokens)
    finally:
        pdl.set_pdl(False)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(r2t, ref_map)


@pytest.mark.gpu
def test_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: two rounds' index chains back to back (the second over the first's
    map), launched with PDL inside a CUDA graph, give the same bits as without."""
    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.round_prep import assign_round_cache_locs

    skip_without_pdl()
    r2t0, seq_lens0, tokens = _state(12)
    r2t, seq_lens = torch.empty_like(r2t0), torch.empty_like(seq_lens0)
    slots = torch.tensor([3, 1, 0, 5], device=DEVICE)
    loc = torch.arange(100, 116, device=DEVICE).view(4, 4)

    def step():
        r2t.copy_(r2t0)
        seq_lens.copy_(seq_lens0)
        p1, t1 = assign_round_cache_locs(r2t, seq_lens, slots, loc, tokens)
        seq_lens[slots] += 4  # the round's tokens committed
        p2, t2 = assign_round_cache_locs(r2t, seq_lens, slots, loc + 50, tokens)
        return p1, t1, p2, t2, r2t

    assert_bitwise_equal(outputs_without_and_with_pdl(step))
