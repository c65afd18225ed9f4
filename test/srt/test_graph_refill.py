"""The refill between CUDA-graph replays (model_executor/graph_refill.py): what each mode copies,
padding, forgetting after an eager round, the glue graphs' safety mechanisms, and graph == eager
through the scheduler in every mode (CPU: ``EmulatedGraph``; GPU: real graphs)."""
from __future__ import annotations

from typing import List

import pytest
import torch

from engine_test_utils import make_scheduler
from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import EmulatedGraph
from sglang.srt.model_executor.graph_refill import GLUE_CAPTURE_AFTER, GraphRefill
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from test_cuda_graph_runner import KW, MODEL, VOCAB, _gpu_prompts, _request, _requests, _run

pytestmark = pytest.mark.usefixtures("two_torch_threads")
FIELDS = ("steps", "temperatures")


def _live_info(n: int, temperature: float = 0.5) -> SamplingBatchInfo:
    sp = SamplingParams.from_dict({"temperature": temperature})
    sp.verify(VOCAB)
    return SamplingBatchInfo.from_reqs([sp.normalize(None)] * n, [[]] * n, VOCAB)


class CountingGraph(EmulatedGraph):
    """An emulated graph that counts its captures and replays."""

    captures = 0
    replays = 0

    def capture(self, fn):
        CountingGraph.captures += 1
        return super().capture(fn)

    def replay(self):
        CountingGraph.replays += 1
        super().replay()


def _refill(mode: str, max_bs: int = 4, n: int = 2, new_graph=CountingGraph) -> GraphRefill:
    static_info = _live_info(max_bs, temperature=1.0)
    CountingGraph.captures = CountingGraph.replays = 0
    return GraphRefill(mode, torch.zeros(max_bs, dtype=torch.int64),
                       torch.zeros(max_bs, n, dtype=torch.int64), static_info, new_graph)


def test_changed_mode_copies_only_what_changed():
    r = _refill("changed")
    slots, info = torch.tensor([3, 5]), _live_info(2)
    loc = r.loc_buffer(2)
    assert loc.data_ptr() == r.loc.data_ptr()  # allocated in place
    loc.copy_(torch.tensor([[7, 8], [9, 10]]))
    r.before(2, slots, loc, info, FIELDS)
    assert r.slots[:2].tolist() == [3, 5] and r.info.temperatures[:2].tolist() == [0.5, 0.5]
    # Same live objects: nothing is copied again (a stale static value would survive).
    r.slots[0] = 99
    r.info.temperatures[0] = 9.0
    r.before(2, slots, loc, info, FIELDS)
    assert r.slots[0] == 99 and r.info.temperatures[0] == 9.0
    # A new slot tensor / sampling object (the batch changed) is copied.
    r.before(2, torch.tensor([3, 5]), loc, info, FIELDS)
    assert r.slots[0] == 3 and r.info.temperatures[0] == 9.0
    r.before(2, slots, loc, _live_info(2), FIELDS)
    assert r.info.temperatures[0] == 0.5
    # A field the last copy did not cover is copied.
    r.info.top_ps[0] = 0.1
    r.before(2, slots, loc, info, FIELDS + ("top_ps",))
    assert r.info.top_ps[0] == 1.0
    # forget() (an eager round moved the live counters) copies everything again.
    r.slots[0] = 99
    r.forget()
    r.before(2, slots, loc, info, FIELDS)
    assert r.slots[0] == 3


def test_changed_mode_copies_a_loc_that_is_not_in_place_and_zeroes_padding():
    r = _refill("changed")
    r.loc_buffer(4).copy_(torch.arange(1, 9).view(4, 2))
    r.before(4, torch.tensor([1, 2, 3, 4]), r.loc[:4], _live_info(4), FIELDS)
    own = torch.tensor([[20, 21]])
    r.before(2, torch.tensor([6]), own, _live_info(1), FIELDS)  # bs 1 padded to 2
    assert r.slots.tolist() == [6, 0, 0, 0]
    assert r.loc.tolist() == [[20, 21], [0, 0], [0, 0], [0, 0]]


def test_full_mode_copies_every_time_and_allocates_no_buffer():
    r = _refill("full")
    assert r.loc_buffer(2) is None
    slots, info, loc = torch.tensor([3, 5]), _live_info(2), torch.tensor([[1, 2], [3, 4]])
    r.before(4, slots, loc, info, FIELDS)
    r.slots[0] = 99
    r.before(4, slots, loc, info, FIELDS)
    assert r.slots.tolist() == [3, 5, 0, 0] and r.loc[:2].tolist() == [[1, 2], [3, 4]]
    r.info.steps[:2] = 7
    r.after(slots, info)
    assert info.steps.tolist() == [7, 7]


def test_glue_graphs_capture_on_the_third_sighting_and_check_the_live_tensors():
    r = _refill("glue")
    slots, info = torch.tensor([3, 5]), _live_info(2)
    loc = r.loc_buffer(2)
    for i in range(GLUE_CAPTURE_AFTER - 1):  # eager refills (the warm-ups)
        r.before(2, slots, loc, info, FIELDS)
        r.after(slots, info)
        assert CountingGraph.captures == 0 and r.glue_replays == 0
    r.before(2, slots, loc, info, FIELDS)  # captured (pre + post) and replayed
    assert CountingGraph.captures == 2 and r.glue_replays == 1
    r.info.steps[:2] = 4
    r.after(slots, info)  # the post graph copies the counters back
    assert info.steps.tolist() == [4, 4]
    r.slots[0] = 99
    r.before(2, slots, loc, info, FIELDS)  # the glue graph replays the full refill
    assert r.slots[0] == 3 and r.glue_replays == 2
    # Other live tensors: eager refill (the frozen graph would read the old ones).
    other = torch.tensor([4, 6])
    r.before(2, other, loc, info, FIELDS)
    assert r.slots[:2].tolist() == [4, 6] and r.glue_replays == 2
    r.after(other, info)


def test_a_failed_glue_capture_turns_glue_graphs_off_for_good(caplog):
    class Broken(EmulatedGraph):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    r = _refill("glue", new_graph=Broken)
    slots, info = torch.tensor([1]), _live_info(1)
    with caplog.at_level("WARNING"):
        for _ in range(GLUE_CAPTURE_AFTER + 2):
            r.before(1, slots, r.loc_buffer(1), info, FIELDS)
            r.after(slots, info)
    assert r.glue_failed and "operation not permitted" in r.glue_failed
    assert r.slots[0] == 1 and r.glue_replays == 0
    assert sum("glue graph capture failed" in m for m in caplog.messages) == 1


def test_glue_is_ignored_for_workers_that_plan_attention_on_the_host(monkeypatch, caplog):
    sched = make_scheduler(MODEL, **KW)
    worker = sched.round_worker
    monkeypatch.setattr(type(worker), "host_planned_attention", True, raising=False)
    with envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.override(True), caplog.at_level("WARNING"):
        runner = worker.init_cuda_graphs([1], emulate=True)
    assert runner.refill.mode == "changed"
    assert any("rebuilds its attention plan" in m for m in caplog.messages)


@pytest.mark.slow  # ~14 s each; "changed" (the default) runs in test_cuda_graph_runner
@pytest.mark.parametrize("mode", ["full", "glue"])  # "changed" (the default): test_cuda_graph_runner
def test_every_refill_mode_equals_eager_through_the_scheduler(mode):
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)
    eager = make_scheduler(MODEL, **KW, **spec)
    want = _run(eager, _requests(eager.tokenizer), stagger=3)
    graphed = make_scheduler(MODEL, **KW, **spec)
    if mode == "full":  # the reference refill: a test / benchmark parameter
        runner = graphed.round_worker.init_cuda_graphs([1, 2, 4], emulate=True, refill_mode="full")
    else:  # glue: SGLANG_ENABLE_METADATA_GLUE_GRAPH, the opt-in variable
        with envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.override(True):
            runner = graphed.round_worker.init_cuda_graphs([1, 2, 4], emulate=True)
    assert runner.refill.mode == mode
    assert _run(graphed, _requests(graphed.tokenizer), stagger=3) == want
    if mode == "glue":
        assert runner.refill.glue_replays > 0


@pytest.mark.gpu
def test_refill_modes_equal_eager_on_cuda():
    """Real graphs, bf16, Triton kernels: greedy (batch 4 staggered) and seeded sampled tokens
    with each refill mode == eager, plain and NEXTN-3."""
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384, max_running_requests=8)
    for spec in ({}, dict(speculative_algorithm="NEXTN", speculative_num_steps=3)):
        eager = make_scheduler(MODEL, disable_cuda_graph=True, disable_overlap_schedule=True,
                               **kw, **spec)
        prompts = _gpu_prompts(eager.tokenizer)
        reqs: List = [_request(f"g{i}", p, max_new_tokens=128, temperature=0, ignore_eos=True)
                      for i, p in enumerate(prompts)]
        reqs += [_request(f"s{i}", p, max_new_tokens=48, temperature=0.8, top_p=0.9,
                          sampling_seed=5 + i, ignore_eos=True) for i, p in enumerate(prompts)]
        want = _run(eager, reqs, stagger=2)
        del eager
        for mode in ("full", "changed", "glue"):
            torch.cuda.empty_cache()
            graphed = make_scheduler(MODEL, disable_cuda_graph=True, **kw, **spec)
            runner = graphed.round_worker.init_cuda_graphs([1, 2, 4, 8], refill_mode=mode)
            assert runner.refill.mode == mode
            got = _run(graphed, reqs, stagger=2)
            print(f"refill {mode} nextn={spec.get('speculative_num_steps', 0)}: "
                  f"equal={got == want} replays={runner.num_replays} "
                  f"glue_replays={runner.refill.glue_replays} failed={runner.failed}")
            assert got == want, f"refill {mode} {spec}"
            assert runner.num_replays > 0 and not runner.failed
            del graphed
