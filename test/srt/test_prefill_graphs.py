"""Prefill CUDA graphs (``sglang.srt.model_executor.prefill_graph_runner``), emulated on CPU.

* A prefill replayed from a graph padded to a larger bucket gives the eager prefill's logits,
  KV rows, KDA conv windows and recurrent states, for lengths from 1 (shorter than the conv
  window) to the bucket itself, in fp32 (equal to rounding) and bf16; with every hidden-state
  capture mode (per-token outputs cut to the real rows); and the greedy decode after it is the
  same.
* The same on the KDA backend's CUDA branch (Triton conv planes into fla with the raw gate),
  fla's contract stood in by torch, and with no host read inside the captured body.
* An MTP draft's extend over the prompt replays with the target's hidden states as a
  per-token input.
* What must run eagerly does: two requests, a cached prefix, full logits, more tokens than the
  largest bucket, a failed capture (remembered, with the eager result).
* The bucket filter and the ``--prefill-cuda-graph-tokens`` flag.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor import cuda_graph_runner
from sglang.srt.model_executor.prefill_graph_runner import (
    PrefillGraphRunner,
    auto_prefill_graph_tokens,
    init_prefill_graphs_from_args,
    prefill_graph_buckets,
)
from sglang.srt.server_args import ServerArgs, prepare_server_args

pytestmark = pytest.mark.usefixtures("one_thread")  # test/srt/conftest.py

BUCKETS = (8, 24)
# fp32 padded vs eager: the GEMMs of another batch shape round differently (about 1e-6 here;
# the margin is for other CPUs' kernels). A wrong state or window is off by whole units.
FP32 = dict(rtol=1e-4, atol=1e-4)


def _runner(dtype: str = "float32", **kw) -> ModelRunner:
    opts = dict(max_running_requests=4, max_total_tokens=512, **kw)
    return ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu", dtype=dtype,
                       **opts)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(runner: ModelRunner, ids: torch.Tensor, *, prefix: int = 0,
             mode: CaptureHiddenMode = CaptureHiddenMode.NULL, full: bool = False):
    """One fresh request's prefill of ``ids``; returns ``(output, slot, kv slots)``."""
    req = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req])
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(req, 0, loc)
    fb = ForwardBatch.for_extend(ids, [req], [prefix], [len(ids) - prefix],
                                 loc[prefix:], return_full_logits=full)
    fb.input_ids = ids[prefix:]
    fb.capture_hidden_mode = mode
    return runner.forward(fb), req, loc


def _state(runner: ModelRunner, req: int, loc: torch.Tensor):
    pool = runner.kda_state_pool
    kv = [runner.token_to_kv_pool.get_kv_buffer(i)[loc] for i in runner.token_to_kv_pool.layer_ids]
    return pool.conv_state[:, req].clone(), pool.ssm_state[:, req].clone(), kv


def _free(runner: ModelRunner, req: int, loc: torch.Tensor) -> None:
    runner.token_to_kv_pool_allocator.free(loc)
    runner.req_to_token_pool.free([req])


@pytest.fixture(scope="module")
def pair():
    """An eager runner and one with emulated prefill graphs, same weights."""
    eager, graphed = _runner(), _runner()
    graphed.init_prefill_graphs(BUCKETS)
    assert sorted(k.tokens for k in graphed.prefill_graphs.graphs) == list(BUCKETS)
    return eager, graphed


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 23, 24])
def test_padded_prefill_equals_eager(pair, n):
    eager, graphed = pair
    ids = _ids(n, seed=n)
    replays = graphed.prefill_graphs.num_replays
    a, ra, la = _prefill(eager, ids)
    b, rb, lb = _prefill(graphed, ids)
    assert graphed.prefill_graphs.num_replays == replays + 1
    torch.testing.assert_close(b.next_token_logits, a.next_token_logits, **FP32)
    (ca, sa, kva), (cb, sb, kvb) = _state(eager, ra, la), _state(graphed, rb, lb)
    # Windows hold projection outputs: GEMMs of another batch shape round differently.
    torch.testing.assert_close(cb, ca, **FP32)
    torch.testing.assert_close(sb, sa, **FP32)
    for x, y in zip(kva, kvb):
        torch.testing.assert_close(y, x, **FP32)
    _free(eager, ra, la)
    _free(graphed, rb, lb)


@pytest.mark.parametrize("mode", [CaptureHiddenMode.LAST, CaptureHiddenMode.FULL])
def test_hidden_states_are_cut_to_the_real_rows(pair, mode):
    eager, graphed = pair
    ids = _ids(5, seed=11)
    a, ra, la = _prefill(eager, ids, mode=mode)
    b, rb, lb = _prefill(graphed, ids, mode=mode)
    assert (8, mode) in graphed.prefill_graphs.graphs  # captured when first needed
    assert b.hidden_states.shape == a.hidden_states.shape == (5 if mode == CaptureHiddenMode.FULL
                                                              else 1, a.hidden_states.shape[1])
    torch.testing.assert_close(b.hidden_states, a.hidden_states, **FP32)
    _free(eager, ra, la)
    _free(graphed, rb, lb)


def test_greedy_decode_after_a_padded_prefill_is_the_same(pair):
    eager, graphed = pair
    ids = _ids(13, seed=5)
    tokens: List[List[int]] = []
    for runner in pair:
        out, req, loc = _prefill(runner, ids)
        token = out.next_token_logits.argmax(-1)
        seq = [int(token)]
        for i in range(6):
            seq_len = len(ids) + i + 1
            step_loc = runner.token_to_kv_pool_allocator.alloc(1)
            runner.req_to_token_pool.write(req, seq_len - 1, step_loc)
            fb = ForwardBatch.for_decode(token, torch.tensor([req]), torch.tensor([seq_len]),
                                         step_loc)
            token = runner.forward(fb).next_token_logits.argmax(-1)
            seq.append(int(token))
            loc = torch.cat([loc, step_loc])
        tokens.append(seq)
        _free(runner, req, loc)
    assert tokens[0] == tokens[1]


def _one_padded_prefill(bucket: int, n: int, seed: int, tol: dict, **runner_kw) -> None:
    """An eager runner and one with a graph of ``bucket`` tokens, built alike (``runner_kw``):
    one fresh prompt of ``n`` tokens through each (a replay on the second) gives last-row
    logits, conv windows and recurrent states that agree within ``tol``."""
    eager, graphed = _runner(**runner_kw), _runner(**runner_kw)
    graphed.init_prefill_graphs([bucket])
    ids = _ids(n, seed=seed)
    a, ra, la = _prefill(eager, ids)
    b, rb, lb = _prefill(graphed, ids)
    assert graphed.prefill_graphs.num_replays == 1
    torch.testing.assert_close(b.next_token_logits, a.next_token_logits, **tol)
    (ca, sa, _), (cb, sb, _) = _state(eager, ra, la), _state(graphed, rb, lb)
    torch.testing.assert_close(cb, ca, **tol)
    torch.testing.assert_close(sb, sa, **tol)


def test_bf16_padded_prefill_matches_eager():
    # Padding changes the rows the chunked KDA sums over (exact zeros) and the batch shapes of
    # the projections, so bf16 agrees to its rounding, not bit for bit.
    _one_padded_prefill(16, 11, seed=3, tol=dict(rtol=2e-2, atol=2e-2), dtype="bfloat16")


@pytest.mark.slow  # the conv kernel in Triton's interpreter
def test_padded_prefill_on_the_triton_conv_matches_eager():
    """The same with the KDA prefill conv on its Triton kernel (the interpreter here): the
    kernel writes its window into a scratch one and the padded path re-reads the request's."""
    _one_padded_prefill(8, 6, seed=8, tol=FP32, linear_attn_decode_backend="triton")


def _torch_chunk_kda_varlen(q, k, v, g, beta, scale, initial_state, seq_lens, cu_seqlens=None,
                            cu_seqlens_cpu=None, l2norm_in_kernel=False, gate_params=None,
                            captured=False):
    """``fla_kda.chunk_kda_varlen``'s contract in torch (kda_ops' reference maths), so that the
    backend's fla branch runs on CPU: the raw gate formed as fla forms it (``-inf`` gives decay
    0 and beta 0), one sequence after another from its initial state."""
    from sglang.srt.layers.attention.kda_ops import kda_chunked, kda_gate, l2norm

    if captured:  # what a capture allows: the device's cu_seqlens only
        assert cu_seqlens is not None and cu_seqlens_cpu is None
    h, d = q.shape[1], q.shape[2]
    if l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    if gate_params is not None:
        a_log, dt_bias, lower_bound = gate_params
        g, beta = kda_gate(g.reshape(-1, h, d), a_log, dt_bias, lower_bound), beta.float().sigmoid()
    outs, finals, start = [], [], 0
    for i, n in enumerate(seq_lens):
        rows = slice(start, start + n)
        o, state = kda_chunked(q[rows].float(), k[rows].float(), v[rows].float(),
                               g[rows].float(), beta[rows].float(), scale,
                               initial_state=initial_state[i])
        outs.append(o)
        finals.append(state)
        start += n
    return torch.cat(outs).to(q.dtype), torch.stack(finals)


@pytest.mark.slow  # the conv kernel in Triton's interpreter
def test_padded_prefill_on_the_fla_branch_matches_eager(monkeypatch):
    """The CUDA branch (the conv's q / k / v planes into fla with the raw gate) with fla's
    contract stood in by torch: padded rows' gate and beta at ``-inf``, a zero initial state and
    the final state written to the slot by device index give the eager result."""
    from sglang.srt.layers.attention import fla_kda
    from sglang.srt.layers.attention.torch_native_kda import TorchNativeKDABackend

    monkeypatch.setattr(fla_kda, "chunk_kda_varlen", _torch_chunk_kda_varlen)
    monkeypatch.setattr(TorchNativeKDABackend, "_use_fla", lambda self, x: True)
    _one_padded_prefill(8, 5, seed=12, tol=FP32, linear_attn_decode_backend="triton")


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_captured_forward_reads_nothing_back(monkeypatch, quantization):
    """No Tensor-to-Python conversion inside the captured body (on CUDA each would be a sync,
    which a capture refuses), on the torch paths at a bucket below the torch MoE's host-read
    threshold, with the model's weights as they are and quantised to block fp8 at load: a host
    read in the model, the attention backends or the padded KDA path fails here on CPU rather
    than only on the GPU."""
    from engine_test_utils import refuse_host_reads

    calls: list = []
    refuse_host_reads(monkeypatch, PrefillGraphRunner, "_body", calls)
    runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu",
                         dtype="float32", max_running_requests=2, max_total_tokens=128,
                         quantization=quantization)
    pg = runner.init_prefill_graphs([8])
    assert not pg.failed, pg.failed
    assert len(calls) == 3  # two warm-ups and the capture


@pytest.mark.slow  # the kernels in Triton's interpreter
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_captured_forward_reads_nothing_back_on_the_triton_kernels(monkeypatch, quantization):
    """The same on CUDA's default Triton kernels, the MoE's prefill path among them (the
    expert sort, the grouped GEMMs with the shared expert as pairs), which a real prefill
    reaches above ``SMALL_M_MAX_PAIRS`` pairs: lowered here so that an 8-token bucket takes
    it."""
    from engine_test_utils import refuse_host_reads
    from sglang.srt.layers.moe import moe_layer

    monkeypatch.setattr(moe_layer, "SMALL_M_MAX_PAIRS", 8)
    calls: list = []
    refuse_host_reads(monkeypatch, PrefillGraphRunner, "_body", calls)
    grouped = []
    inner = moe_layer.FusedMoE.large_m

    def spy(self, topk_ids):
        grouped.append(inner(self, topk_ids))
        return grouped[-1]

    monkeypatch.setattr(moe_layer.FusedMoE, "large_m", spy)
    from sglang.srt.layers.kernel_choices import KernelChoices

    # The kernels CUDA defaults to: the norms, MLA's RoPE assembly, the router; the MoE's sort
    # kernel, the shared expert as pairs and, for fp8 weights, fp8 activations with the SwiGLU
    # output quantised in the epilogue.
    choices = KernelChoices(moe_align_kernel=True, moe_combine=True,
                            moe_fp8_activations=quantization == "fp8", rmsnorm=True,
                            mla_rope=True, router=True)
    runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu",
                         dtype="float32", max_running_requests=2, max_total_tokens=128,
                         moe_runner_backend="triton", linear_attn_decode_backend="triton",
                         attention_backend="triton", quantization=quantization,
                         kernel_choices=choices)
    assert runner.kernel_choices.moe_align_kernel and runner.kernel_choices.moe_combine
    pg = runner.init_prefill_graphs([8])
    assert not pg.failed, pg.failed
    assert len(calls) == 3 and grouped and all(grouped)  # every MoE block on the grouped GEMMs


def test_a_draft_extend_replays_with_its_hidden_state_input():
    """An MTP draft's extend over a fresh prompt (DRAFT_EXTEND, the target's hidden state of
    every row as a per-token input) replayed padded == eager: last-row logits and hidden
    state, and the draft layer's KV rows. Without that input, or with another shape, it runs
    eagerly."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.runner_utils import draft_runner_on

    mc = ModelConfig.from_path(str(BUNDLED_MODEL_DIR))
    target = ModelRunner(mc, device="cpu", dtype="float32", max_running_requests=2,
                         max_total_tokens=128, draft_extra_mla_layers=True)
    draft = draft_runner_on(target, mc)
    hidden = mc.hf_config.hidden_size
    pg = draft.init_prefill_graphs([8], capture_modes=(CaptureHiddenMode.LAST,),
                                   forward_mode=ForwardMode.DRAFT_EXTEND,
                                   token_inputs={"hidden_states": ((hidden,), torch.float32)})
    ids = _ids(6, seed=21)
    h = torch.randn(6, hidden, generator=torch.Generator().manual_seed(2))
    outs = []
    for replay in (False, True):
        req = target.req_to_token_pool.alloc(1)[0]
        loc = target.token_to_kv_pool_allocator.alloc(6)
        target.req_to_token_pool.write(req, 0, loc)
        fb = ForwardBatch.for_extend(ids, [req], [0], [6], loc,
                                     forward_mode=ForwardMode.DRAFT_EXTEND,
                                     capture_hidden_mode=CaptureHiddenMode.LAST)
        out = draft.forward(fb, hidden_states=h) if replay else draft.forward_eager(
            fb, hidden_states=h)
        layer = draft.token_to_kv_pool.layer_ids[-1]  # the MTP layer's cache
        outs.append((out, draft.token_to_kv_pool.get_kv_buffer(layer)[loc].clone()))
        assert pg.key(fb, {"hidden_states": h}) is not None
        assert pg.key(fb) is None and pg.key(fb, {"hidden_states": h[:, :8]}) is None
        target.token_to_kv_pool_allocator.free(loc)
        target.req_to_token_pool.free([req])
    (a, kva), (b, kvb) = outs
    assert pg.num_replays == 1
    torch.testing.assert_close(b.next_token_logits, a.next_token_logits, **FP32)
    torch.testing.assert_close(b.hidden_states, a.hidden_states, **FP32)
    torch.testing.assert_close(kvb, kva, **FP32)


def test_what_must_run_eagerly_does(pair):
    eager, graphed = pair
    pg = graphed.prefill_graphs
    start = pg.num_replays
    ids = _ids(30, seed=1)
    out, req, loc = _prefill(graphed, ids)  # more tokens than the largest bucket
    _free(graphed, req, loc)
    out, req, loc = _prefill(graphed, _ids(6, seed=2), full=True)  # logits of every row
    assert out.next_token_logits.shape[0] == 6
    _free(graphed, req, loc)
    # A cached prefix: the request's first 4 tokens are in the cache already.
    ids = _ids(10, seed=4)
    first, req, loc = _prefill(graphed, ids[:4])
    assert pg.num_replays == start + 1  # the first 4 tokens: a fresh request, replayed
    rest = graphed.token_to_kv_pool_allocator.alloc(6)
    graphed.req_to_token_pool.write(req, 4, rest)
    fb = ForwardBatch.for_extend(ids[4:], [req], [4], [6], rest)
    assert pg.key(fb) is None
    graphed.forward(fb)
    _free(graphed, req, torch.cat([loc, rest]))
    # Two requests in one batch.
    reqs = graphed.req_to_token_pool.alloc(2)
    graphed.kda_state_pool.clear_slots(reqs)
    loc = graphed.token_to_kv_pool_allocator.alloc(6)
    graphed.req_to_token_pool.write(reqs[0], 0, loc[:3])
    graphed.req_to_token_pool.write(reqs[1], 0, loc[3:])
    fb = ForwardBatch.for_extend(_ids(6, seed=9), reqs, [0, 0], [3, 3], loc)
    assert pg.key(fb) is None
    graphed.forward(fb)
    graphed.token_to_kv_pool_allocator.free(loc)
    graphed.req_to_token_pool.free(reqs)
    assert pg.num_replays == start + 1


def test_a_failed_capture_is_remembered_and_runs_eagerly(monkeypatch, caplog):
    runner = _runner()
    calls = []

    def broken(self, key):
        calls.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PrefillGraphRunner, "_body", broken)
    with caplog.at_level("INFO", logger="sglang.srt.model_executor.prefill_graph_runner"):
        pg = runner.init_prefill_graphs([8])
    assert "Prefill CUDA graphs: 0 of 1 captured (token counts [8])" in caplog.text
    assert "such prefills run eagerly" in caplog.text
    assert not pg.graphs and len(pg.failed) == 1 and "stream is capturing" in next(iter(pg.failed.values()))
    monkeypatch.undo()
    out, req, loc = _prefill(runner, _ids(5, seed=7))
    assert pg.num_replays == 0 and out.next_token_logits.shape == (1, runner.model_config.vocab_size)
    assert len(calls) == 1  # not tried again


def test_bucket_filter():
    assert prefill_graph_buckets([1024, 8, 8, 0, 512, 99999], max_tokens=4096,
                                 graph_token_limit=None) == [8, 512, 1024]
    assert prefill_graph_buckets([1024, 8, 512], max_tokens=4096, graph_token_limit=16) == [8]


# ------------------------------------------------------------------------------ default sizes
@pytest.mark.parametrize("before,per_size,chunk,want", [
    (12, 1, 8192, [1024, 2048, 4096, 8192]),  # the default decode ladder: past 4 already
    (4, 2, 8192, [1024, 2048, 4096, 8192]),
    (0, 1, 8192, [1024, 2048, 4096]),  # room for 3: the smallest sizes
    (1, 1, 8192, [1024, 2048]),  # --cuda-graph-max-bs 1: 1 + 2 = 3 graphs
    (2, 1, 8192, [1024]),
    (1, 2, 8192, [1024]),  # NEXTN: a size is the target's graph and the MTP layer's
    (2, 2, 8192, []),
    (3, 1, 8192, []),
    (12, 1, 2048, [1024, 2048]),  # no size above the chunk
    (12, 1, 3000, [1024, 2048, 3000]),
    (12, 1, 512, [512]),
    (12, 1, -1, [1024, 2048, 4096, 8192]),  # chunking off
    (1, 1, 3000, [1024, 2048]),
])
def test_default_sizes_follow_the_chunk_and_the_graph_count(before, per_size, chunk, want):
    tokens, why = auto_prefill_graph_tokens(chunk_tokens=chunk, graphs_before=before,
                                            graphs_per_size=per_size)
    assert tokens == want and why


class _Runner:
    def __init__(self, device: str):
        self.device, self.tp_rank, self.asked = torch.device(device), 0, []

    def init_prefill_graphs(self, tokens, **keywords):
        self.asked.append((list(tokens), keywords))
        return self


class _Worker:
    def __init__(self, plan):
        self.plan = plan

    def prefill_graph_plan(self):
        return self.plan


def _args(*argv: str) -> ServerArgs:
    args = prepare_server_args(list(argv))
    args.disable_cuda_graph = False  # resolved off on a CPU-only machine; the runners decide
    return args


def test_the_default_sizes_reach_every_cuda_runner_of_the_plan(monkeypatch):
    monkeypatch.setattr(cuda_graph_runner, "_captured", 1)  # one decode graph
    target, draft = _Runner("cuda"), _Runner("cuda")
    modes = dict(capture_modes=(CaptureHiddenMode.FULL,))
    init_prefill_graphs_from_args(_Worker([(target, {})]), _args())
    assert target.asked == [([1024, 2048], {})]
    target.asked = []
    init_prefill_graphs_from_args(_Worker([(target, modes), (draft, {})]), _args())
    assert target.asked == [([1024], modes)] and draft.asked == [([1024], {})]
    monkeypatch.setattr(cuda_graph_runner, "_captured", 12)
    target.asked = []
    init_prefill_graphs_from_args(_Worker([(target, {})]),
                                  _args("--chunked-prefill-size", "4096"))
    assert target.asked == [([1024, 2048, 4096], {})]


def test_given_sizes_none_and_cpu_runners(monkeypatch):
    monkeypatch.setattr(cuda_graph_runner, "_captured", 1)
    gpu, cpu = _Runner("cuda"), _Runner("cpu")
    init_prefill_graphs_from_args(_Worker([(gpu, {})]),
                                  _args("--prefill-cuda-graph-tokens", "16", "4096", "8192"))
    assert gpu.asked == [([16, 4096, 8192], {})]  # given: taken as they are, also the 4th graph
    gpu.asked = []
    assert init_prefill_graphs_from_args(
        _Worker([(gpu, {})]), _args("--prefill-cuda-graph-tokens", "none")) == []
    assert init_prefill_graphs_from_args(_Worker([(cpu, {})]), _args()) == []
    # Bit-exact speculation: a plain and a speculative server must prefill alike (eagerly),
    # unless sizes are given.
    assert init_prefill_graphs_from_args(
        _Worker([(gpu, {})]), _args("--enable-deterministic-inference")) == []
    init_prefill_graphs_from_args(_Worker([(gpu, {})]), _args(
        "--enable-deterministic-inference", "--prefill-cuda-graph-tokens", "1024"))
    assert gpu.asked == [([1024], {})]
    gpu.asked = []
    off = _args()
    off.disable_cuda_graph = True
    assert init_prefill_graphs_from_args(_Worker([(gpu, {})]), off) == []
    assert gpu.asked == [] and cpu.asked == []


def test_none_is_a_word_of_its_own():
    assert prepare_server_args([]).prefill_cuda_graph_tokens is None
    assert prepare_server_args(["--prefill-cuda-graph-tokens", "None"]).prefill_cuda_graph_tokens == []
    assert ServerArgs(prefill_cuda_graph_tokens="none").prefill_cuda_graph_tokens == []
    with pytest.raises(ValueError, match="the word 'none' alone"):
        ServerArgs(prefill_cuda_graph_tokens=[1024, "none"])


# ------------------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                                  dict(speculative_algorithm="DSPARK")],
                         ids=["plain", "nextn3", "dspark"])
def test_greedy_outputs_through_the_scheduler_are_unchanged(spec):
    """Requests arriving one by one prefill alone (replays of the worker's plan: NEXTN's
    target returns every prompt row's hidden state and its MTP layer's extend over them
    replays too, with those hidden states as a per-token input; DSPARK's draft context is
    written from the target layers' hidden states, per-token outputs cut to the real rows);
    a prompt longer than the largest bucket runs eagerly; greedy tokens equal those of a
    scheduler without prefill graphs."""
    from engine_test_utils import make_scheduler, request, submit_staggered, take_token_ids

    model = str(BUNDLED_MODEL_DIR)
    kw = dict(max_total_tokens=2048, max_running_requests=4, **spec)
    prompts = [request(f"r{i}", _ids(n, seed=i).tolist(), max_new_tokens=12, temperature=0,
                       ignore_eos=True) for i, n in enumerate([5, 12, 16, 3, 40])]
    outs, accepted = [], []
    for graphs in (False, True):
        sched = make_scheduler(model, **kw)
        if graphs:
            plan = sched.round_worker.prefill_graph_plan()
            pgs = [runner.init_prefill_graphs([8, 16], **keywords) for runner, keywords in plan]
        submit_staggered(sched, prompts, stagger=20)
        outs.append(take_token_ids(sched))
        # Drafts cannot change a greedy output, only what is accepted: the same acceptance
        # says the draft's replayed prefill gave the eager drafts.
        accepted.append((sched.spec_num_accept_tokens, sched.spec_num_correct_drafts))
    assert outs[0] == outs[1] and all(len(v) == 12 for v in outs[0].values())
    assert accepted[0] == accepted[1]
    nextn = spec.get("speculative_algorithm") == "NEXTN"
    # The target (and NEXTN's MTP layer after it) replayed every prompt but the 40-token one.
    assert [pg.num_replays for pg in pgs] == [4] * (2 if nextn else 1)
    assert {k.capture_hidden_mode for k in pgs[0].graphs} == {
        CaptureHiddenMode.FULL if nextn else CaptureHiddenMode.NULL}
    if nextn:
        assert pgs[1].runner is sched.round_worker.draft_runner
        assert {k.capture_hidden_mode for k in pgs[1].graphs} == {CaptureHiddenMode.LAST}


# ------------------------------------------------------------------------------ GPU (real graphs)
@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["torch_native", "triton"])
def test_real_prefill_graphs_equal_eager_on_cuda(kernels):
    """The gate on the GPU, bf16, the bundled model: every bucket captures (no host sync, no
    host copy inside the forward: fla's chunk index built on the device), and a padded replay's
    last-row logits, KDA state and the greedy decode after it match the eager prefill's.

    The torch MoE reads expert counts on the host above a few tokens, so its model can only be
    captured up to ``max_cuda_graph_tokens()`` (16 tokens on the bundled model): its buckets stop
    there, the larger ones are dropped rather than failed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(device="cuda", dtype="bfloat16", max_running_requests=4, max_total_tokens=8192,
              moe_runner_backend=kernels, linear_attn_decode_backend=kernels,
              attention_backend="triton" if kernels == "triton" else "torch_native")
    mc = ModelConfig.from_path(str(BUNDLED_MODEL_DIR))
    eager, graphed = ModelRunner(mc, **kw), ModelRunner(mc, **kw)
    limit = graphed.max_cuda_graph_tokens()
    assert (limit is None) == (kernels == "triton")
    buckets, lengths = [64, 512, 2048], (1, 37, 64, 300, 2048)
    if limit is not None:
        buckets, lengths = [limit // 2, limit], (1, limit // 2 + 1, limit)
    pg = graphed.init_prefill_graphs(buckets + [4096] * (limit is not None))
    assert pg.buckets == buckets and not pg.failed, (pg.buckets, pg.failed)
    for n in lengths:
        ids = _ids(n, seed=n).cuda()
        a, ra, la = _prefill(eager, ids)
        b, rb, lb = _prefill(graphed, ids)
        torch.testing.assert_close(b.next_token_logits, a.next_token_logits, rtol=3e-2, atol=3e-2)
        assert int(b.next_token_logits.argmax()) == int(a.next_token_logits.argmax())
        (ca, sa, _), (cb, sb, _) = _state(eager, ra, la), _state(graphed, rb, lb)
        torch.testing.assert_close(cb.float(), ca.float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(sb, sa, rtol=3e-2, atol=3e-2)
        _free(eager, ra, la)
        _free(graphed, rb, lb)
    assert pg.num_replays == len(lengths)
