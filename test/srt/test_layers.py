"""Unit tests of the parallel layers: norms, RoPE, clamped SwiGLU, linear/embedding loaders, logits."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from layer_test_utils import fake_tp
from sglang.srt.layers import vocab_parallel_embedding as vpe
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import GatedRMSNorm, RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_loader.weight_utils import LazyWeight




class SliceOnly(LazyWeight):
    """A LazyWeight that fails if anyone materialises the whole tensor."""

    def __init__(self, name, tensor):
        base = LazyWeight.from_tensor(name, tensor)
        super().__init__(name, base.shape, base.dtype, base._slicer)

    def load(self):
        raise AssertionError(f"{self.name}: whole tensor loaded where a slice suffices")


def lw(name, t):
    return LazyWeight.from_tensor(name, t)


# --------------------------------------------------------------------------------- norms
def test_rmsnorm_formula_and_residual():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data = torch.randn(16)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expect)
    y, res = norm(x, r)
    torch.testing.assert_close(res, x + r)
    s = x + r
    torch.testing.assert_close(y, s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5) * norm.weight)
    out = norm(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expect, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="RMSNorm"):
        norm(torch.randn(2, 8))


def test_gated_rmsnorm_sigmoid_and_swish():
    torch.manual_seed(1)
    x, g = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    w = torch.randn(8)
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    norm = GatedRMSNorm(8, 1e-6, "sigmoid")
    norm.weight.data = w.clone()
    torch.testing.assert_close(norm(x, g), normed * torch.sigmoid(g))
    swish = GatedRMSNorm(8, 1e-6, "swish")
    swish.weight.data = w.clone()
    torch.testing.assert_close(swish(x, g), normed * g * torch.sigmoid(g))
    with pytest.raises(ValueError):
        norm(x, g[..., :4])


# --------------------------------------------------------------------------------- rope
def _pairwise_rope(x, positions, base, interleaved):
    """Explicit per-pair rotation, one plane at a time (fp64)."""
    d = x.shape[-1]
    out = x.clone().double()
    xd = x.double()
    for t, p in enumerate(positions.tolist()):
        for i in range(d // 2):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            ang = p * base ** (-2.0 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            out[t, ..., a] = xd[t, ..., a] * c - xd[t, ..., b] * s
            out[t, ..., b] = xd[t, ..., b] * c + xd[t, ..., a] * s
    return out


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_matches_pairwise_formula(interleaved):
    torch.manual_seed(2)
    rope = RotaryEmbedding(8, 8, max_position_embeddings=16, base=10000.0,
                           is_neox_style=not interleaved)
    pos = torch.tensor([0, 3, 15, 40])  # 40 > max_position: the table must be grown first
    q, k = torch.randn(4, 3, 8), torch.randn(4, 8)
    with pytest.raises(IndexError):  # never grown by reading positions on the host
        rope(pos, q, k)
    rope.cos_sin_cache(pos.device, 41)  # what ModelRunner does once for the NEXTN headroom
    qr, kr = rope(pos, q, k)
    torch.testing.assert_close(qr.double(), _pairwise_rope(q, pos, 10000.0, interleaved),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kr.double(), _pairwise_rope(k, pos, 10000.0, interleaved),
                               atol=1e-5, rtol=1e-5)
    assert rope.cos_sin_cache(pos.device).shape[0] >= 41


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(3)
    rope = RotaryEmbedding(4, 4, 4096, base=6e6, is_neox_style=False)
    q, k = torch.randn(1, 4), torch.randn(1, 4)

    def score(pq, pk):
        qr, _ = rope(torch.tensor([pq]), q, q)
        kr, _ = rope(torch.tensor([pk]), k, k)
        return float((qr * kr).sum())

    assert score(10, 3) == pytest.approx(score(1010, 1003), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-4)


# --------------------------------------------------------------------------------- swiglu
def test_silu_and_mul_plain_and_clamped():
    x = torch.tensor([[3.0, -0.5, 1.0, 10.0, -10.0, 0.3]])  # gate | up, I = 3
    gate, up = x[:, :3], x[:, 3:]
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up)
    limit = 1.5
    out = SiluAndMul(limit)(x)
    expect = torch.minimum(F.silu(gate), torch.tensor(limit)) * up.clamp(-limit, limit)
    torch.testing.assert_close(out, expect)
    # The clamp bites on both sides: silu(3)=2.86 and up=10/-10 are cut.
    assert not torch.allclose(out, SiluAndMul()(x))
    assert out[0, 0] == pytest.approx(limit * limit)
    assert out[0, 2] == pytest.approx(float(F.silu(torch.tensor(1.0))) * 0.3, rel=1e-6)  # no cut
    with pytest.raises(ValueError):
        SiluAndMul(-1.0)


# --------------------------------------------------------------------------------- linear
def test_replicated_linear_loads_and_converts_dtype():
    w = torch.randn(6, 4, dtype=torch.bfloat16)
    lin = ReplicatedLinear(4, 6, params_dtype=torch.float32)
    lin.weight.weight_loader(lin.weight, lw("x.weight", w))
    assert lin.weight.dtype == torch.float32
    torch.testing.assert_close(lin.weight.data, w.float())
    lin.weight.qualname = "model.x.weight"
    with pytest.raises(ValueError, match="model.x.weight"):
        lin.weight.weight_loader(lin.weight, lw("x.weight", torch.randn(6, 5)))


def test_column_and_row_parallel_shards_reassemble():
    torch.manual_seed(4)
    wc, wr = torch.randn(8, 6), torch.randn(5, 8)
    x = torch.randn(3, 6)
    col_parts, row_sum = [], torch.zeros(3, 5)
    for rank in range(2):
        with fake_tp(rank, 2):
            col = ColumnParallelLinear(6, 8)
            row = RowParallelLinear(8, 5, reduce_results=False)
        col.weight.weight_loader(col.weight, SliceOnly("c.weight", wc))
        row.weight.weight_loader(row.weight, SliceOnly("r.weight", wr))
        assert col.weight.shape == (4, 6) and row.weight.shape == (5, 4)
        torch.testing.assert_close(col.weight.data, wc[rank * 4:(rank + 1) * 4])
        part = col(x)  # this rank's output columns feed the row layer's input block
        col_parts.append(part)
        row_sum += row(part)
    torch.testing.assert_close(torch.cat(col_parts, -1), x @ wc.t())
    torch.testing.assert_close(row_sum, x @ wc.t() @ wr.t())
    with fake_tp(1, 2):
        col = ColumnParallelLinear(6, 8)
    with pytest.raises(ValueError, match="rows"):
        col.weight.weight_loader(col.weight, lw("c.weight", torch.randn(6, 6)))
    with pytest.raises(ValueError, match="not divisible"):
        with fake_tp(0, 3):
            ColumnParallelLinear(6, 8)


def test_merged_column_parallel_layout_and_fused_load():
    torch.manual_seed(5)
    wa, wb = torch.randn(4, 3), torch.randn(6, 3)
    for rank in range(2):
        with fake_tp(rank, 2):
            sep = MergedColumnParallelLinear(3, [4, 6])
            fused = MergedColumnParallelLinear(3, [4, 6])
        sep.weight.weight_loader(sep.weight, SliceOnly("a", wa), 0)
        sep.weight.weight_loader(sep.weight, SliceOnly("b", wb), 1)
        fused.weight.weight_loader(fused.weight, SliceOnly("ab", torch.cat([wa, wb])), None)
        expect = torch.cat([wa[rank * 2:(rank + 1) * 2], wb[rank * 3:(rank + 1) * 3]])
        torch.testing.assert_close(sep.weight.data, expect)
        torch.testing.assert_close(fused.weight.data, expect)
        a, b = sep.split_output(sep(torch.eye(3)))
        assert a.shape == (3, 2) and b.shape == (3, 3)
    with pytest.raises(ValueError, match="shard_id"):
        sep.weight.weight_loader(sep.weight, lw("a", wa), 2)
    with pytest.raises(ValueError, match="rows"):
        sep.weight.weight_loader(sep.weight, lw("a", wb), 0)


# --------------------------------------------------------------------------------- vocab
def test_vocab_parallel_embedding_and_head_padding(monkeypatch):
    torch.manual_seed(6)
    vocab, dim = 7, 4  # not divisible by tp=2: the last rank holds one zero padding row
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 6, 2])
    monkeypatch.setattr(vpe, "tensor_model_parallel_all_reduce", lambda x: x)
    total = torch.zeros(len(ids), dim)
    for rank in range(2):
        with fake_tp(rank, 2):
            emb = VocabParallelEmbedding(vocab, dim)
            head = ParallelLMHead(vocab, dim)
        emb.weight.weight_loader(emb.weight, SliceOnly("e", table))
        head.weight.weight_loader(head.weight, SliceOnly("h", table))
        assert emb.weight.shape == (4, dim)
        if rank == 1:
            assert torch.all(emb.weight.data[3] == 0)
        torch.testing.assert_close(head.weight.data, emb.weight.data)
        total += emb(ids)  # the all-reduce, done by hand
    torch.testing.assert_close(total, table[ids])
    with pytest.raises(ValueError):
        emb.weight.weight_loader(emb.weight, lw("e", torch.randn(8, dim)))


# --------------------------------------------------------------------------------- logits
def _batch(mode, lens, **kw):
    t = sum(lens)
    fb = ForwardBatch.for_extend(torch.zeros(t, dtype=torch.int64), list(range(1, len(lens) + 1)),
                                 [0] * len(lens), lens, torch.arange(t), forward_mode=mode, **kw)
    return fb


def test_logits_processor_rows_and_hidden_capture():
    torch.manual_seed(7)
    head = torch.randn(5, 3)
    hidden = torch.randn(6, 3)
    lp = LogitsProcessor(5)
    fb = _batch(ForwardMode.EXTEND, [2, 4], capture_hidden_mode=CaptureHiddenMode.LAST)
    out = lp(hidden, head, fb)
    assert out.next_token_logits.dtype == torch.float32
    torch.testing.assert_close(out.next_token_logits, hidden[[1, 5]] @ head.t())
    torch.testing.assert_close(out.hidden_states, hidden[[1, 5]])
    fb = _batch(ForwardMode.EXTEND, [2, 4], return_full_logits=True,
                capture_hidden_mode=CaptureHiddenMode.FULL)
    out = lp(hidden, head, fb)
    torch.testing.assert_close(out.next_token_logits, hidden @ head.t())
    assert out.hidden_states is hidden
    out = lp(hidden, head, _batch(ForwardMode.TARGET_VERIFY, [3, 3]))
    assert out.next_token_logits.shape == (6, 5) and out.hidden_states is None
    dec = ForwardBatch.for_decode(torch.zeros(2, dtype=torch.int64), torch.tensor([1, 2]),
                                  torch.tensor([5, 9]), torch.tensor([3, 4]),
                                  capture_hidden_mode=CaptureHiddenMode.LAST)
    out = lp(hidden[:2], ParallelLMHead(5, 3), dec)
    assert out.next_token_logits.shape == (2, 5)
    torch.testing.assert_close(out.hidden_states, hidden[:2])
    # A padded vocab (tp > 1 shards) is trimmed back to vocab_size.
    out = LogitsProcessor(4)(hidden, head, _batch(ForwardMode.EXTEND, [6]))
    assert out.next_token_logits.shape == (1, 4)
