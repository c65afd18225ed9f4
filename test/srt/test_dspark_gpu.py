"""DSpark on the GPU, real CUDA graphs (``gpu``-marked; skipped without CUDA): the bundled
model with its ``dspark/`` draft, default kernels.

* Lossless: DSPARK through graphs and overlap == plain greedy decoding over 256 tokens, batch 1
  and batch 4 staggered (fp32; bf16 at block 5 and 7).
* The graph gate: graphs == eager DSPARK in bf16 (greedy, seeded, state pollution), without and
  with the SPS planner, and no host synchronisation while a replayed round is launched.

Run by ``STAGE=dspark bash scripts/gpu_graphs.sh``.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

from engine_test_utils import make_scheduler
from test_dspark_worker import MODEL, ckpts, greedy, request, run  # noqa: F401 (ckpts: fixture)

GPU_KW = dict(device="cuda", max_total_tokens=16384, max_running_requests=8)


def _gpu_requests(prompts: List[List[int]]) -> Tuple[Any, Any]:
    greedy_reqs = lambda: [greedy(f"g{i}", p, 256) for i, p in enumerate(prompts)]  # noqa: E731
    seeded = lambda: [request(f"s{i}", p, max_new_tokens=64, temperature=0.8,  # noqa: E731
                              top_p=0.9, sampling_seed=11 + i, ignore_eos=True)
                      for i, p in enumerate(prompts)]
    return greedy_reqs, seeded


def _first_diffs(want: Dict[str, List[int]], got: Dict[str, List[int]]) -> Dict[str, Any]:
    return {rid: next((j for j, (a, b) in enumerate(zip(w, got[rid])) if a != b), None)
            for rid, w in want.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,block", [("float32", 7), ("bfloat16", 5), ("bfloat16", 7)])
def test_greedy_lossless_on_cuda(dtype, block):
    """DSPARK with the bundled draft through CUDA graphs and overlap == plain greedy decoding
    (no graphs, no overlap) over 256 tokens, batch 1 and batch 4 staggered. fp32 checks the
    algorithm on the GPU; in bf16 it also needs the ``block + 1``-token verify and the 1-token
    decode to round alike, which the printed first differing token locates when they do not."""
    from test_cuda_graph_runner import _gpu_prompts

    kw = dict(GPU_KW, dtype=dtype)
    plain = make_scheduler(MODEL, disable_cuda_graph=True, disable_overlap_schedule=True, **kw)
    greedy_reqs, _ = _gpu_requests(_gpu_prompts(plain.tokenizer))
    want1, _ = run(plain, greedy_reqs()[:1])
    want4, _ = run(plain, greedy_reqs(), stagger=2)
    del plain
    graphed = make_scheduler(MODEL, speculative_algorithm="DSPARK",
                             speculative_dspark_block_size=block, **kw)
    got1, spec1 = run(graphed, greedy_reqs()[:1])
    got4, _ = run(graphed, greedy_reqs(), stagger=2)
    print(f"DSPARK {dtype} block {block}: batch-1 accept length {256 / spec1['g0'][0]:.2f}; "
          f"first differing token batch 1 {_first_diffs(want1, got1)}, "
          f"batch 4 {_first_diffs(want4, got4)}")
    assert graphed.round_worker.graph_runner.num_replays > 0
    assert got1 == want1 and got4 == want4


@pytest.mark.gpu
@pytest.mark.parametrize("planner", ["none", "sps", "compact"],
                         ids=["full-window", "sps-planner", "compact"])
def test_graphs_equal_eager_on_cuda(ckpts, planner, monkeypatch):
    """The graph gate of DSpark on the GPU, bf16, the bundled draft (``dspark/``), default
    kernels: DSPARK through CUDA graphs with overlap == DSPARK eager without overlap, greedy
    over 256 tokens at batch 1 and at batch 4 with staggered arrivals and seeded sampled; then
    penalised sampled requests through the same graphs and the greedy batch again, unchanged
    (state pollution). While the rounds are launched the CUDA sync debug mode warns on any
    host-device synchronisation (a device-to-host read); a replayed round must cause none.
    ``compact``: the SPS planner with ``--speculative-dspark-verify-mode compact`` (one graph per
    verify-width tier)."""
    from test_cuda_graph_runner import _gpu_prompts

    kw = dict(GPU_KW, dtype="bfloat16", speculative_algorithm="DSPARK")
    if planner != "none":
        kw["speculative_dspark_sps_table_path"] = ckpts["sps"]
    if planner == "compact":
        kw["speculative_dspark_verify_mode"] = "compact"
    # Eager keeps the overlap schedule: with a planner, overlap picks the lagged-budget mode,
    # whose verify lengths (so the seeded samples, not their distribution) differ from the
    # early-stop mode's; overlap on == off is proven where the modes agree (CPU tests).
    eager = make_scheduler(MODEL, disable_cuda_graph=True, **kw)
    greedy_reqs, seeded = _gpu_requests(_gpu_prompts(eager.tokenizer))
    want1, _ = run(eager, greedy_reqs()[:1])
    want4, _ = run(eager, greedy_reqs(), stagger=2)
    want_s, _ = run(eager, seeded(), stagger=1)
    del eager
    torch.cuda.empty_cache()
    graphed = make_scheduler(MODEL, **kw)
    runner = graphed.round_worker.graph_runner
    assert runner is not None, "no CUDA graph runner"
    inner = graphed.draft_worker.forward_round
    checked = {"rounds": 0, "syncs": []}

    def launch_without_sync(*args: Any, **kwargs: Any) -> Any:
        # Rounds that capture a new graph synchronise by design; every replayed round counts.
        graphs, replays = len(runner.graphs), runner.num_replays
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = inner(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if len(runner.graphs) == graphs and runner.num_replays > replays:
            checked["rounds"] += 1
            checked["syncs"] += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        return out

    graphed.draft_worker.forward_round = launch_without_sync
    got1, _ = run(graphed, greedy_reqs()[:1])
    got4, _ = run(graphed, greedy_reqs(), stagger=2)
    got_s, _ = run(graphed, seeded(), stagger=1)
    run(graphed, [request(f"p{i}", p, max_new_tokens=32, temperature=0.9,
                          frequency_penalty=0.4, ignore_eos=True)
                  for i, p in enumerate(_gpu_prompts(graphed.tokenizer))], stagger=1)
    again, _ = run(graphed, greedy_reqs(), stagger=2)
    for label, w, g in (("batch 1", want1, got1), ("batch 4", want4, got4),
                        ("seeded", want_s, got_s), ("after pollution", want4, again)):
        print(f"DSPARK planner={planner} {label}: first differing token {_first_diffs(w, g)}")
        assert g == w, f"DSPARK planner={planner} {label}: first differing token"
    assert runner.num_replays > 0 and not runner.failed, runner.failed
    print(f"DSPARK planner={planner}: {checked['rounds']} replayed rounds launched, "
          f"{len(checked['syncs'])} host syncs")
    assert checked["rounds"] > 100 and not checked["syncs"], checked["syncs"][:3]
