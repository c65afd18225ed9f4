"""NEXTN chain acceptance (greedy and exact rejection sampling) and the post-verify bookkeeping.

The statistical tests use a fixed seed, so they are deterministic; the stated false-failure rate
is that of the chi-square test itself: ALPHA = 1e-3 per test if the code were exactly right and
the seed were random (and the cells are large enough for the chi-square approximation: every
expected count >= 20 here).
"""
from __future__ import annotations

import pytest
import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.rounds.chain import (
    assign_chain_req_to_token,
    build_verify_forward_batch,
    chain_commit_layout,
    chain_positions,
    greedy_verify_chain,
    last_accepted_index,
    rejection_sample_chain,
    sample_from_probs,
)
from sglang.test.test_utils import chi_square_pvalue

ALPHA = 1e-3
PAD = -1


# ------------------------------------------------------------------------------------------
# Greedy
# ------------------------------------------------------------------------------------------
def one_hot_logits(argmax: torch.Tensor, vocab: int = 10) -> torch.Tensor:
    """Random logits whose argmax per row is ``argmax``."""
    logits = torch.rand(*argmax.shape, vocab, generator=torch.Generator().manual_seed(0))
    return logits.scatter(-1, argmax.unsqueeze(-1), 5.0)


# Seed 1, drafts 5 6 7 in every row; the target's argmax decides.
DRAFTS = torch.tensor([[1, 5, 6, 7]] * 5)
ARGMAX = torch.tensor([
    [5, 6, 7, 8],  # all accepted -> 3 drafts + bonus 8
    [9, 6, 7, 8],  # first draft rejected -> bonus 9 only
    [5, 2, 7, 8],  # second rejected (the third matches but comes after a rejection)
    [5, 6, 3, 8],  # last rejected
    [5, 6, 7, 0],  # all accepted, bonus 0
])
EXPECT_LEN = torch.tensor([4, 1, 2, 3, 4])
EXPECT_TOKENS = torch.tensor([
    [5, 6, 7, 8],
    [9, PAD, PAD, PAD],
    [5, 2, PAD, PAD],
    [5, 6, 3, PAD],
    [5, 6, 7, 0],
])


@pytest.mark.parametrize("form", ["argmax_2d", "argmax_flat", "logits_flat", "logits_3d"])
def test_greedy_hand_written_ragged_batch(form):
    target = {
        "argmax_2d": ARGMAX,
        "argmax_flat": ARGMAX.reshape(-1),
        "logits_flat": one_hot_logits(ARGMAX).reshape(-1, 10),
        "logits_3d": one_hot_logits(ARGMAX),
    }[form]
    res = greedy_verify_chain(DRAFTS, target)
    assert torch.equal(res.accept_len, EXPECT_LEN)
    assert torch.equal(res.accepted_tokens, EXPECT_TOKENS)
    assert torch.equal(res.next_seed, torch.tensor([8, 9, 2, 3, 0]))
    assert res.accept_len.dtype == torch.int64 and res.accepted_tokens.dtype == torch.int64
    # Unpacks as a plain triple too.
    accept_len, tokens, seed = res
    assert torch.equal(seed, tokens.gather(1, (accept_len - 1).unsqueeze(1)).squeeze(1))


def test_greedy_pad_id_and_single_position():
    res = greedy_verify_chain(DRAFTS[1:2], ARGMAX[1:2], pad_token_id=0)
    assert res.accepted_tokens.tolist() == [[9, 0, 0, 0]]
    res = greedy_verify_chain(torch.tensor([[3], [4]]), torch.tensor([[7], [8]]))
    assert res.accept_len.tolist() == [1, 1] and res.accepted_tokens.tolist() == [[7], [8]]


def test_greedy_equals_greedy_decoding():
    """Property: with a deterministic 'target' next(t), the committed tokens are exactly the
    first accept_len tokens of plain greedy decoding, and accept_len - 1 = the leading run of
    correct drafts, whatever the drafts are."""
    gen = torch.Generator().manual_seed(1)
    vocab, b, n = 7, 4000, 5
    nxt = torch.randint(0, vocab, (vocab,), generator=gen)  # greedy target: token -> next token
    seed = torch.randint(0, vocab, (b,), generator=gen)
    truth = [seed]
    for _ in range(n):
        truth.append(nxt[truth[-1]])
    truth = torch.stack(truth, 1)  # [B, N+1]: seed and the greedy continuation
    drafts = truth[:, :n].clone()
    corrupt = torch.rand(b, n, generator=gen) < 0.25
    corrupt[:, 0] = False  # position 0 is the seed
    drafts[corrupt] = torch.randint(0, vocab, (int(corrupt.sum()),), generator=gen)
    res = greedy_verify_chain(drafts, nxt[drafts])  # the target sees the drafted chain
    correct = (drafts[:, 1:] == truth[:, 1:n]).long().cumprod(1).sum(1)
    assert torch.equal(res.accept_len, correct + 1)
    j = torch.arange(n)
    keep = j < res.accept_len.unsqueeze(1)
    assert torch.equal(res.accepted_tokens[keep], truth[:, 1:][keep])
    assert (res.accepted_tokens[~keep] == PAD).all()
    assert set(res.accept_len.tolist()) == set(range(1, n + 1))


def test_greedy_bad_inputs():
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_verify_chain(torch.tensor([1, 2]), ARGMAX)
    with pytest.raises(ValueError, match="target logits"):
        greedy_verify_chain(DRAFTS, torch.rand(7, 10))
    with pytest.raises(ValueError, match="positions"):
        greedy_verify_chain(DRAFTS, ARGMAX[:, :3])


# ------------------------------------------------------------------------------------------
# Rejection sampling: exact in distribution
# ------------------------------------------------------------------------------------------
V, N, B = 5, 3, 200_000


def markov_tables(seed: int):
    """Target P and draft Q as next-token tables [V, V] (row = previous token), clearly different
    and with every target probability >= 0.06 so that the V**3 prefix cells are well filled."""
    gen = torch.Generator().manual_seed(seed)
    P = torch.rand(V, V, generator=gen) + 0.35
    Q = torch.rand(V, V, generator=gen) ** 3 + 0.02
    return P / P.sum(1, keepdim=True), Q / Q.sum(1, keepdim=True)


def draft_round(seeds, Q, gen, greedy_draft: bool):
    """Draft N-1 tokens after each seed from Q; returns drafts [B, N] and q rows [B, N-1, V]."""
    chain, qs = [seeds], []
    for _ in range(N - 1):
        q = Q[chain[-1]]
        if greedy_draft:
            tok = q.argmax(1)
            q = torch.nn.functional.one_hot(tok, V).float()  # what a greedy draft "samples" from
        else:
            tok = sample_from_probs(q, torch.rand(seeds.shape[0], generator=gen))
        chain.append(tok)
        qs.append(q)
    return torch.stack(chain, 1), torch.stack(qs, 1)


def generate(P, Q, num_tokens: int, seed: int, greedy_draft=False, claimed_q=None):
    """Speculative sampling rounds until every row has ``num_tokens`` committed tokens after
    the initial token 0. Returns committed [B, num_tokens] and the first round's accept_len."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, num_tokens), PAD, dtype=torch.int64)
    count = torch.zeros(B, dtype=torch.int64)
    seeds = torch.zeros(B, dtype=torch.int64)
    first_len = None
    rows = torch.arange(B).unsqueeze(1)
    for _ in range(num_tokens):  # every round commits at least one token
        drafts, q = draft_round(seeds, Q, gen, greedy_draft)
        if claimed_q is not None:
            q = claimed_q.expand_as(q)
        res = rejection_sample_chain(drafts, q, P[drafts], uniforms=torch.rand(B, N, generator=gen))
        j = torch.arange(N).unsqueeze(0)
        cols = count.unsqueeze(1) + j
        # Committed tokens of this round that still fit (finished rows keep running, unused).
        valid = (j < res.accept_len.unsqueeze(1)) & (cols < num_tokens)
        out[rows.expand(-1, N)[valid], cols[valid]] = res.accepted_tokens[valid]
        count += res.accept_len
        seeds = res.next_seed
        first_len = res.accept_len if first_len is None else first_len
    assert (count >= num_tokens).all() and (out != PAD).all()
    return out, first_len


def autoregressive_probs(P, num_tokens: int) -> torch.Tensor:
    """Joint probability of every token sequence of length ``num_tokens`` after token 0."""
    joint = P[0]
    for _ in range(num_tokens - 1):
        joint = (joint.unsqueeze(-1) * P[torch.arange(V)].view(*([1] * (joint.dim() - 1)), V, V))
    return joint


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_rejection_sampling_first_token_exact(greedy_draft):
    P, Q = markov_tables(0)
    committed, first_len = generate(P, Q, 1, seed=1, greedy_draft=greedy_draft)
    counts = torch.bincount(committed[:, 0], minlength=V)
    assert chi_square_pvalue(counts, P[0]) > ALPHA
    # Every path ran: first rejected, middle rejected, all accepted (bonus).
    assert set(first_len.tolist()) == set(range(1, N + 1))


def test_rejection_sampling_prefix_exact():
    """The first N committed tokens (over as many rounds as needed) follow the target's
    autoregressive distribution over all V**N sequences."""
    P, Q = markov_tables(0)
    committed, _ = generate(P, Q, N, seed=2)
    code = (committed * torch.tensor([V ** (N - 1 - i) for i in range(N)])).sum(1)
    counts = torch.bincount(code, minlength=V ** N)
    assert chi_square_pvalue(counts, autoregressive_probs(P, N)) > ALPHA


def test_chi_square_has_power():
    """Negative control: lying about q (claiming a uniform draft) biases the output, and the
    same test detects it overwhelmingly."""
    P, Q = markov_tables(0)
    committed, _ = generate(P, Q, 1, seed=3, claimed_q=torch.full((V,), 1.0 / V))
    counts = torch.bincount(committed[:, 0], minlength=V)
    assert chi_square_pvalue(counts, P[0]) < 1e-12
    # And the draft's own distribution is not mistaken for the target's.
    counts_q = torch.bincount(sample_from_probs(Q[[0] * 50_000], torch.rand(50_000)), minlength=V)
    assert chi_square_pvalue(counts_q, P[0]) < 1e-12


def test_rejection_edge_cases():
    gen = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(6, 3, V, generator=gen), -1)
    drafts = torch.randint(0, V, (6, 3), generator=gen)
    # q == p: the test u * q < p always passes -> everything accepted, bonus from p[N-1].
    res = rejection_sample_chain(drafts, p[:, :2], p, generator=gen)
    assert res.accept_len.tolist() == [3] * 6
    assert torch.equal(res.accepted_tokens[:, :2], drafts[:, 1:])
    # Target puts no mass on the drafted token -> rejected at once, final token from the residual
    # (= p where q has no mass), never the rejected draft.
    drafts = torch.zeros(6, 3, dtype=torch.int64)
    p0 = p.clone()
    p0[..., 0] = 0
    p0 /= p0.sum(-1, keepdim=True)
    q = torch.nn.functional.one_hot(torch.zeros(6, 2, dtype=torch.int64), V).float()
    res = rejection_sample_chain(drafts, q, p0, uniforms=torch.rand(6, 3, generator=gen))
    assert res.accept_len.tolist() == [1] * 6 and (res.next_seed != 0).all()
    assert (res.accepted_tokens[:, 1:] == PAD).all()
    # N = 1: no drafts, the token is sampled from p[:, 0].
    res = rejection_sample_chain(drafts[:, :1], q[:, :0], p0[:, :1], uniforms=torch.zeros(6, 1))
    assert res.accept_len.tolist() == [1] * 6
    assert torch.equal(res.next_seed, (p0[:, 0] > 0).long().argmax(1))


def test_rejection_bad_inputs():
    p = torch.full((2, 3, V), 1.0 / V)
    d = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample_chain(d, p, p)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample_chain(d, p[:, :2], p[:, :2])
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample_chain(d, p[:, :2], p, uniforms=torch.rand(2, 2))


def test_sample_from_probs():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 1.0 - 2 ** -24])
    # The largest uniform would round u * total up to total: still a positive-probability token.
    assert sample_from_probs(probs, u).tolist() == [1, 1, 3, 3]
    gen = torch.Generator().manual_seed(5)
    target = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0])
    draws = sample_from_probs(target.expand(100_000, V) * 3.0, torch.rand(100_000, generator=gen))
    counts = torch.bincount(draws, minlength=V)
    assert counts[1] == 0 and counts[4] == 0  # unnormalised rows work, zeros never drawn
    assert chi_square_pvalue(counts[[0, 2, 3]], target[[0, 2, 3]]) > ALPHA


# ------------------------------------------------------------------------------------------
# Bookkeeping
# ------------------------------------------------------------------------------------------
def test_commit_layout():
    prefix = torch.tensor([10, 3, 0])
    accept = torch.tensor([1, 4, 2])
    loc = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [0, 0, 0, 0]])  # row 2: padding
    lay = chain_commit_layout(prefix, accept, loc.reshape(-1))
    assert lay.new_seq_lens.tolist() == [11, 7, 2]
    assert lay.keep_mask.tolist() == [[True, False, False, False], [True] * 4,
                                      [True, True, False, False]]
    assert loc[lay.free_mask].tolist() == [12, 13, 14]  # padding slot 0 is never freed
    assert lay.last_accepted_index.tolist() == [0, 3, 1]
    assert lay.last_accepted_row.tolist() == [0, 7, 9]
    assert torch.equal(last_accepted_index(accept), lay.last_accepted_index)
    with pytest.raises(ValueError, match="accept_len"):
        last_accepted_index(accept.float())
    with pytest.raises(ValueError, match="chain_cache_loc"):
        chain_commit_layout(prefix, accept, loc[:, :3].reshape(-1)[:-1])


def test_positions_req_to_token_and_verify_batch():
    prefix = torch.tensor([5, 0])
    assert chain_positions(prefix, 3).tolist() == [[5, 6, 7], [0, 1, 2]]
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    loc = torch.tensor([[7, 8, 9], [4, 5, 6]])
    assign_chain_req_to_token(req_to_token, torch.tensor([2, 1]), prefix, loc)
    assert req_to_token[2, 5:8].tolist() == [7, 8, 9] and req_to_token[1, :3].tolist() == [4, 5, 6]
    assert int(req_to_token.count_nonzero()) == 6

    drafts = torch.tensor([[3, 4, 5], [6, 7, 8]])
    fb = build_verify_forward_batch(drafts, torch.tensor([2, 1]), prefix, loc)
    assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.batch_size == 2
    assert fb.input_ids.tolist() == [3, 4, 5, 6, 7, 8]
    assert fb.positions.tolist() == [5, 6, 7, 0, 1, 2]
    assert fb.out_cache_loc.tolist() == [7, 8, 9, 4, 5, 6]
    assert fb.seq_lens.tolist() == [8, 3] and fb.extend_prefix_lens.tolist() == [5, 0]
    assert fb.extend_seq_lens.tolist() == [3, 3] and fb.extend_start_loc.tolist() == [0, 3]
    assert fb.return_full_logits and fb.capture_hidden_mode == CaptureHiddenMode.FULL
    assert fb.extend_seq_lens_cpu is None  # device-only: nothing host-side depends on accepts
    with pytest.raises(ValueError, match="chain_cache_loc"):
        build_verify_forward_batch(drafts, torch.tensor([2, 1]), prefix, loc[:, :2])


# ------------------------------------------------------------------------------------------
# GPU: the acceptance path captures in a CUDA graph (no host sync anywhere in it)
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_acceptance_captures_in_cuda_graph():
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    b, n, v = 4, 4, 50
    drafts = torch.randint(0, v, (b, n), device=dev, generator=gen)
    logits = torch.randn(b * n, v, device=dev, generator=gen)
    p = torch.softmax(torch.randn(b, n, v, device=dev, generator=gen), -1)
    q = torch.softmax(torch.randn(b, n - 1, v, device=dev, generator=gen), -1)
    u = torch.rand(b, n, device=dev, generator=gen)
    prefix = torch.tensor([3, 0, 7, 1], device=dev)
    loc = torch.arange(1, b * n + 1, device=dev)

    def step():
        g = greedy_verify_chain(drafts, logits)
        r = rejection_sample_chain(drafts, q, p, uniforms=u)
        lay = chain_commit_layout(prefix, r.accept_len, loc)
        return g.accepted_tokens, r.accepted_tokens, lay.new_seq_lens, lay.free_mask

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, c in zip(eager, captured):
        assert torch.equal(a, c)
