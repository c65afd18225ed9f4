"""The start-up prefill warm-up (``sglang.srt.model_executor.prefill_warmup``).

* The shape plan for the Ling-3.0-flash preset's numbers at the default flags (H200 tile table,
  bf16 and fp8) and for the bundled model: one and two requests, 1 / odd / multiple-of-16 counts
  on every side of every threshold, every tile configuration of the MoE grouped GEMM (and every
  class of its batch-dependent integer arguments) reachable up to the bound, nothing above the
  bound, the context length or the KV pool. Checked against a brute force over every batch
  size up to the bound.
* The warm-up forced on the bundled model on CPU (a bare runner, and a scheduler through the
  ``prefill_warmup`` attribute of its ServerArgs) gives back every slot it took and changes no
  greedy output; it is off by default on CPU and with ``--skip-server-warmup``.
* gpu: the same on CUDA, where the Triton MoE and the grouped GEMM's plan are in play.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, Hashable, List, Set, Tuple

import pytest
import torch

from engine_test_utils import request, server_args, take_token_ids
from sglang.srt.configs.engine_defaults import (DEFAULT_CHUNKED_PREFILL_SIZE,
                                                DEFAULT_MAX_PREFILL_TOKENS)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.layers.attention.torch_native_mla import MLA_NORMAL_FORM_MIN_TOKENS
from sglang.srt.layers.moe.fused_moe_triton import SMALL_M_MAX_PAIRS
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor import prefill_warmup as pw
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_utils import greedy_logits

tiles = pytest.importorskip("sgl_kernel.moe_grouped_gemm_configs")  # pure table helpers (imports triton)

H200 = "NVIDIA H200"
PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327]
DECODE_STEPS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # test/srt/conftest.py


# ------------------------------------------------------------------------------ the plan
def _grouped_gemms(cfg, fp8: bool, device_name: str = H200,
                   shared: bool = False) -> Tuple[pw.GroupedGemm, ...]:
    """The up and down grouped GEMMs of a config's experts, with ``device_name``'s table;
    ``shared``: the shared expert rides them as pairs."""
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return tuple(pw.GroupedGemm(f"{which} {tiles.config_key(e, n, k, fp8)}", e, fp8,
                                tiles.table_entry(e, n, k, fp8, device_name), shared)
                 for which, n, k in (("up", 2 * i, h), ("down", h, i)))


def _flash_paths(fp8: bool, shared: bool = False) -> Tuple[pw.PrefillPaths, int]:
    """The preset's paths as a default H200 server has them (bf16: no small-M dense GEMM;
    fp8: the small-M GEMM reads the fp8 weights at decode sizes), and the default bound."""
    from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS

    mc = ModelConfig.from_path("ling-3.0-flash")
    cfg = mc.hf_config
    paths = pw.PrefillPaths(top_k=cfg.num_experts_per_tok,
                            dense_small_m_rows=SMALL_M_MAX_ROWS if fp8 else None,
                            mla_normal_min_tokens=MLA_NORMAL_FORM_MIN_TOKENS,
                            moe_small_m_pairs=SMALL_M_MAX_PAIRS,
                            moe_gemms=_grouped_gemms(cfg, fp8, shared=shared))
    bound = min(pw.prefill_token_bound(DEFAULT_CHUNKED_PREFILL_SIZE, DEFAULT_MAX_PREFILL_TOKENS),
                mc.context_len)
    return paths, bound


def _reached(paths: pw.PrefillPaths, t: int) -> Set[Hashable]:
    """Brute force, independent of the planner's regions and periods: what a one-request batch
    of ``t`` tokens compiles -- which side of every boundary, its token class, and for each
    grouped GEMM the tiles and the classes of its batch-dependent integer arguments."""
    def cls(v: int) -> str:
        return "1" if v == 1 else "16" if v % 16 == 0 else "n"

    sides = tuple(t <= b.last_lower for b in paths.boundaries())
    out: Set[Hashable] = set()
    if t == 1 or t % 2 or t % 16 == 0:
        out.add(("tokens", sides, "1" if t == 1 else "16" if t % 16 == 0 else "odd"))
    if paths.moe_gemms and t * paths.top_k > paths.moe_small_m_pairs:  # the routed pairs
        for g in paths.moe_gemms:  # each GEMM's own pairs (the shared expert's included)
            pairs = t * (paths.top_k + int(g.shared_pairs))
            c = tiles.select_config(g.table, g.num_experts, pairs, g.fp8)
            ints = tiles.launch_int_args(pairs, g.num_experts + int(g.shared_pairs), c.block_m)
            out.add(("moe", g.name, c, tuple(cls(v) for v in ints)))
    return out


def _check_plan(paths: pw.PrefillPaths, bound: int, shapes: List[Tuple[int, ...]],
                two_requests: bool = True) -> None:
    """The properties every plan has (module docstring), the brute force included."""
    assert shapes == sorted(set(shapes), key=lambda s: (sum(s), len(s), s))
    assert all(1 <= sum(s) <= bound and min(s) >= 1 for s in shapes), (bound, shapes)
    singles = [s[0] for s in shapes if len(s) == 1]
    assert {len(s) for s in shapes} == ({1, 2} if two_requests else {1})
    assert 1 in singles and any(t % 2 and t > 1 for t in singles) \
        and any(t % 16 == 0 for t in singles)
    got: Set[Hashable] = set().union(*(_reached(paths, t) for t in singles))
    for t in range(1, bound + 1):
        missing = _reached(paths, t) - got
        assert not missing, f"a batch of {t} tokens compiles {missing}, which no shape does"
    m = paths.mla_normal_min_tokens
    if two_requests and m and bound >= m:  # two requests on both sides of the normal form
        assert {sum(s) >= m for s in shapes if len(s) == 2} == {False, True}


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared-pairs"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_flash_preset_plan_at_default_flags(fp8, shared):
    """Every tile configuration the H200 table gives the grouped GEMMs between the small-M path
    and the default bound is launched, and so is every bucket's configuration; both sides of
    each threshold; nothing above 8192. With the shared expert as pairs (the default on CUDA)
    a token brings one more pair to each GEMM."""
    paths, bound = _flash_paths(fp8, shared)
    assert bound == min(DEFAULT_CHUNKED_PREFILL_SIZE, DEFAULT_MAX_PREFILL_TOKENS) == 8192
    shapes = pw.prefill_warmup_shapes(paths, bound, max_requests=256)
    _check_plan(paths, bound, shapes)
    k = paths.top_k
    kg = k + int(shared)
    launched = {(g.name, tiles.select_config(g.table, g.num_experts, sum(s) * kg, g.fp8))
                for s in shapes for g in paths.moe_gemms if sum(s) * k > SMALL_M_MAX_PAIRS}
    for g in paths.moe_gemms:
        assert g.table is not None  # the shipped table has H200 entries for bf16 and fp8
        tokens = range(SMALL_M_MAX_PAIRS // k + 1, bound + 1)  # every grouped batch to 8192
        pairs = [t * kg for t in tokens]
        wanted = {tiles.select_config(g.table, g.num_experts, p, g.fp8) for p in pairs}
        assert {c for name, c in launched if name == g.name} == wanted
        # bf16: buckets 1024 and 8192 share their tiles; fp8: two buckets, two tiles
        assert len(wanted) == (2 if fp8 else 3)
        # so every bucket a batch up to the bound selects has its tiles launched
        buckets = {tiles.nearest_bucket(g.table, p) for p in pairs}
        assert buckets == set(g.table) == ({"8192", "65536"} if fp8
                                           else {"1024", "8192", "32768", "65536"})
    if fp8:  # the block-fp8 dense path starts above the small-M rows: both sides run
        assert {t <= paths.dense_small_m_rows for t in (s[0] for s in shapes)} == {True, False}


def test_flash_bf16_plan_is_small():
    """The 12- or 42-layer bf16 preset at default flags (the numbers do not depend on the
    layer count): the shapes, as the report quotes them."""
    paths, bound = _flash_paths(fp8=False)
    assert pw.prefill_warmup_shapes(paths, bound, 256) == [
        (1,), (3,), (16,), (16, 1), (64,), (65,), (16, 49), (129,), (130,), (133,), (144,),
        (2049,), (2064,), (2112,), (2113,), (5793,), (5808,), (5952,), (5953,)]


@pytest.mark.parametrize("bound,requests", [(8192, 8), (100, 8), (40, 1), (1, 4)])
def test_bundled_model_numbers_with_a_triton_moe(bound, requests):
    """The bundled model's numbers as a CUDA runner with the Triton MoE has them (16 experts:
    no table entry, the fallback tiles): the plan's properties at several bounds, one request
    slot (no two-request shape), a one-token bound."""
    cfg = ModelConfig.from_path(str(BUNDLED_MODEL_DIR)).hf_config
    paths = pw.PrefillPaths(top_k=cfg.num_experts_per_tok,
                            mla_normal_min_tokens=MLA_NORMAL_FORM_MIN_TOKENS,
                            moe_small_m_pairs=SMALL_M_MAX_PAIRS,
                            moe_gemms=_grouped_gemms(cfg, False, "no such GPU"))
    shapes = pw.prefill_warmup_shapes(paths, bound, requests)
    if bound == 1:
        assert shapes == [(1,)]
        return
    _check_plan(paths, bound, shapes, two_requests=requests >= 2)
    if bound * paths.top_k > SMALL_M_MAX_PAIRS:  # the grouped GEMM is reachable: it runs
        assert any(sum(s) * paths.top_k > SMALL_M_MAX_PAIRS for s in shapes)


def test_paths_boundaries_and_bound():
    """Boundaries in tokens from each path's own unit; the bound is the smaller positive of
    --chunked-prefill-size and --max-prefill-tokens (-1 disables chunking)."""
    paths = pw.PrefillPaths(top_k=8, dense_small_m_rows=64, mla_normal_min_tokens=64,
                            moe_small_m_pairs=1024, pdl_max_rows=512,
                            pdl_rows_per_token=(1, 8, 9, 32))
    assert [(b.name.split(" ")[0], b.last_lower) for b in paths.boundaries()] == [
        ("dense", 64), ("MLA", 63), ("MoE", 128), ("PDL", 512), ("PDL", 64), ("PDL", 56),
        ("PDL", 16)]
    assert pw.prefill_token_bound(8192, 16384) == 8192
    assert pw.prefill_token_bound(-1, 16384) == 16384
    assert pw.prefill_token_bound(None, 4096) == 4096
    assert pw.prefill_warmup_shapes(pw.PrefillPaths(), 0, 4) == []


def test_enabled_by_device_and_flags():
    """On CUDA unless --skip-server-warmup; off on CPU; a keyword or the ServerArgs attribute
    forces it either way."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    args = SimpleNamespace(skip_server_warmup=False)
    assert pw.prefill_warmup_enabled(args, cuda) and not pw.prefill_warmup_enabled(args, cpu)
    assert pw.prefill_warmup_enabled(args, cpu, force=True)
    assert not pw.prefill_warmup_enabled(SimpleNamespace(skip_server_warmup=True), cuda)
    assert pw.prefill_warmup_enabled(SimpleNamespace(skip_server_warmup=True,
                                                     prefill_warmup=True), cpu)
    assert not pw.prefill_warmup_enabled(SimpleNamespace(skip_server_warmup=False,
                                                         prefill_warmup=False), cuda)


# ------------------------------------------------------------------------------ the run
def _runner(device: str = "cpu", **kw) -> ModelRunner:
    kw = {"max_running_requests": 4, "max_total_tokens": 512, **kw}
    return ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device=device,
                       dtype=torch.float32, **kw)


def _free(runner: ModelRunner) -> Tuple[int, int]:
    return (runner.token_to_kv_pool_allocator.available_size(),
            runner.req_to_token_pool.available_size())


def _check_run_on(device: str) -> None:
    """Forced warm-up on ``device``: the plan fits the runner, every slot comes back, and the
    greedy logits afterwards equal a fresh runner's."""
    args = SimpleNamespace(chunked_prefill_size=DEFAULT_CHUNKED_PREFILL_SIZE,
                           max_prefill_tokens=DEFAULT_MAX_PREFILL_TOKENS,
                           skip_server_warmup=False)
    warmed = _runner(device)
    before = _free(warmed)
    shapes, seconds = pw.warm_up_prefill(warmed, args, force=True)
    assert _free(warmed) == before == (512, 4)
    assert seconds > 0 and len(shapes) >= 5 and max(sum(s) for s in shapes) <= 512
    assert {len(s) for s in shapes} == {1, 2}
    got = greedy_logits(warmed, PROMPT, DECODE_STEPS)
    want = greedy_logits(_runner(device), PROMPT, DECODE_STEPS)
    if device == "cpu":  # the same ops on the same shapes: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    else:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert torch.equal(got[1].argmax(-1), want[1].argmax(-1))
    assert want[0].std() > 1e-2  # not two constant outputs


def test_forced_warmup_on_cpu_gives_slots_back_and_changes_no_output():
    _check_run_on("cpu")


def test_plan_respects_context_pool_and_request_slots():
    """A small KV pool, a short context and one request slot bound the plan."""
    cps, mpt = DEFAULT_CHUNKED_PREFILL_SIZE, DEFAULT_MAX_PREFILL_TOKENS
    small_pool = pw.plan_prefill_warmup(_runner(max_total_tokens=48), chunked_prefill_size=cps,
                                        max_prefill_tokens=mpt)
    assert max(sum(s) for s in small_pool) <= 48 and {len(s) for s in small_pool} == {1, 2}
    # A 48-slot pool cannot hold the 64 tokens of the MLA normal form, a larger one does.
    assert max(sum(s) for s in pw.plan_prefill_warmup(
        _runner(), chunked_prefill_size=cps, max_prefill_tokens=mpt)) >= 64
    short = pw.plan_prefill_warmup(_runner(context_length=30), chunked_prefill_size=cps,
                                   max_prefill_tokens=mpt)
    assert max(sum(s) for s in short) <= 30
    one_slot = pw.plan_prefill_warmup(_runner(max_running_requests=1), chunked_prefill_size=cps,
                                      max_prefill_tokens=mpt)
    assert {len(s) for s in one_slot} == {1}
    chunk = pw.plan_prefill_warmup(_runner(), chunked_prefill_size=40, max_prefill_tokens=mpt)
    assert max(sum(s) for s in chunk) <= 40
    # On CPU the attention backend's own threshold, and no Triton path at all.
    paths = pw.prefill_paths(_runner())
    assert paths.mla_normal_min_tokens == MLA_NORMAL_FORM_MIN_TOKENS
    assert not paths.moe_gemms and paths.moe_small_m_pairs is None and paths.pdl_max_rows is None


def _serve(args) -> Tuple[Scheduler, Dict[str, List[int]]]:
    sched = Scheduler(args)
    free = (sched.token_to_kv_pool_allocator.available_size(),
            sched.req_to_token_pool.available_size())
    assert free == (sched.max_total_num_tokens, sched.max_running_requests)
    for i, n in enumerate((5, 70, 17)):
        sched.submit(request(f"r{i}", [(7 * j + i) % 900 + 10 for j in range(n)],
                             max_new_tokens=6, temperature=0.0, ignore_eos=True))
    sched.run_until_idle()  # checks that every slot is free at the end
    return sched, take_token_ids(sched)


def test_scheduler_runs_it_when_forced_and_serves_the_same_tokens(monkeypatch):
    """Through the scheduler's start-up (the call site): off by default on CPU, forced by the
    ServerArgs attribute; the served greedy tokens are the same either way."""
    runs = []
    real = pw.run_prefill_warmup
    monkeypatch.setattr(pw, "run_prefill_warmup",
                        lambda runner, shapes, seed=0: runs.append(shapes) or real(runner, shapes))
    path = str(BUNDLED_MODEL_DIR)
    _, plain = _serve(server_args(path))
    assert runs == []
    forced = server_args(path)
    forced.prefill_warmup = True  # not a flag: the attribute tests set
    _, warmed = _serve(forced)
    assert len(runs) == 1 and {len(s) for s in runs[0]} == {1, 2}
    assert warmed == plain and all(len(v) == 6 for v in plain.values())


@pytest.mark.gpu
def test_forced_warmup_on_cuda_gives_slots_back_and_changes_no_output():
    """On CUDA the Triton MoE, the grouped GEMM's plan and fla's prefill are in play."""
    runner = _runner("cuda")
    assert pw.prefill_paths(runner).moe_gemms  # the grouped GEMM is planned for
    _check_run_on("cuda")


def _tp_rank_plan(rank: int, port: int, out_dir: str) -> None:
    """One TP rank of the bundled model whose KV pool differs from the other rank's: plans the
    warm-up, runs it, saves the plan."""
    import os

    from sglang.srt.distributed.parallel_state import destroy_distributed_environment

    torch.set_num_threads(1)  # two ranks share two cores
    try:
        runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu",
                             dtype=torch.float32, tp_rank=rank, tp_size=2, nccl_port=port,
                             max_running_requests=2 + rank, max_total_tokens=96 - 40 * rank)
        shapes = pw.plan_prefill_warmup(runner, chunked_prefill_size=64, max_prefill_tokens=64)
        pw.run_prefill_warmup(runner, shapes)
        torch.save(shapes, os.path.join(out_dir, f"plan{rank}.pt"))
    finally:
        destroy_distributed_environment()


def test_tp_ranks_plan_alike_from_the_smallest_pools(tmp_path):
    """Ranks that sized their pools differently plan the same warm-up (from the smaller pools),
    so every rank runs the same forwards and none waits in an all-reduce the other skips."""
    import os

    import torch.multiprocessing as mp

    from sglang.srt.distributed.parallel_state import free_port

    mp.spawn(_tp_rank_plan, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    plans = [torch.load(os.path.join(tmp_path, f"plan{r}.pt")) for r in range(2)]
    assert plans[0] == plans[1] and plans[0]
    small = pw.plan_prefill_warmup(_runner(max_running_requests=2, max_total_tokens=56),
                                   chunked_prefill_size=64, max_prefill_tokens=64)
    assert max(sum(s) for s in plans[0]) <= max(sum(s) for s in small)
