"""DSpark block acceptance with per-request verify lengths (rounds/dspark/verify.py).

Greedy: hand-written cases and equality with greedy decoding under a cap. Sampling: token-for-
token agreement with the plain reference, compact verifies (rows past the cap zeroed) give the
same result, and losslessness by chi-square: the first two committed tokens follow the target's
joint distribution at every verify length (also when the length looks at the draft right after
the cap), while the cap is respected. A negative control shows the test detects a length that
looks two drafts past the cap.

The statistical tests use fixed seeds (deterministic); ALPHA is the chi-square test's own
false-failure rate, with every expected cell count >= 20.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_test_utils import refuse_host_reads
from sglang.srt.rounds.dspark import verify as dspark_verify
from sglang.srt.rounds.dspark.verify import (
    cap_chain_result,
    greedy_verify_block,
    reference_verify_block,
    rejection_verify_block,
    verify_block,
)
from sglang.srt.rounds.chain import greedy_verify_chain, sample_from_probs
from sglang.test.test_utils import chi_square_pvalue

ALPHA = 1e-3
PAD = -1


# ------------------------------------------------------------------------------------------
# Greedy
# ------------------------------------------------------------------------------------------
DRAFTS = torch.tensor([[5, 6, 7]] * 4)
ARGMAX = torch.tensor([  # the target's argmax after window index 0..3
    [5, 6, 7, 8],  # all match
    [5, 6, 3, 8],  # third draft wrong
    [9, 6, 7, 8],  # first wrong
    [5, 6, 7, 0],  # all match
])


@pytest.mark.parametrize("lens, expect_len, expect_tokens", [
    ([3, 3, 3, 3], [4, 3, 1, 4], [[5, 6, 7, 8], [5, 6, 3, PAD], [9, PAD, PAD, PAD], [5, 6, 7, 0]]),
    ([1, 2, 0, 2], [2, 3, 1, 3], [[5, 6, PAD, PAD], [5, 6, 3, PAD], [9, PAD, PAD, PAD],
                                  [5, 6, 7, PAD]]),
    ([0, 0, 0, 0], [1, 1, 1, 1], [[5, PAD, PAD, PAD], [5, PAD, PAD, PAD], [9, PAD, PAD, PAD],
                                  [5, PAD, PAD, PAD]]),
])
def test_greedy_hand_written(lens, expect_len, expect_tokens):
    res = greedy_verify_block(DRAFTS, ARGMAX, torch.tensor(lens))
    assert res.accept_len.tolist() == expect_len
    assert res.num_accepted.tolist() == [n - 1 for n in expect_len]
    assert res.accepted_tokens.tolist() == expect_tokens
    # The final token is the last committed one and becomes the next anchor.
    assert torch.equal(res.next_seed, res.accepted_tokens.gather(
        1, (res.accept_len - 1).unsqueeze(1)).squeeze(1))
    # Logits instead of the argmax give the same verdict.
    logits = torch.rand(4, 4, 10, generator=torch.Generator().manual_seed(0))
    logits = logits.scatter(-1, ARGMAX.unsqueeze(-1), 5.0)
    again = greedy_verify_block(DRAFTS, logits, torch.tensor(lens))
    assert all(torch.equal(x, y) for x, y in zip(res, again))


def test_greedy_equals_greedy_decoding_under_cap():
    """Property: with a deterministic target next(t), the committed tokens are the first
    accept_len tokens of greedy decoding and accept_len = min(correct drafts, l) + 1."""
    gen = torch.Generator().manual_seed(1)
    vocab, b, g = 7, 3000, 5
    nxt = torch.randint(0, vocab, (vocab,), generator=gen)
    anchor = torch.randint(0, vocab, (b,), generator=gen)
    truth = [anchor]
    for _ in range(g + 1):
        truth.append(nxt[truth[-1]])
    truth = torch.stack(truth, 1)  # [B, g + 2]: anchor and its greedy continuation
    drafts = truth[:, 1:g + 1].clone()
    corrupt = torch.rand(b, g, generator=gen) < 0.2
    drafts[corrupt] = torch.randint(0, vocab, (int(corrupt.sum()),), generator=gen)
    lens = torch.randint(0, g + 1, (b,), generator=gen)
    window = torch.cat([anchor.unsqueeze(1), drafts], 1)
    res = greedy_verify_block(drafts, nxt[window], lens)
    correct = (drafts == truth[:, 1:g + 1]).long().cumprod(1).sum(1)
    assert torch.equal(res.accept_len, torch.minimum(correct, lens) + 1)
    keep = torch.arange(g + 1) < res.accept_len.unsqueeze(1)
    assert torch.equal(res.accepted_tokens[keep], truth[:, 1:][keep])
    assert (res.accepted_tokens[~keep] == PAD).all()
    assert (res.accept_len <= lens + 1).all()


def test_cap_of_full_length_is_identity():
    drafts = torch.cat([torch.zeros(4, 1, dtype=torch.int64), DRAFTS], 1)
    full = greedy_verify_chain(drafts, ARGMAX)
    capped = cap_chain_result(full, torch.full((4,), 3))
    assert torch.equal(capped.accept_len, full.accept_len)
    assert torch.equal(capped.accepted_tokens, full.accepted_tokens)
    assert torch.equal(capped.next_seed, full.next_seed)
    # Out-of-range lengths are clamped into 0..g (no host read could reject them).
    clamped = cap_chain_result(full, torch.tensor([-2, 9, 0, 3]))
    assert clamped.accept_len.tolist() == [1, 3, 1, 4]


# ------------------------------------------------------------------------------------------
# Sampling: agreement with the reference
# ------------------------------------------------------------------------------------------
def random_block(b: int, g: int, v: int, seed: int):
    """Drafts sampled from their q rows, random targets (some rows with q == p, some target
    rows with no mass on the draft), lengths 0..g, uniforms."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(2 * torch.randn(b, g, v, generator=gen), -1)
    p = torch.softmax(2 * torch.randn(b, g + 1, v, generator=gen), -1)
    drafts = torch.stack([sample_from_probs(q[:, k], torch.rand(b, generator=gen))
                          for k in range(g)], 1)
    same = torch.rand(b, generator=gen) < 0.2
    p[same, :g] = q[same]
    hole = torch.rand(b, g, generator=gen) < 0.1  # the target rules the draft out
    p[:, :g][hole] = p[:, :g][hole].scatter(-1, drafts[hole].unsqueeze(-1), 0.0)
    p = p / p.sum(-1, keepdim=True)
    lens = torch.randint(0, g + 1, (b,), generator=gen)
    u = torch.rand(b, g + 1, generator=gen)
    return drafts, q, p, lens, u


def test_rejection_matches_reference_token_for_token():
    drafts, q, p, lens, u = random_block(2000, 4, 6, seed=2)
    got = rejection_verify_block(drafts, q, p, lens, uniforms=u)
    ref = reference_verify_block(drafts, q, p, lens, u)
    for name, x, y in zip(got._fields, got, ref):
        assert torch.equal(x, y), name
    assert (got.accept_len <= lens + 1).all()
    # Every outcome occurs: rejection at each index, acceptance up to the cap.
    assert set(got.accept_len.tolist()) == set(range(1, 6))


def test_compact_verify_ignores_rows_past_the_cap():
    """A compact verify only computes target rows 0..l: zeros after them change nothing."""
    drafts, q, p, lens, u = random_block(1000, 4, 6, seed=3)
    beyond = torch.arange(5).unsqueeze(0) > lens.unsqueeze(1)
    compact = p.masked_fill(beyond.unsqueeze(-1), 0.0)
    full = rejection_verify_block(drafts, q, p, lens, uniforms=u)
    part = rejection_verify_block(drafts, q, compact, lens, uniforms=u)
    assert all(torch.equal(x, y) for x, y in zip(full, part))
    greedy_full = greedy_verify_block(drafts, p, lens)
    greedy_part = greedy_verify_block(drafts, compact, lens)
    assert all(torch.equal(x, y) for x, y in zip(greedy_full, greedy_part))


def test_mixed_batch_and_greedy_reduction():
    drafts, q, p, lens, u = random_block(500, 3, 5, seed=4)
    mask = torch.arange(500) % 3 == 0
    mixed = verify_block(drafts, q, p, lens, uniforms=u, greedy_mask=mask)
    greedy = greedy_verify_block(drafts, p, lens)
    sampled = rejection_verify_block(drafts, q, p, lens, uniforms=u)
    for x, gx, sx in zip(mixed, greedy, sampled):
        assert torch.equal(x[mask], gx[mask]) and torch.equal(x[~mask], sx[~mask])
    # All greedy without draft probabilities; an explicit argmax overrides argmax(p).
    assert all(torch.equal(x, y) for x, y in zip(verify_block(drafts, None, p, lens), greedy))
    argmax = torch.zeros(500, 4, dtype=torch.int64)
    assert verify_block(drafts, None, p, lens, target_argmax=argmax).next_seed.eq(0).all()
    # Greedy is the one-hot special case of rejection sampling.
    one_hot_q = F.one_hot(drafts, 5).float()
    one_hot_p = F.one_hot(p.argmax(-1), 5).float()
    as_sampling = rejection_verify_block(drafts, one_hot_q, one_hot_p, lens, uniforms=u)
    assert all(torch.equal(x, y) for x, y in zip(as_sampling, greedy))


def test_bad_inputs():
    d, q, p, lens, u = random_block(3, 2, 4, seed=5)
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_verify_block(d.float(), p, lens)
    with pytest.raises(ValueError, match="verify_lens"):
        greedy_verify_block(d, p, lens[:2])
    with pytest.raises(ValueError, match="verify_lens"):
        rejection_verify_block(d, q, p, lens.float())
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_verify_block(d, q[:, :1], p, lens)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_verify_block(d, q, p[:, :2], lens)
    with pytest.raises(ValueError, match="uniforms"):
        rejection_verify_block(d, q, p, lens, uniforms=u[:, :2])
    with pytest.raises(ValueError, match="greedy_mask"):
        verify_block(d, q, p, lens, uniforms=u, greedy_mask=torch.ones(3))


def test_no_host_reads(monkeypatch):
    calls = []
    refuse_host_reads(monkeypatch, dspark_verify, "verify_block", calls)
    d, q, p, lens, u = random_block(8, 3, 5, seed=6)
    dspark_verify.verify_block(d, q, p, lens, uniforms=u, greedy_mask=torch.arange(8) < 3)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------
# Sampling: lossless at every verify length
# ------------------------------------------------------------------------------------------
V, G, PER_LEN = 4, 3, 60_000


def markov_tables(seed: int):
    """Target P and draft Q as next-token tables [V, V] (row = previous token), clearly
    different, every target probability >= 0.07 so the V**2 cells are well filled."""
    gen = torch.Generator().manual_seed(seed)
    P = torch.rand(V, V, generator=gen) + 0.4
    Q = torch.rand(V, V, generator=gen) ** 3 + 0.02
    return P / P.sum(1, keepdim=True), Q / Q.sum(1, keepdim=True)


def draft_block(anchor, Q, gen, greedy_draft: bool):
    """G Markov drafts after each anchor; returns drafts [B, G] and their q rows [B, G, V]."""
    prev, toks, qs = anchor, [], []
    for _ in range(G):
        q = Q[prev]
        if greedy_draft:
            tok = q.argmax(1)
            q = F.one_hot(tok, V).float()
        else:
            tok = sample_from_probs(q, torch.rand(anchor.shape[0], generator=gen))
        toks.append(tok)
        qs.append(q)
        prev = tok
    return torch.stack(toks, 1), torch.stack(qs, 1)


def first_two_tokens(P, Q, lens, seed: int, greedy_draft=False, lens_fn=None):
    """Speculative rounds from anchor 0 until two tokens are committed; ``lens_fn(drafts)``
    (if given) picks the verify length from the drafts. Returns committed [B, 2] and the
    first round's verdict."""
    gen = torch.Generator().manual_seed(seed)
    b = lens.shape[0]
    out = torch.full((b, 2), PAD, dtype=torch.int64)
    count = torch.zeros(b, dtype=torch.int64)
    anchor = torch.zeros(b, dtype=torch.int64)
    first = None
    rows = torch.arange(b).unsqueeze(1)
    for _ in range(2):
        drafts, q = draft_block(anchor, Q, gen, greedy_draft)
        window = torch.cat([anchor.unsqueeze(1), drafts], 1)
        ell = lens if lens_fn is None else lens_fn(drafts)
        res = rejection_verify_block(drafts, q, P[window], ell,
                                     uniforms=torch.rand(b, G + 1, generator=gen))
        j = torch.arange(G + 1).unsqueeze(0)
        cols = count.unsqueeze(1) + j
        valid = (j < res.accept_len.unsqueeze(1)) & (cols < 2)
        out[rows.expand(-1, G + 1)[valid], cols[valid]] = res.accepted_tokens[valid]
        count += res.accept_len
        anchor = res.next_seed
        first = res if first is None else first
    assert (out != PAD).all()
    return out, first


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_lossless_at_every_verify_length(greedy_draft):
    P, Q = markov_tables(0)
    lens = torch.arange(G + 1).repeat_interleave(PER_LEN)  # one batch, lengths 0..G per row
    committed, first = first_two_tokens(P, Q, lens, seed=1, greedy_draft=greedy_draft)
    joint = P[0].unsqueeze(1) * P  # P(x1 = a, x2 = b) = P[0][a] * P[a][b]
    for ell in range(G + 1):
        rows = lens == ell
        code = committed[rows, 0] * V + committed[rows, 1]
        counts = torch.bincount(code, minlength=V * V)
        assert chi_square_pvalue(counts, joint) > ALPHA, f"verify length {ell}"
        # The cap holds, and with real drafts every length up to it occurs.
        lens_seen = set(first.accept_len[rows].tolist())
        assert max(lens_seen) <= ell + 1
        if not greedy_draft:
            assert lens_seen == set(range(1, ell + 2))
        assert (first.accepted_tokens[rows][:, ell + 1:] == PAD).all()


def test_length_may_depend_on_the_draft_after_the_cap():
    """The token at index l comes from a rejection step on d_{l+1}, so l may look at d_1 ..
    d_{l+1}: verifying everything only when d_1 is token 0 (l = 0 otherwise), or l = 1 / 2 by
    d_2, still gives the target's joint distribution."""
    P, Q = markov_tables(0)
    joint = P[0].unsqueeze(1) * P
    rules = [lambda d: (d[:, 0] == 0).long() * G,
             lambda d: torch.where(d[:, 1] == 0, 1, 2)]
    for i, rule in enumerate(rules):
        lens = torch.zeros(2 * PER_LEN, dtype=torch.int64)
        committed, _ = first_two_tokens(P, Q, lens, seed=3 + i, lens_fn=rule)
        counts = torch.bincount(committed[:, 0] * V + committed[:, 1], minlength=V * V)
        assert chi_square_pvalue(counts, joint) > ALPHA, f"rule {i}"


def test_chi_square_detects_a_length_that_looks_two_drafts_ahead():
    """Negative control: l = 0 when d_2 is token 1, else G. Stopping at 0 then depends on
    d_{l+2}: the rounds that go on commit the index-1 step's output only when d_2 is not
    token 1, so the second token is biased (the first, always the index-0 output, is not), and
    the same test rejects the joint overwhelmingly."""
    P, Q = markov_tables(0)
    lens = torch.zeros(PER_LEN, dtype=torch.int64)
    committed, _ = first_two_tokens(P, Q, lens, seed=5,
                                    lens_fn=lambda d: (d[:, 1] != 1).long() * G)
    assert chi_square_pvalue(torch.bincount(committed[:, 0], minlength=V), P[0]) > ALPHA
    counts = torch.bincount(committed[:, 0] * V + committed[:, 1], minlength=V * V)
    assert chi_square_pvalue(counts, P[0].unsqueeze(1) * P) < 1e-12


# ------------------------------------------------------------------------------------------
# GPU: the acceptance captures in a CUDA graph
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_verify_captures_in_cuda_graph():
    dev = "cuda"
    d, q, p, lens, u = (x.to(dev) for x in random_block(16, 4, 50, seed=7))
    mask = torch.arange(16, device=dev) % 2 == 0
    eager = verify_block(d, q, p, lens, uniforms=u, greedy_mask=mask)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        verify_block(d, q, p, lens, uniforms=u, greedy_mask=mask)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify_block(d, q, p, lens, uniforms=u, greedy_mask=mask)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(out, eager))
