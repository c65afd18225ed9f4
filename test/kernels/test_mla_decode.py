"""sgl_kernel.mla_decode (MLA decode / chain-verify attention, lengths on the device) against the
torch reference ``mla_decode_attention`` over the padded cache gather.

Without CUDA the kernels run in Triton's CPU interpreter (fp32 / fp16: the interpreter has no bf16)
at small dims; the ``gpu`` test checks bf16 at Ling-3.0-flash's dims (512 + 64, 32 heads).
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton
from sglang.srt.layers.attention.mla_ops import mla_decode_attention

pytestmark = needs_triton

V, DR, H = 32, 16, 4  # latent (value) dim, rope dim, heads
SCALE = 1.0 / math.sqrt(24.0)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


class Cache:
    """A latent pool ``[slots, Dk]`` and a req->token map whose rows hold scattered, distinct
    slots; request row 0 is the padding row (all slot 0), as in ReqToTokenPool."""

    def __init__(self, reqs=4, cap=64, v=V, dr=DR, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        slots = reqs * cap + 1
        self.v, self.dk, self.dtype = v, v + dr, dtype
        self.kv = torch.randn(slots, self.dk, generator=gen).to(DEVICE, dtype)
        self.req_to_token = torch.zeros(reqs + 1, cap, dtype=torch.int32)
        self.req_to_token[1:] = (torch.randperm(slots - 1, generator=gen)[:reqs * cap] + 1).view(
            reqs, cap).to(torch.int32)
        self.req_to_token = self.req_to_token.to(DEVICE)
        self.gen = gen

    def query(self, b, rows):
        return torch.randn(b, rows, self.dk, generator=self.gen).to(DEVICE, self.dtype)

    def reference(self, q, req_pool_indices, positions):
        """``mla_decode_attention`` over the gather of every request's full row of the map."""
        kv = self.kv[self.req_to_token[req_pool_indices].long()]  # [B, cap, Dk]
        heads = q.shape[1] // positions.shape[1]
        lens = (positions + 1).repeat_interleave(heads, dim=1)
        return mla_decode_attention(q, kv, lens, self.v, SCALE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _run(cache, req_pool_indices, positions, heads=H, **kw):
    from sgl_kernel.mla_decode import mla_decode_fwd

    rpi = torch.tensor(req_pool_indices, device=DEVICE)
    pos = torch.tensor(positions, device=DEVICE).view(len(req_pool_indices), -1)
    q = cache.query(rpi.shape[0], pos.shape[1] * heads)
    out = mla_decode_fwd(q, cache.kv, cache.req_to_token, rpi, pos, cache.v, SCALE, **kw)
    return out, cache.reference(q, rpi, pos)


FP32, FP16, SLOW = torch.float32, torch.float16, pytest.mark.slow  # SLOW: the interpreter


@pytest.mark.parametrize("dtype,num_splits", [
    (FP32, None), (FP16, None), (FP32, 3), pytest.param(FP16, 3, marks=SLOW),
])
def test_decode_matches_reference(dtype, num_splits):
    """N = 1: lengths 1, 17 and 40 (40 spans three 16-key splits in the interpreter), a padding
    row (request row 0: every key is pool slot 0) at position 0 and a long padding row."""
    cache = Cache(dtype=dtype)
    out, ref = _run(cache, [3, 1, 0, 4, 0], [0, 16, 0, 39, 9], num_splits=num_splits)
    assert out.shape == (5, H, V) and out.dtype == dtype
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype,heads", [  # 12 rows (one partial block), 15 rows
    (FP32, H), pytest.param(FP16, H, marks=SLOW), pytest.param(FP32, 5, marks=SLOW),
    pytest.param(FP16, 5, marks=SLOW),
])
def test_chain_matches_reference(dtype, heads):
    """N = 3 tokens per request at their own positions (each sees keys up to itself); chains
    that start at position 0 and that straddle a split boundary (15, 16, 17)."""
    cache = Cache(dtype=dtype, seed=1)
    positions = [[0, 1, 2], [15, 16, 17], [37, 38, 39], [0, 1, 2]]
    out, ref = _run(cache, [2, 4, 1, 0], positions, heads=heads, num_splits=3)
    assert out.shape == (4, 3 * heads, V)
    assert _rel(out, ref) < TOL[dtype]


def test_dims_not_powers_of_two():
    """v_dim 24 and rope 8: both parts are padded to a power of two and masked."""
    cache = Cache(v=24, dr=8, seed=2)
    out, ref = _run(cache, [1, 2], [[5, 6], [30, 31]], num_splits=2)
    assert _rel(out, ref) < TOL[torch.float32]


def test_positions_clamped_and_negative():
    """A position past the capacity sees the whole row of the map; a negative one sees no key
    and gives zeros (the reference's empty softmax would be NaN)."""
    cache = Cache(seed=3)
    from sgl_kernel.mla_decode import mla_decode_fwd

    q = cache.query(2, H)
    rpi = torch.tensor([1, 2], device=DEVICE)
    out = mla_decode_fwd(q, cache.kv, cache.req_to_token, rpi,
                         torch.tensor([[500], [-1]], device=DEVICE), V, SCALE)
    ref = cache.reference(q[:1], rpi[:1], torch.tensor([[63]], device=DEVICE))
    assert _rel(out[:1], ref) < TOL[torch.float32]
    assert torch.equal(out[1], torch.zeros_like(out[1]))


class _GridRecorder:
    """Stands in for a Triton kernel object and records the grid of every launch."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_lengths_do_not_change_launch(monkeypatch):
    """Two length sets through the same preallocated out / scratch: identical grids, results
    right both times (what a CUDA graph replay needs)."""
    import sgl_kernel.mla_decode as mod

    split, merge = _GridRecorder(mod._mla_split_kernel), _GridRecorder(mod._mla_merge_kernel)
    monkeypatch.setattr(mod, "_mla_split_kernel", split)
    monkeypatch.setattr(mod, "_mla_merge_kernel", merge)
    cache = Cache(seed=4)
    b, n = 2, 2
    splits = mod.mla_decode_num_splits(b, n * H, cache.req_to_token.shape[1], cache.dk, DEVICE)
    out = torch.empty(b, n * H, V, device=DEVICE)
    scratch = torch.empty(mod.mla_decode_scratch_numel(b, n * H, splits, V), device=DEVICE)
    rpi = torch.tensor([1, 3], device=DEVICE)
    pos = torch.empty(b, n, dtype=torch.int64, device=DEVICE)
    q = cache.query(b, n * H)
    for lengths in ([[2, 3], [0, 1]], [[50, 51], [33, 34]]):
        pos.copy_(torch.tensor(lengths))  # refilled in place, as a graph's static input
        res = mod.mla_decode_fwd(q, cache.kv, cache.req_to_token, rpi, pos, V, SCALE, out=out,
                                 scratch=scratch)
        assert res is out
        assert _rel(out, cache.reference(q, rpi, pos)) < TOL[torch.float32]
    assert len(set(split.grids)) == 1 and len(set(merge.grids)) == 1 and len(split.grids) == 2
    # The merge splits each row's V over programs (V = 32 in 16-channel pieces here).
    merge_v = mod._config(cache.dk).merge_block_v
    assert split.grids[0] == (b, 1, splits) and merge.grids[0] == (b, n * H, -(-V // merge_v))
    assert merge.grids[0][2] > 1


def test_num_splits_depends_on_capacity_and_shapes_only():
    from sgl_kernel.mla_decode import MAX_SPLITS, mla_decode_num_splits

    small = mla_decode_num_splits(1, 32, 16, 576, DEVICE)
    large = mla_decode_num_splits(1, 32, 1 << 20, 576, DEVICE)
    assert small == 1 and 1 < large <= MAX_SPLITS
    # More requests (or rows) share the programs: never more splits than for one request.
    assert mla_decode_num_splits(64, 32, 1 << 20, 576, DEVICE) <= large


def test_rejects_bad_inputs():
    from sgl_kernel.mla_decode import mla_decode_fwd

    cache = Cache()
    q, rpi = cache.query(2, 2 * H), torch.tensor([1, 2], device=DEVICE)
    pos = torch.tensor([[3, 4], [5, 6]], device=DEVICE)
    args = (cache.kv, cache.req_to_token, rpi)
    with pytest.raises(ValueError, match="positions must be"):
        mla_decode_fwd(q, *args, pos.view(-1), V, SCALE)
    with pytest.raises(ValueError, match="positions must be"):
        mla_decode_fwd(cache.query(2, 2 * H + 1), *args, pos, V, SCALE)
    with pytest.raises(ValueError, match="v_dim"):
        mla_decode_fwd(q, *args, pos, cache.dk + 1, SCALE)
    with pytest.raises(ValueError, match="scratch"):
        mla_decode_fwd(q, *args, pos, V, SCALE, scratch=torch.empty(3, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        mla_decode_fwd(q, *args, pos, V, SCALE, out=torch.empty(2, 2 * H, V + 1, device=DEVICE))
    with pytest.raises(ValueError, match="integer"):
        mla_decode_fwd(q, *args, pos.float(), V, SCALE)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode_fwd(q, *args, pos, V, SCALE, num_splits=0)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="bf16"):
            mla_decode_fwd(q.bfloat16(), cache.kv.bfloat16(), cache.req_to_token, rpi, pos, V,
                           SCALE)


def test_benchmark_smoke_run(capsys):
    """benchmark/kernels/bench_mla_decode.py --smoke: tiny dims, one row per (context, N)."""
    path = Path(__file__).resolve().parents[2] / "benchmark/kernels/bench_mla_decode.py"
    spec = importlib.util.spec_from_file_location("bench_mla_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 4, rows  # contexts {40, 70} x N {1, 2}


@pytest.mark.gpu
@pytest.mark.parametrize("context", [1024, 8192])
@pytest.mark.parametrize("n", [1, 4, 16])  # 16, 32 and 64 query rows per program
def test_flash_dims_bf16(context, n):
    """bf16 at Flash's per-rank MLA dims (512 + 64, 32 heads) against the torch reference: the
    max error relative to max |ref| stays below 1e-2 (bf16 outputs round at 4e-3), and the
    kernel is no further from an fp32 evaluation than the bf16 torch path is, plus 2e-3."""
    from sgl_kernel.mla_decode import mla_decode_fwd

    gen = torch.Generator(device="cuda").manual_seed(context + n)
    v, dk, heads, cap = 512, 576, 32, 8192 + 64
    kv = torch.randn(2 * cap + 1, dk, device="cuda", generator=gen).bfloat16()
    req_to_token = torch.zeros(3, cap, dtype=torch.int32, device="cuda")
    perm = torch.randperm(2 * cap, device="cuda", generator=gen) + 1
    req_to_token[1:] = perm.view(2, cap).int()
    rpi = torch.tensor([1, 2, 0], device="cuda")
    lengths = torch.tensor([context, context // 3 + 5, 1], device="cuda")
    pos = (lengths - n).clamp_min(0).view(-1, 1) + torch.arange(n, device="cuda")
    q = torch.randn(3, n * heads, dk, device="cuda", generator=gen).bfloat16()
    scale = 192 ** -0.5  # Flash: qk_nope 128 + rope 64
    out = mla_decode_fwd(q, kv, req_to_token, rpi, pos, v, scale)
    gathered = kv[req_to_token[rpi, :context + n].long()]
    lens = (pos + 1).repeat_interleave(heads, dim=1)
    ref = mla_decode_attention(q, gathered, lens, v, scale)
    exact = mla_decode_attention(q.float(), gathered.float(), lens, v, scale)
    assert _rel(out, ref) < 1e-2
    err = float((out.float() - exact).norm() / exact.norm())
    ref_err = float((ref.float() - exact).norm() / exact.norm())
    assert err < ref_err + 2e-3, (err, ref_err)


def test_pdl_switch_leaves_results_unchanged():
    """With set_pdl(True) both kernels still match the reference (under the interpreter the
    switch stays off: the PDL code path is inert there)."""
    from sgl_kernel import pdl

    cache = Cache(seed=3)
    try:
        pdl.set_pdl(True)
        out, ref = _run(cache, [2, 0, 3], [[20, 21], [0, 1], [5, 6]], num_splits=2)
    finally:
        pdl.set_pdl(False)
    assert _rel(out, ref) < TOL[torch.float32]


@pytest.mark.gpu
def test_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: a decode and a chain verify at Flash's MLA dims (split and merge
    kernels each), launched with PDL inside a CUDA graph, give the same bits as without."""
    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.mla_decode import mla_decode_fwd

    skip_without_pdl()
    gen = torch.Generator(device="cuda").manual_seed(5)
    v, dk, heads, cap = 512, 576, 16, 2048
    kv = torch.randn(2 * cap + 1, dk, device="cuda", generator=gen).bfloat16()
    req_to_token = torch.zeros(3, cap, dtype=torch.int32, device="cuda")
    req_to_token[1:] = (torch.randperm(2 * cap, device="cuda", generator=gen) + 1).view(2, cap).int()
    rpi = torch.tensor([1, 2], device="cuda")
    pos1 = torch.tensor([[1500], [300]], device="cuda")
    pos3 = pos1 + torch.arange(1, 4, device="cuda")
    q1_0 = torch.randn(2, heads, dk, device="cuda", generator=gen).bfloat16()
    q3 = torch.randn(2, 3 * heads, dk, device="cuda", generator=gen).bfloat16()
    q1 = torch.empty_like(q1_0)

    def step():
        q1.copy_(q1_0)
        decode = mla_decode_fwd(q1, kv, req_to_token, rpi, pos1, v, dk ** -0.5)
        return decode, mla_decode_fwd(q3, kv, req_to_token, rpi, pos3, v, dk ** -0.5)

    assert_bitwise_equal(outputs_without_and_with_pdl(step))


@pytest.mark.parametrize("adaptive", [False, True])
def test_batch_invariant_split_is_bit_exact_across_launch_shapes(adaptive):
    """With the fixed split boundaries of ``mla_decode_batch_invariant_split`` a query token's
    output is bit-identical whether it runs alone (a 1-token decode), inside a 4-token verify
    chain, or beside another request: keys it cannot see add exact zeros and the key groups
    and their merge order are the same (what bit-exact speculation needs). The adaptive split
    (from the request's longest query) groups the keys differently in the two launches, and
    its results differ in the last bits.

    16 heads: each token's rows fill one 16-row program, as Ling's 32 heads fill two. (On the
    GPU the tensor-core product computes each row independently of its neighbours; the
    interpreter's matmul may round a row differently at another row offset of the tile.)"""
    heads = 16
    from sgl_kernel.mla_decode import mla_decode_batch_invariant_split, mla_decode_fwd

    cache = Cache(seed=5)
    cap = cache.req_to_token.shape[1]
    splits, split_len = mla_decode_batch_invariant_split(cap, cache.dk)
    assert splits * split_len >= cap and splits > 1  # several groups even at this capacity
    chain = [37, 38, 39, 40]
    q = cache.query(1, len(chain) * heads)
    other = cache.query(1, len(chain) * heads)

    def run(rpi, pos, qq):
        plan = {} if adaptive else dict(num_splits=splits, split_len=split_len)
        return mla_decode_fwd(qq, cache.kv, cache.req_to_token, torch.tensor(rpi, device=DEVICE),
                              torch.tensor(pos, device=DEVICE), V, SCALE, **plan)

    verify = run([2], [chain], q)[0]
    beside = run([3, 2], [[9, 10, 11, 12], chain], torch.cat([other, q]))[1]
    alone = torch.cat([run([2], [[p]], q[:, t * heads:(t + 1) * heads])[0]
                       for t, p in enumerate(chain)])
    if adaptive:
        assert not torch.equal(alone, verify)
    else:
        assert torch.equal(verify, beside) and torch.equal(alone, verify)
    ref = cache.reference(q, torch.tensor([2], device=DEVICE), torch.tensor([chain], device=DEVICE))
    assert _rel(verify.unsqueeze(0), ref) < TOL[torch.float32]


def test_batch_invariant_split_follows_the_span_not_the_capacity():
    """A speculative runner's request map is wider than a plain one's (its round's position
    headroom); with the same ``span`` (the context length) both get the same split length, so
    a token decoded in one and verified in the other sees the same key groups and rounds the
    same: its output from a 64-wide map equals the one from a 96-wide map holding the same
    slots. A capacity past the spare split is refused."""
    from sgl_kernel.mla_decode import (MAX_SPLITS, mla_decode_batch_invariant_split,
                                       mla_decode_fwd)

    plain = mla_decode_batch_invariant_split(4096, 576, span=4096)
    spec = mla_decode_batch_invariant_split(4096 + 32, 576, span=4096)
    assert plain[1] == spec[1] and plain[0] <= spec[0] <= MAX_SPLITS
    assert spec[0] * spec[1] >= 4096 + 32
    with pytest.raises(ValueError, match="at most 64"):
        mla_decode_batch_invariant_split(2 * 4096, 576, span=4096)

    cache = Cache(seed=8)
    wide = torch.cat([cache.req_to_token, torch.zeros_like(cache.req_to_token)[:, :32]], 1)
    heads, pos = 16, torch.tensor([[50]], device=DEVICE)
    q = cache.query(1, heads)
    rpi = torch.tensor([2], device=DEVICE)
    outs = []
    for r2t in (cache.req_to_token, wide):
        splits, split_len = mla_decode_batch_invariant_split(r2t.shape[1], cache.dk, span=64)
        outs.append(mla_decode_fwd(q, cache.kv, r2t, rpi, pos, V, SCALE, num_splits=splits,
                                   split_len=split_len))
    assert torch.equal(outs[0], outs[1])
    assert _rel(outs[0], cache.reference(q, rpi, pos)) < TOL[torch.float32]


def test_split_len_must_cover_the_capacity():
    from sgl_kernel.mla_decode import mla_decode_fwd

    cache = Cache(seed=6)
    q = cache.query(1, H)
    args = (q, cache.kv, cache.req_to_token, torch.tensor([1], device=DEVICE),
            torch.tensor([[3]], device=DEVICE), V, SCALE)
    with pytest.raises(ValueError, match="cover the capacity 64"):
        mla_decode_fwd(*args, num_splits=2, split_len=16)
    with pytest.raises(ValueError, match="split_len needs num_splits"):
        mla_decode_fwd(*args, split_len=64)
